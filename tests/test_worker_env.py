"""The environment the ranks start with, and how GPUs are named: pure functions over fake
environments (no GPU needed), and torch.cuda's queries replaced where a rank describes itself."""

from pathlib import Path

import pytest

from xdit_backend import gpus
from xdit_backend.errors import LaunchError
from xdit_backend.launch_options import LaunchOptions

SOCKET = Path("/tmp/xdit-env/b.sock")


# ------------------------------------------------------------------ which GPUs (gpus.py, resolved())


def test_an_index_the_parents_list_lacks_is_refused_with_the_list_and_the_fix():
    with pytest.raises(LaunchError) as raised:
        gpus.chosen_gpus({"CUDA_VISIBLE_DEVICES": "3"}, (0, 1), 1)
    message = str(raised.value)
    assert "--gpus 0,1" in message and "no GPU 1" in message and "CUDA_VISIBLE_DEVICES=3" in message
    assert "--cuda-device" in message and "0..0" in message
    assert gpus.chosen_gpus({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, (1, 3), 4) == ["5", "7"]
    assert gpus.chosen_gpus({}, (0, 2), 4) == ["0", "2"]  # no list: nvidia-smi's numbers


def test_only_the_gpus_cuda_can_use_count():
    """ComfyUI's --default-device 2 lists 32 indices; on 4 GPUs CUDA sees 2,0,1,3 and stops."""
    env = {"CUDA_VISIBLE_DEVICES": ",".join(["2", *(str(i) for i in range(32) if i != 2)])}
    assert gpus.available_gpus(env, 4) == ["2", "0", "1", "3"]
    with pytest.raises(LaunchError, match="no GPU 4"):
        gpus.chosen_gpus(env, (4,), 4)
    assert gpus.available_gpus({}, 3) == ["0", "1", "2"]
    assert gpus.available_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == []


def test_resolved_counts_the_gpus_the_parent_may_use_and_says_so(monkeypatch, caplog):
    """ComfyUI's CUDA_VISIBLE_DEVICES=3 on an 8-GPU machine: one GPU, and a warning saying why."""
    monkeypatch.setattr("xdit_backend.launch_options.cuda_device_count", lambda: 1)  # torch applies the list
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with caplog.at_level("WARNING", logger="xdit_backend.launch"):
        resolved = LaunchOptions(socket=SOCKET).resolved()
    assert (resolved.device, resolved.nproc) == ("cuda", 1)
    assert "CUDA_VISIBLE_DEVICES=3" in caplog.text and "1 GPU(s)" in caplog.text
    with pytest.raises(LaunchError, match="no GPU 1 among the 1 GPU"):
        LaunchOptions(socket=SOCKET, gpus=(0, 1)).resolved()


def test_resolved_takes_gpus_within_the_parents_list(monkeypatch):
    monkeypatch.setattr("xdit_backend.launch_options.cuda_device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert LaunchOptions(socket=SOCKET, gpus=(1,)).resolved().nproc == 1
    assert LaunchOptions(socket=SOCKET).resolved().nproc == 2
