"""Two nodes of one rank each on loopback (torchrun's static rendezvous at node 0's endpoint):
node 0 holds the socket, and a ulysses=2 request across the two nodes equals serial."""

import os
import signal
import time

import pytest
from conftest import free_port, short_socket_dir
from backend.test_concurrency import FIELDS, serial

from xdit_backend.client import Client
from xdit_backend.launch import launcher


def test_two_nodes_on_loopback_serve_one_backend(zygote_launches):
    """Both launchers forked from the worker's zygote, which reaps node 1's when it ends."""
    endpoint = f"127.0.0.1:{free_port()}"
    sockets = [short_socket_dir() / "backend.sock" for _ in range(2)]
    nodes = [launcher.LaunchOptions(socket=sockets[rank], nproc=1, device="cpu", nnodes=2, node_rank=rank,
                                    rdzv_endpoint=endpoint) for rank in (1, 0)]
    follower = launcher.start(nodes[0])  # returns at once: it waits for node 0 in the rendezvous
    try:
        status = launcher.start(nodes[1])  # returns when every rank of both nodes answers
        assert status["world_size"] == 2 and len(status["ranks"]) == 2
        client = Client(sockets[0])
        result, info = client.sample({**FIELDS, "seed": 4, "parallel": {"ulysses": 2}})
        assert info["world_size"] == 2
        assert (result["samples"] - serial(4)).abs().max() <= 1e-4
        assert not sockets[1].exists()  # node 1 runs ranks only: no socket, no queue
    finally:
        launcher.stop(sockets[0], timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(follower["pid"], 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            os.killpg(follower["pid"], signal.SIGKILL)
            raise AssertionError("node 1's launcher did not end with node 0's shutdown")


def test_several_nodes_need_an_endpoint_and_a_valid_node_rank(tmp_path):
    with pytest.raises(launcher.LaunchError, match="needs --rdzv-endpoint"):
        launcher.LaunchOptions(socket=tmp_path / "b.sock", nnodes=2, device="cpu").resolved()
    with pytest.raises(launcher.LaunchError, match="--node-rank 2 must lie in 0..1"):
        launcher.LaunchOptions(socket=tmp_path / "b.sock", nnodes=2, node_rank=2, rdzv_endpoint="127.0.0.1:1",
                               device="cpu").resolved()
