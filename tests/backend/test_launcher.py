"""Which failure the launcher reports when several ranks end at once; the environment and the process each rank
runs in."""

import signal
from pathlib import Path

import pytest

from xdit_backend.errors import EXIT_PEER_LOST
from xdit_backend.launch.launcher import _root_cause


def failure(rank, exitcode, timestamp=100):
    return {"rank": rank, "exitcode": exitcode, "timestamp": timestamp, "pid": 1000 + rank, "what": ""}


@pytest.mark.parametrize("failures,cause", [
    # rank 1 SIGKILLed; the agent then SIGTERMs rank 0 in the same second
    ([failure(0, -signal.SIGTERM), failure(1, -signal.SIGKILL)], 1),
    # rank 1 SIGKILLed; rank 0 noticed first and exited as having lost a peer
    ([failure(0, EXIT_PEER_LOST), failure(1, -signal.SIGKILL)], 1),
    # rank 2 raised; the others lost it or were stopped
    ([failure(0, EXIT_PEER_LOST), failure(1, -signal.SIGTERM), failure(2, 1)], 2),
    # two real failures: the earlier one
    ([failure(0, 1, timestamp=101), failure(1, 1, timestamp=100)], 1),
    # only effects: still one is named
    ([failure(0, -signal.SIGTERM), failure(1, EXIT_PEER_LOST)], 0),
])
def test_root_cause_prefers_causes_over_effects(failures, cause):
    assert _root_cause(failures)["rank"] == cause


def test_a_collective_that_lost_its_peer_is_told_from_a_model_error():
    """gloo's transport errors (as yunchang's all-to-all raises them) mean a peer is gone; others do not."""
    from xdit_backend.distributed.control import PeerLost, is_peer_failure

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                        "[127.0.0.1]:34182: Connection reset by peer.")
    assert is_peer_failure(gloo) and is_peer_failure(PeerLost("gone"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(MemoryError("out of memory"))


def test_an_nccl_failure_is_a_peers_only_when_nccl_says_so():
    """PyTorch raises every NCCL failure as a DistBackendError: this rank's own CUDA out-of-memory
    inside NCCL is this rank's failure; a remote error or a watchdog timeout is a peer's."""
    import torch
    import torch.distributed as dist

    from xdit_backend.distributed.control import is_peer_failure

    own_oom = dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:77, unhandled cuda error (run with "
        "NCCL_DEBUG=INFO for details), NCCL version 2.27.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
        "Last error:\nCuda failure 2 'out of memory'")
    remote = dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or "
        "there was a network error, NCCL version 2.27.5\nncclRemoteError: A call failed possibly due to a network "
        "error or a remote process exiting prematurely.")
    timeout = dist.DistBackendError(
        "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLTOALL_BASE, "
        "NumelIn=4096, NumelOut=4096, Timeout(ms)=300000) ran for 300007 milliseconds before timing out.")
    assert not is_peer_failure(own_oom) and not is_peer_failure(RuntimeError("NCCL_P2P_DISABLE is set"))
    assert not is_peer_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_peer_failure(remote) and is_peer_failure(timeout)
    assert is_peer_failure(dist.DistNetworkError("Connection reset by peer"))


def test_the_ranks_run_in_the_environment_the_launcher_built(backends, monkeypatch):
    """ComfyUI's cudaMallocAsync setting reaches the ranks replaced, with the NCCL and thread settings
    (read from each rank's /proc/PID/environ: what the process really started with)."""
    from xdit_backend.launch.worker_env import usable_cpus

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64,backend:cudaMallocAsync")
    for name in ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        monkeypatch.delenv(name, raising=False)
    status = backends.start(2, fresh=True).status()  # a process of its own: /proc/PID/environ is what it runs with
    threads = str(max(1, usable_cpus() // 2))
    for rank in status["ranks"]:
        raw = Path(f"/proc/{rank['pid']}/environ").read_bytes().split(b"\0")
        env = dict(entry.decode().split("=", 1) for entry in raw if b"=" in entry)
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
        assert env["OMP_NUM_THREADS"] == threads == env["TORCHINDUCTOR_COMPILE_THREADS"]
        assert rank["threads"] == int(threads)


def test_the_ranks_fork_from_a_one_thread_fork_server_not_from_the_launcher(backend):
    """A rank forked from the launcher, which runs torch.distributed's store threads, can inherit a lock one of
    them held and wait on it forever (launcher.start_fork_server). Each rank's parent is the fork server, a child
    of the launcher that runs one thread (the zygote's backends: its fork server is a fork of the launcher)."""
    status = backend(2).status()

    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    servers = {parent(rank["pid"]) for rank in status["ranks"]}
    assert len(servers) == 1 and status["pid"] not in servers
    (server,) = servers
    assert parent(server) == status["pid"]
    assert len(list(Path(f"/proc/{server}/task").iterdir())) == 1
