"""The CLI as users run it: start, status, stop, sample, and a rank that cannot start."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import running, short_socket_dir
from safetensors.torch import load_file

from xdit_backend.client import Client
from xdit_backend.launch import launcher
from xdit_backend.launch.worker_env import START_FAULT_ENV
from xdit_backend.wire import paths


def cli(*args, timeout=240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xdit_backend.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def sock():
    path = short_socket_dir() / "backend.sock"
    yield path
    launcher.stop(path, timeout=15)
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def start2():
    """``xdit-backend start`` of a 2-rank backend: its socket and the status it printed. The tests that sample
    use it; test_start_status_stop, the module's last test, asks it again and stops it."""
    path = short_socket_dir() / "backend.sock"
    started = cli("start", "--socket", path, "--nproc", 2, "--device", "cpu")
    assert started.returncode == 0, started.stderr
    yield path, json.loads(started.stdout)
    launcher.stop(path, timeout=15)
    shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def started2(start2):
    return start2[0]


def test_a_rank_that_cannot_start_fails_start_with_its_number(sock):
    """Asking for one more CUDA rank than there are GPUs: that rank fails, start says which and why.

    A start that waited for the failed rank instead would end on its own --timeout, saying the backend
    did not become ready: the message checks below tell the two apart without timing anything."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result = cli("start", "--socket", sock, "--nproc", gpus + 1, "--device", "cuda", "--timeout", 150, timeout=200)
    if not gpus:  # refused before any rank starts: the machine's reason, exit 2 (tests/unit/test_cli_mistakes.py)
        assert result.returncode == 2 and "sees no CUDA device" in result.stderr and "Traceback" not in result.stderr
        return
    assert result.returncode == 1
    assert f"rank {gpus} exited with code 1" in result.stderr
    assert "StartupError" in result.stderr and "visible" in result.stderr


def test_a_rank_that_fails_its_start_is_named_with_its_reason(sock):
    """A rank whose start fails (here rank 1 of 2 CPU ranks, by the test-only START_FAULT_ENV, as a rank whose GPU
    is missing fails on a GPU machine): start exits 1 naming that rank, its exit code and its StartupError."""
    result = cli("start", "--socket", sock, "--nproc", 2, "--device", "cpu", "--timeout", 150, timeout=200,
                 env={START_FAULT_ENV: "1"})
    assert result.returncode == 1, result.stderr
    assert "rank 1 exited with code 1" in result.stderr
    assert "StartupError" in result.stderr and "rank 1 cannot start" in result.stderr


def test_sample_world_1_and_2_seeds(sock, started2, tmp_path):
    """Through the socket: world 1 (a backend started for the one request) and world 2 agree; the same
    seed repeats, another seed differs."""
    common = ["--model", "flux-tiny", "--width", 128, "--height", 64, "--steps", 3]
    out = {}
    ephemeral = cli("sample", *common, "--socket", sock, "--seed", 5, "--nproc", 1, "--device", "cpu",
                    "--out", tmp_path / "w1.st")
    assert ephemeral.returncode == 0, ephemeral.stderr
    assert "starting one for this request" in ephemeral.stderr
    assert "loading flux-tiny on 1 ranks (the model's first run" in ephemeral.stderr  # not a silent wait
    assert Client(sock).hello_or_none() is None, "the ephemeral backend must be stopped after the request"
    out["w1"] = load_file(tmp_path / "w1.st")["samples"]

    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        result = cli("sample", *common, "--socket", started2, "--seed", seed, "--out", tmp_path / f"{name}.st")
        assert result.returncode == 0, result.stderr
        assert "step 3/3" in result.stderr
        out[name] = load_file(tmp_path / f"{name}.st")["samples"]

    assert out["w1"].shape == (1, 16, 8, 16) and out["w1"].dtype == torch.float32
    assert torch.equal(out["a"], out["b"])  # the same backend repeats itself bit for bit
    assert (out["w1"] - out["a"]).abs().max() <= 1e-4  # world 2 shares the work (auto layout)
    assert (out["a"] - out["c"]).abs().max() > 0.1


def test_sample_with_embeds_file_and_batch(started2, tmp_path):
    """--embeds supplies the conditioning; --batch 2 gives two latents, each its own noise slice."""
    from safetensors.torch import save_file

    embeds = {"context": torch.randn(2, 5, 64), "pooled": torch.randn(2, 32)}
    save_file(embeds, tmp_path / "embeds.st")
    common = ["--model", "flux-tiny", "--width", 64, "--height", 64, "--steps", 2, "--seed", 3, "--socket", started2]
    result = cli("sample", *common, "--batch", 2, "--embeds", tmp_path / "embeds.st", "--out", tmp_path / "o.st")
    assert result.returncode == 0, result.stderr
    samples = load_file(tmp_path / "o.st")["samples"]
    assert samples.shape == (2, 16, 8, 8)
    assert not torch.equal(samples[0], samples[1])


def test_a_video_with_audio_writes_both_latents_and_takes_them_back(started2, tmp_path):
    """LTX-2's result holds the video and the audio (samples, audio_samples in --out); given back as --latent, both
    go in (a second pass at denoise 0 returns them as they were)."""
    common = ["--model", "ltx2-tiny", "--width", 64, "--height", 64, "--frames", 9, "--seed", 3, "--socket", started2]
    result = cli("sample", *common, "--steps", 2, "--out", tmp_path / "av.st")
    assert result.returncode == 0, result.stderr
    written = load_file(tmp_path / "av.st")
    assert written["samples"].shape == (1, 128, 2, 2, 2) and written["audio_samples"].shape == (1, 8, 9, 16)
    again = cli("sample", *common, "--steps", 2, "--denoise", 0, "--latent", tmp_path / "av.st",
                "--out", tmp_path / "b.st")
    assert again.returncode == 0, again.stderr
    back = load_file(tmp_path / "b.st")
    assert all(torch.equal(back[name], written[name]) for name in ("samples", "audio_samples"))


def test_shutdown_is_answered_and_ends_every_process(backends):
    """The client that asks for the shutdown gets a result, not an error, and every rank exits."""
    client = backends.start(2)
    status = client.status()
    client.shutdown()
    assert client.hello_or_none() is None  # it returns once the socket no longer answers: a status finds none
    deadline = time.monotonic() + 30
    pids = [status["pid"], *(r["pid"] for r in status["ranks"])]
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, "the backend did not exit after shutdown"
        time.sleep(0.05)
    state = launcher.read_state(client.socket_path)
    assert state["status"] == "stopped", state.get("failures")
    assert not paths.rank_pids(client.socket_path).exists()  # the ranks' pid records go with them


def test_sample_layout_flags(sock, started2, tmp_path):
    """--ulysses 2 with no backend starts one of 2 ranks; a running backend of another size refuses by size."""
    request = ["--model", "flux-tiny", "--width", 64, "--height", 64, "--steps", 2]
    common = [*request, "--socket", sock, "--device", "cpu"]
    result = cli("sample", *common, "--ulysses", 2, "--out", tmp_path / "u.st", "--info", tmp_path / "info.json",
                 "--cache", "fbcache", "--cache-start", 0, "--cache-end", 0)
    assert result.returncode == 0, result.stderr
    assert "world 2: ulysses=2 (as requested)" in result.stderr
    info = json.loads((tmp_path / "info.json").read_text())  # --info: the result info, for scripts
    assert info["layout"] == "ulysses=2 (as requested)" and info["world_size"] == 2 and info["elapsed_s"] > 0
    assert info["cache"]["computed"] + info["cache"]["reused"] == 2 and info["cache"]["computed"] >= 1

    refused = cli("sample", *request, "--socket", started2, "--ring", 3, "--out", tmp_path / "r.st")
    assert refused.returncode == 1
    assert "multiply to 3" in refused.stderr and "the backend runs 2 ranks" in refused.stderr
    assert "--nproc 3" in refused.stderr and "xdit-backend stop" in refused.stderr
    # launch flags for a backend that already runs with others would be ignored: refused, with the way out
    other = cli("sample", *request, "--socket", started2, "--nproc", 4, "--out", tmp_path / "n.st")
    assert other.returncode == 2 and "already serves" in other.stderr and "nproc 2" in other.stderr
    assert "--nproc 4 would be ignored" in other.stderr and "xdit-backend stop" in other.stderr


def test_sample_pipefusion_flags(started2, tmp_path):
    """--pipefusion 2 --patches 4 --warmup-steps 1 runs that layout on a 2-rank backend (the flags that
    start one when none runs: test_sample_layout_flags)."""
    result = cli("sample", "--model", "flux-tiny", "--width", 64, "--height", 64, "--steps", 3, "--socket", started2,
                 "--pipefusion", 2, "--patches", 4, "--warmup-steps", 1, "--out", tmp_path / "p.st")
    assert result.returncode == 0, result.stderr
    assert "world 2: pipefusion=2 (4 patches, warm-up 1) (as requested)" in result.stderr
    assert load_file(tmp_path / "p.st")["samples"].shape == (1, 16, 8, 8)


def test_start_status_stop(start2):
    """Last in the module: it stops the backend the other tests sampled on."""
    sock, status = start2
    assert status["world_size"] == 2
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    assert {r["device"] for r in status["ranks"]} == {"cpu"}
    assert status["protocol"] == 1 and status["models"] == [] and status["uptime_s"] >= 0

    asked = cli("status", "--socket", sock, "--json")
    assert asked.returncode == 0
    assert json.loads(asked.stdout)["pid"] == status["pid"]
    readable = cli("status", "--socket", sock).stdout
    assert f"(pid {status['pid']}), world size 2" in readable and "rank 1: cpu" in readable
    assert "unloads the models never, stops never" in readable
    assert "flux-tiny" in readable.split("models loaded:")[1]  # what the tests before sampled on it

    again = cli("start", "--socket", sock, "--nproc", 2, "--device", "cpu")
    assert again.returncode == 2 and "already answers" in again.stderr and "xdit-backend stop" in again.stderr

    stopped = cli("stop", "--socket", sock)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    for pid in [status["pid"], *(r["pid"] for r in status["ranks"])]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    gone = cli("status", "--socket", sock)
    assert gone.returncode == 1 and "no backend answers" in gone.stderr
    assert not sock.exists()
