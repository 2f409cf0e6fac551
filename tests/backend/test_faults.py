"""A rank killed mid-request: a readable error naming it, quickly, and a restart on the next request."""

import os
import signal
import time

import pytest
import torch
from conftest import LONG, SMALL, Backends, arm_fault, fault_file, running, serial_of

from xdit_backend.client import BackendDied, BackendError, Client


def test_sigkill_of_rank_1_fails_the_request_and_the_next_one_restarts(backends, zygote_launches):
    client = backends.start(2)
    before = client.status()
    rank1_pid = before["ranks"][1]["pid"]
    reference, _ = client.sample(SMALL)

    killed_at = []

    def kill_rank_1(step, total, elapsed):
        if not killed_at:
            os.kill(rank1_pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(BackendDied) as info:
        client.sample(LONG, on_progress=kill_rank_1)
    took = time.monotonic() - killed_at[0]
    assert took < 30, f"the failure took {took:.1f} s to reach the client"
    assert info.value.rank == 1
    assert "rank 1 was killed by SIGKILL" in info.value.message
    assert "restarts the backend" in info.value.hint

    assert_all_gone(before)

    restarting = Client(client.socket_path, auto_start=True)
    result, _ = restarting.sample(SMALL)
    backends.track(client.socket_path)
    after = restarting.status()
    assert after["world_size"] == 2 and after["pid"] != before["pid"]
    assert torch.equal(result["samples"], reference["samples"])


def assert_all_gone(status: dict, within: float = 30) -> None:
    """Nothing of the backend ``status`` describes (launcher and ranks) is left after ``within`` s."""
    old = [status["pid"], *(r["pid"] for r in status["ranks"])]
    deadline = time.monotonic() + within
    while any(running(pid) for pid in old):
        assert time.monotonic() < deadline, f"processes left behind: {[p for p in old if running(p)]}"
        time.sleep(0.1)


def test_sigkill_of_rank_0_is_noticed_at_once_and_the_next_request_restarts(backends, zygote_launches):
    """Rank 0 holds the socket: the client sees the connection end (no hang), the launcher names
    rank 0, nothing is left behind, and the next request starts a new backend."""
    client = backends.start(2)
    before = client.status()
    reference, _ = client.sample(SMALL)
    killed_at = []

    def kill_rank_0(step, total, elapsed):
        if not killed_at:
            os.kill(before["ranks"][0]["pid"], signal.SIGKILL)
            killed_at.append(time.monotonic())

    with pytest.raises(BackendDied) as info:
        client.sample(LONG, on_progress=kill_rank_0)
    assert time.monotonic() - killed_at[0] < 30
    assert "rank 0 was killed by SIGKILL" in info.value.message, info.value.message
    assert_all_gone(before)
    restarting = Client(client.socket_path, auto_start=True)
    result, _ = restarting.sample(SMALL)
    backends.track(client.socket_path)
    assert restarting.status()["pid"] != before["pid"]
    assert torch.equal(result["samples"], reference["samples"])


def test_a_stopped_rank_is_named_within_the_heartbeat_and_the_next_request_restarts(backends, zygote_launches):
    """SIGSTOP on rank 1 mid-request: the launcher sees its process stopped, and after half the heartbeat
    (2.5 s here) kills it and names it, long before rank 0's collective would time out (30 s here): the
    error names rank 1 and its state, not the SIGTERM the launcher ends the others with, nor rank 0, which
    only waited. The next request restarts the backend."""
    client = backends.start(2, collective_timeout=60.0, heartbeat=5.0)
    before = client.status()
    rank1 = before["ranks"][1]["pid"]
    stopped_at = []

    def stop_rank_1(step, total, elapsed):
        if not stopped_at:
            os.kill(rank1, signal.SIGSTOP)
            stopped_at.append(time.monotonic())

    try:
        with pytest.raises(BackendDied) as info:
            client.sample({**LONG, "parallel": {"ulysses": 2}}, on_progress=stop_rank_1)
        took = time.monotonic() - stopped_at[0]
    finally:
        try:
            os.kill(rank1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert took < 15, f"the stopped rank was named after {took:.0f} s"  # the heartbeat, not the 30 s timeout
    assert info.value.rank == 1, info.value.message
    assert f"rank 1 stopped answering: its process (pid {rank1}) was stopped: SIGSTOP" in info.value.message
    assert_all_gone(before)
    restarting = Client(client.socket_path, auto_start=True)
    result, _ = restarting.sample(SMALL)
    backends.track(client.socket_path)
    assert torch.isfinite(result["samples"]).all()


@pytest.fixture(scope="module")
def short_timeouts():
    """One world-2 backend for the tests that fail a request with an armed fault (conftest.arm_fault) and
    go on with the same backend. Data collectives would wait half of --collective-timeout, 20 s here; a peer
    told of the failure at once ends well before (about 1 s idle; CI's load has stretched it to 6 s)."""
    manager = Backends()
    yield manager.start(2, collective_timeout=40.0, heartbeat=4.0)
    manager.cleanup()


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_an_exception_inside_the_model_fails_the_request_and_the_backend_keeps_serving(short_timeouts, failing_rank):
    """A simulated out-of-memory in one rank's 3rd model call under ulysses=2: the error names that
    rank and its exception, the other rank leaves its collective at once (the failed rank's groups are
    closed), and the same backend (no restart) serves the next request correctly."""
    client = short_timeouts
    before = client.status()
    fields = {**SMALL, "steps": 4, "parallel": {"ulysses": 2}}
    arm_fault(client, failing_rank, 3)
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        client.sample(fields)
    took = time.monotonic() - started
    assert info.value.kind == "out_of_memory" and info.value.rank == failing_rank
    assert (f"rank {failing_rank}: NotEnoughMemory: rank {failing_rank} ran out of memory (MemoryError: CUDA out "
            "of memory (simulated") in info.value.message
    assert "GB available of" in info.value.message and "shard_weights" in info.value.hint  # the bytes; the fixes
    assert "keeps serving" in info.value.hint
    assert took < 15, f"took {took:.1f} s"  # its peer was told at once, not after the group's 20 s timeout
    assert not fault_file(client.socket_path).exists()  # the failing rank took the fault: this one runs whole
    result, _ = client.sample(fields)
    assert client.status()["pid"] == before["pid"]  # the same backend: nothing restarted
    reference = Client(client.socket_path)  # and its answer is the right one
    again, _ = reference.sample({**fields, "parallel": {"ring": 2}})
    assert (result["samples"] - again["samples"]).abs().max() <= 1e-4


def test_with_the_step_cache_a_peer_is_told_of_the_failure_at_once(short_timeouts):
    """The step cache keeps its generation's groups (its decision's group, the sequence shard) only while the
    generation runs: after a failure nothing of it holds them, so the peer's collective fails at once."""
    fields = {**SMALL, "steps": 4, "cache": "teacache", "cache_threshold": 0.3, "parallel": {"ulysses": 2}}
    short_timeouts.sample(fields)  # its model and groups warm
    arm_fault(short_timeouts, 1, 3)
    started = time.monotonic()
    with pytest.raises(BackendError, match="simulated"):
        short_timeouts.sample(fields)
    took = time.monotonic() - started
    assert took < 15, f"took {took:.1f} s"  # not the group's 20 s timeout


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_an_exception_inside_a_pipefusion_stage_fails_the_request_and_the_backend_keeps_serving(
        short_timeouts, failing_rank):
    """A simulated out-of-memory in one PipeFusion stage mid-pipeline (a patch of step 1, with sends
    and receives posted ahead): the error names that rank and comes before the link's timeout (the failed
    stage's groups are closed at once, so its peer's receive fails), and the same backend serves the next
    request, whose latent equals the serial one."""
    client = short_timeouts
    before = client.status()
    fields = {**SMALL, "steps": 4, "parallel": {"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 1}}
    arm_fault(client, failing_rank, 4)
    started = time.monotonic()
    with pytest.raises(BackendError) as info:
        client.sample(fields)  # calls: step 0 whole (warm-up), then 4 patches a step: the 4th is step 1's 3rd
    took = time.monotonic() - started
    assert info.value.kind == "out_of_memory" and info.value.rank == failing_rank
    assert (f"rank {failing_rank}: NotEnoughMemory: rank {failing_rank} ran out of memory (MemoryError: CUDA out "
            "of memory (simulated") in info.value.message
    assert "GB available of" in info.value.message and "shard_weights" in info.value.hint  # the bytes; the fixes
    assert took < 15, f"took {took:.1f} s"  # its peer was told at once, not after the link's 20 s timeout
    fields["parallel"]["warmup_steps"] = 4  # warm-up over every step: exact
    result, _ = client.sample(fields)
    assert client.status()["pid"] == before["pid"]  # the same backend: nothing restarted
    serial = serial_of({k: v for k, v in fields.items() if k != "parallel"}, {})  # in this process: no fault
    assert (result["samples"] - serial).abs().max() <= 1e-4


def test_after_a_failed_request_the_sharded_model_is_sharded_again_over_the_new_groups(short_timeouts):
    """A simulated out-of-memory in rank 1's 3rd model call: the failure destroys the layout's groups,
    the shard group with them, so the next request shards the model anew over the rebuilt mesh and
    gives the unsharded latent. (On gloo a destroyed group's object still runs collectives, so this
    checks the path and the result; what the re-sharding prevents is NCCL's: aborted communicators.)"""
    client = short_timeouts
    fields = {**SMALL, "steps": 4, "parallel": {"ulysses": 2, "shard_weights": True}}
    arm_fault(client, 1, 3)
    with pytest.raises(BackendError, match="simulated"):
        client.sample(fields)
    result, info = client.sample(fields)
    assert "weights sharded 2 ways" in info["layout"]
    whole, _ = client.sample({**fields, "parallel": {"ulysses": 2}})
    assert (result["samples"] - whole["samples"]).abs().max() <= 1e-4

