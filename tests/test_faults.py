"""A rank killed mid-request: a readable error naming it, quickly, and a restart on the next request."""

import os
import signal
import time

import pytest
import torch
from conftest import LONG, SMALL

from xdit_backend.client import BackendDied, Client


def test_sigkill_of_rank_1_fails_the_request_and_the_next_one_restarts(backends):
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

    deadline = time.monotonic() + 30  # nothing of the old backend is left behind
    old = [before["pid"], *(r["pid"] for r in before["ranks"])]
    while any(_alive(pid) for pid in old):
        assert time.monotonic() < deadline, f"processes left behind: {[p for p in old if _alive(p)]}"
        time.sleep(0.1)

    restarting = Client(client.socket_path, auto_start=True)
    result, _ = restarting.sample(SMALL)
    backends.track(client.socket_path)
    after = restarting.status()
    assert after["world_size"] == 2 and after["pid"] != before["pid"]
    assert torch.equal(result["samples"], reference["samples"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
