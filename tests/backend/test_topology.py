"""The links the backend measures at start: peer access, NCCL_P2P_DISABLE decided before the process
group exists, and the bandwidth probe that status reports as ``topology``."""

import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import SMALL

from xdit_backend.distributed import runtime
from xdit_backend.distributed.topology import P2P_ENV, nccl_p2p_setting, peer_access
from xdit_backend.launch.options import LaunchOptions


def test_a_world_2_gloo_backend_reports_its_one_pair_in_status(backends):
    client = backends.start(2, topology_probe="on")
    links = client.status()["topology"]
    assert [pair["ranks"] for pair in links["pairs"]] == [[0, 1]]
    pair = links["pairs"][0]
    assert pair["p2p"] is False  # CPU ranks share no GPU memory
    assert pair["bandwidth_gbps"] > 0 and links["compute_tflops"] > 0
    assert links["nccl_p2p"] is None  # gloo: nothing for NCCL to decide
    assert links["measured"] == "measured at this start"  # nothing kept yet (tests/ranks/test_kept_topology.py)
    _, info = client.sample({**SMALL, "parallel": "auto"})
    said = info["layout"]
    assert re.search(r"CPU ranks over gloo at [0-9.e+-]+ GB/s \(measured at this start\)", said), said


def test_without_the_probe_status_has_the_pairs_but_no_figures(backend2):
    links = backend2.status()["topology"]  # the tests' backends start with --topology-probe off
    assert links["pairs"] == [{"ranks": [0, 1], "p2p": False, "bandwidth_gbps": None}]
    assert links["compute_tflops"] is None


def test_peer_access_asks_the_driver_for_each_ordered_pair(monkeypatch):
    """Three GPUs: 0 and 1 reach each other, 2 reaches 0 but not back (an asymmetric answer stays asymmetric)."""
    reach = {(0, 1), (1, 0), (2, 0)}
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) in reach)
    assert peer_access(3) == [[True, True, False], [True, True, False], [True, False, True]]


def test_a_pair_without_peer_access_turns_nccl_p2p_off():
    value, note = nccl_p2p_setting([[True, True, False], [True, True, False], [True, False, True]], {})
    assert value == "1"
    assert f"{P2P_ENV}=1, set by the backend" in note
    assert "2 of 3 pairs" in note and "cuda:0 and cuda:2" in note


def test_peer_access_everywhere_leaves_nccl_alone():
    value, note = nccl_p2p_setting([[True, True], [True, True]], {})
    assert value is None and "every pair of this node's 2 GPUs has peer access" in note


def test_the_users_setting_wins_and_status_says_how_to_let_the_backend_decide():
    lacking = [[True, False], [False, True]]
    value, note = nccl_p2p_setting(lacking, {P2P_ENV: "0"})
    assert value is None
    assert f"{P2P_ENV}=0, as the environment set it" in note and "unset it" in note
    value, note = nccl_p2p_setting([[True, True], [True, True]], {P2P_ENV: "1"})
    assert value is None and note == f"{P2P_ENV}=1, as the environment set it"


class Joined(Exception):
    """Stands in for the process group: the test stops start_runtime where NCCL would read its environment."""


def test_start_runtime_decides_nccl_p2p_before_the_process_group_exists(monkeypatch):
    """NCCL reads NCCL_P2P_DISABLE when init_process_group creates the communicator (device_id bound)."""
    monkeypatch.setenv(P2P_ENV, "unset below")
    monkeypatch.delenv(P2P_ENV)  # restored (removed) after the test, whatever start_runtime writes
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)  # a consumer board
    seen = {}

    def init_process_group(backend, **kwargs):
        seen["backend"], seen[P2P_ENV] = backend, os.environ.get(P2P_ENV)
        raise Joined

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    with pytest.raises(Joined):
        runtime.start_runtime(LaunchOptions(socket=Path("/tmp/xdit-unused.sock"), device="cuda"))
    assert seen == {"backend": "nccl", P2P_ENV: "1"}
