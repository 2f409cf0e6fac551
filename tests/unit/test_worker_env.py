"""The environment the ranks start with, and how GPUs are named: pure functions over fake
environments (no GPU needed), and torch.cuda's queries replaced where a rank describes itself."""

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xdit_backend.distributed import runtime
from xdit_backend.errors import LaunchError
from xdit_backend.launch import gpus, worker_env
from xdit_backend.launch.options import LaunchOptions
from xdit_backend.launch.worker_env import worker_environment

SOCKET = Path("/tmp/xdit-env/b.sock")


# ------------------------------------------------------------------ which GPUs (gpus.py, resolved())


def test_an_index_the_parents_list_lacks_is_refused_with_the_list_and_the_fix():
    with pytest.raises(LaunchError) as raised:
        gpus.chosen_gpus({"CUDA_VISIBLE_DEVICES": "3"}, (0, 1), 1)
    message = str(raised.value)
    assert "gpus 0,1" in message and "--gpus" not in message and "no GPU 1" in message and "CUDA_VISIBLE_DEVICES=3" in message
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
    monkeypatch.setattr("xdit_backend.launch.options.cuda_device_count", lambda: 1)  # torch applies the list
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with caplog.at_level("WARNING", logger="xdit_backend.launch"):
        resolved = LaunchOptions(socket=SOCKET).resolved()
    assert (resolved.device, resolved.nproc) == ("cuda", 1)
    assert "CUDA_VISIBLE_DEVICES=3" in caplog.text and "1 GPU(s)" in caplog.text
    with pytest.raises(LaunchError, match="no GPU 1 among the 1 GPU"):
        LaunchOptions(socket=SOCKET, gpus=(0, 1)).resolved()


def test_resolved_takes_gpus_within_the_parents_list(monkeypatch):
    monkeypatch.setattr("xdit_backend.launch.options.cuda_device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert LaunchOptions(socket=SOCKET, gpus=(1,)).resolved().nproc == 1
    assert LaunchOptions(socket=SOCKET).resolved().nproc == 2


# ------------------------------------------------------------------ the ranks' environment (worker_env.py)


def options(**values) -> LaunchOptions:
    return LaunchOptions(**{"socket": SOCKET, "device": "cuda", "nproc": 2, **values})


def ranks_env(parent: dict, cpu_count=16, gpu_count=8, **values) -> dict:
    return worker_environment(parent, options(**values), cpu_count=cpu_count, gpu_count=gpu_count).env


def test_gpus_count_within_the_parents_visible_devices():
    """ComfyUI's --cuda-device sets CUDA_VISIBLE_DEVICES; --gpus are positions in that list."""
    assert ranks_env({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, gpus=(1, 3))["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert ranks_env({}, gpus=(0, 2))["CUDA_VISIBLE_DEVICES"] == "0,2"  # no list: nvidia-smi's numbers


def test_without_gpus_the_parents_list_is_kept_and_none_is_made_up():
    assert ranks_env({"CUDA_VISIBLE_DEVICES": "3"}, nproc=1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in ranks_env({})


def test_device_order_is_the_pci_bus_unless_the_user_chose_one():
    assert ranks_env({})["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert ranks_env({"CUDA_DEVICE_ORDER": "FASTEST_FIRST"})["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_a_cpu_backend_leaves_the_gpu_variables_alone():
    env = worker_environment({"CUDA_VISIBLE_DEVICES": "3"}, options(device="cpu", gpus=(0, 1)), cpu_count=4,
                             gpu_count=0).env
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "CUDA_DEVICE_ORDER" not in env


@pytest.mark.parametrize("inherited,expected", [
    ("backend:cudaMallocAsync", "expandable_segments:True"),  # ComfyUI's default
    ("max_split_size_mb:128,backend:cudaMallocAsync", "max_split_size_mb:128,expandable_segments:True"),
    ("backend: cudaMallocAsync , garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6,expandable_segments:True"),
    ("backend:cudaMallocAsync,expandable_segments:False", "expandable_segments:False"),  # the user's choice stays
])
def test_the_async_allocator_is_replaced_and_other_settings_kept(inherited, expected):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        built = worker_environment({name: inherited}, options(), cpu_count=4, gpu_count=2)
        assert built.env[name] == expected
        assert len(built.notes) == 1 and inherited in built.notes[0] and expected in built.notes[0]


def test_an_allocator_setting_without_the_async_backend_is_untouched():
    built = worker_environment({"PYTORCH_CUDA_ALLOC_CONF": "backend:native,max_split_size_mb:64"}, options(),
                               cpu_count=4, gpu_count=2)
    assert built.env["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native,max_split_size_mb:64" and built.notes == []
    assert "PYTORCH_CUDA_ALLOC_CONF" not in ranks_env({})


def test_nccl_errors_abort_the_communicator_and_dump_unless_the_user_chose():
    env = ranks_env({})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # its heartbeat monitor would end a backend that survived
    env = ranks_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_a_timeout_dump_has_a_buffer_to_dump_and_lands_beside_the_socket():
    """TORCH_NCCL_DUMP_ON_TIMEOUT dumps nothing without a flight-recorder buffer; the dump must
    outlive the restart that clears the per-rank error files."""
    env = ranks_env({})
    assert int(env[worker_env.trace_buffer_env()]) > 0
    assert Path(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]).parent == SOCKET.parent
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in ranks_env({"TORCH_FR_BUFFER_SIZE": "50"})  # the user's, newer name
    assert "TORCH_FR_BUFFER_SIZE" not in ranks_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"})  # the user's, older name
    assert ranks_env({"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t_"})["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/x/t_"


@pytest.mark.parametrize("version,name", [("2.7.1+cu128", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
                                          ("2.8.0", "TORCH_FR_BUFFER_SIZE"), ("2.13.0+cpu", "TORCH_FR_BUFFER_SIZE")])
def test_the_flight_recorder_buffer_takes_the_name_the_installed_torch_reads(version, name):
    """The newer name from 2.8 on (the older one warns there, twice per rank); the older one on 2.7."""
    assert worker_env.trace_buffer_env(version) == name


@pytest.mark.parametrize("cpus,nproc,threads", [(16, 4, "4"), (16, 3, "5"), (2, 8, "1")])
def test_gpu_ranks_share_the_cores_for_compute_and_compile_threads(cpus, nproc, threads):
    env = ranks_env({}, cpu_count=cpus, nproc=nproc)
    assert env["OMP_NUM_THREADS"] == threads and env["TORCHINDUCTOR_COMPILE_THREADS"] == threads


def test_the_users_thread_settings_stay_and_the_parent_env_is_not_changed():
    parent = {"OMP_NUM_THREADS": "7", "TORCHINDUCTOR_COMPILE_THREADS": "1", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    before = dict(parent)
    env = ranks_env(parent, gpus=(0, 1))
    assert env["OMP_NUM_THREADS"] == "7" and env["TORCHINDUCTOR_COMPILE_THREADS"] == "1"
    assert parent == before


# ------------------------------------------------------------------ a rank names its GPU


def test_a_gpu_rank_reports_its_physical_gpu_and_uuid(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid=f"0000000{torch.device(device).index}-aaaa-bbbb-cccc-dddddddddddd"))
    rt = runtime.Runtime(rank=1, world_size=2, local_rank=1, device=torch.device("cuda", 1), control=None,
                         started=0.0, timeout=timedelta(seconds=1))
    described = runtime.describe_rank(rt)
    assert described["device"] == "cuda:1" and described["gpu"] == "6"
    assert described["uuid"] == "GPU-00000001-aaaa-bbbb-cccc-dddddddddddd"


def test_a_cpu_rank_reports_no_gpu():
    rt = runtime.Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), control=None,
                         started=0.0, timeout=timedelta(seconds=1))
    described = runtime.describe_rank(rt)
    assert described["gpu"] is None and described["uuid"] is None


# ------------------------------------------------------------------ the ComfyUI node's checks


def rank(gpu, uuid=None, host="box"):
    return {"rank": 0, "device": "cuda:0", "gpu": gpu, "uuid": uuid, "host": host}


def test_a_running_backend_is_compared_by_physical_gpus():
    """ComfyUI started with CUDA_VISIBLE_DEVICES=2,3 asks for its GPU 1: physical GPU 3."""
    env = {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert gpus.running_elsewhere([rank("3")], env, (1,), 2, "box") is None
    said = gpus.running_elsewhere([rank("1")], env, (1,), 2, "box")
    assert "runs on GPUs 1" in said and "asks for GPUs 3" in said and "CUDA_VISIBLE_DEVICES=2,3" in said
    assert gpus.running_elsewhere([rank("0"), rank("1"), rank("0", host="other")], {}, (1, 0), 4, "box") is None


def test_comfyuis_gpu_is_freed_only_when_the_backend_may_use_it():
    ranks = [rank("1", "GPU-b"), rank("2", "GPU-c")]
    assert not gpus.uses_gpu(ranks, "GPU-a", "box")
    assert gpus.uses_gpu(ranks, "GPU-b", "box")
    assert gpus.uses_gpu(ranks, None, "box")  # ComfyUI's own UUID unknown
    assert gpus.uses_gpu([rank("1", None)], "GPU-a", "box")  # a rank's UUID unknown
    assert not gpus.uses_gpu([rank("1", "GPU-a", host="other")], "GPU-a", "box")  # another node's GPU
    assert not gpus.uses_gpu([{"rank": 0, "device": "cpu", "gpu": None, "uuid": None, "host": "box"}], "GPU-a", "box")
