"""What the ranks' links are: peer access between each pair of GPUs, a short bandwidth probe per
pair, and the compute rate that the layout choice (ParallelConfig.auto) weighs them against.

Two moments, both in runtime.start_runtime:
- before the process group exists: this node's peer-access matrix, and NCCL_P2P_DISABLE decided
  from it. NCCL reads the variable when a communicator is created, and with a bound ``device_id``
  that happens inside init_process_group, so later is too late. Every rank of a node asks the
  driver the same question and gets the same answer, so the ranks agree without communicating.
- right after: every rank walks the pairs (i < j) in the same order; ranks i and j exchange a
  buffer with ONE ``batch_isend_irecv([send, recv])`` on the default group (on NCCL, batched
  point-to-point runs on that group's own communicator: no communicator is created for the probe),
  and the figures are shared over the control group (gloo).

``--topology-probe off`` skips the timing (multi-node, or tests that do not need it): peer access is
still known, the bandwidths are None, and ``auto`` keeps its fixed order.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..device import compute_dtype
from .control import gather_json

P2P_ENV = "NCCL_P2P_DISABLE"
EXCHANGE_BYTES = {"cuda": 32 << 20, "cpu": 1 << 20}  # per direction and round: long enough to see bandwidth
MATMUL_SIZE = {"cuda": 4096, "cpu": 384}  # square products for the compute rate
TIMED_ROUNDS = 3  # after one warm-up round (which also connects the pair)


@dataclass(frozen=True)
class Pair:
    """Two ranks and the link between them."""

    ranks: tuple[int, int]
    p2p: bool  # each GPU can access the other's memory (same node); False on the CPU and between nodes
    bandwidth_gbps: float | None  # GB/s (10⁹ bytes/s) each rank sent while both directions ran; None: not probed

    def to_json(self) -> dict:
        return {"ranks": list(self.ranks), "p2p": self.p2p, "bandwidth_gbps": self.bandwidth_gbps}


@dataclass(frozen=True)
class Topology:
    """The backend's links as measured at start: what ``status`` reports as ``topology``."""

    device: str  # "cuda" or "cpu"
    pairs: tuple[Pair, ...] = ()
    compute_tflops: float | None = None  # the slowest rank's matmul rate in the device's default dtype
    nccl_p2p: str | None = None  # NCCL_P2P_DISABLE as the ranks run with it, and why (CUDA only)

    def to_json(self) -> dict:
        return {"pairs": [p.to_json() for p in self.pairs], "compute_tflops": self.compute_tflops,
                "nccl_p2p": self.nccl_p2p}

    def slowest(self, ranks: Iterable[tuple[int, int]]) -> Pair | None:
        """The slowest of these pairs' links; None when one of them was not probed (or there are none)."""
        by_ranks = {p.ranks: p for p in self.pairs}
        chosen = [by_ranks[tuple(sorted(r))] for r in ranks]
        if not chosen or any(p.bandwidth_gbps is None for p in chosen):
            return None
        return min(chosen, key=lambda p: p.bandwidth_gbps)

    def describe(self, pair: Pair) -> str:
        """A link in words, with its figure: 'GPUs without peer access at 11 GB/s'."""
        if self.device == "cpu":
            kind = "CPU ranks over gloo"
        else:
            kind = ("GPUs with peer access" if pair.p2p
                    else "GPUs without peer access (PCIe through the host, or another node)")
        return f"{kind} at {pair.bandwidth_gbps:.3g} GB/s"


# --------------------------------------------------------------------------- before init_process_group

def peer_access(count: int) -> list[list[bool]]:
    """[a][b]: GPU cuda:a of this node can access the memory of cuda:b (the diagonal is True)."""
    return [[a == b or torch.cuda.can_device_access_peer(a, b) for b in range(count)] for a in range(count)]


def nccl_p2p_setting(peer: list[list[bool]], environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the NCCL_P2P_DISABLE value to set, or None to leave the environment as it is; the sentence
    status shows). A pair without peer access in either direction turns NCCL's P2P transport off for
    the node: consumer boards that lack it are where NCCL hangs (the user's own setting wins)."""
    count = len(peer)
    missing = [(a, b) for a in range(count) for b in range(a + 1, count) if not (peer[a][b] and peer[b][a])]
    lacking = (f"{len(missing)} of {count * (count - 1) // 2} pairs of this node's GPUs have no peer access "
               f"(cuda:{missing[0][0]} and cuda:{missing[0][1]} first)") if missing else ""
    if P2P_ENV in environ:
        advice = f"; {lacking}: unset it to let the backend set 1" if missing and environ[P2P_ENV] == "0" else ""
        return None, f"{P2P_ENV}={environ[P2P_ENV]}, as the environment set it{advice}"
    if missing:
        return "1", (f"{P2P_ENV}=1, set by the backend: {lacking}, and NCCL's peer-to-peer transport can hang "
                     "there; NCCL goes through host memory instead")
    return None, f"{P2P_ENV} unset: every pair of this node's {count} GPUs has peer access"


def prepare_nccl(local_world: int) -> tuple[list[list[bool]], str]:
    """Query this node's peer access and set NCCL_P2P_DISABLE where it is missing: call it before
    init_process_group. Returns the matrix (for the probe) and the sentence for status."""
    peer = peer_access(local_world)
    value, note = nccl_p2p_setting(peer, os.environ)
    if value is not None:
        os.environ[P2P_ENV] = value
    return peer, note


# --------------------------------------------------------------------------- after init_process_group

def probe(rt, peer: list[list[bool]] | None, nccl_note: str | None, timed: bool) -> Topology:
    """Every rank: measure the pairs' bandwidth (when ``timed``) and this rank's compute rate, share
    them over the control group, and return the same Topology on every rank. ``rt`` is the Runtime."""
    device = rt.device.type
    if rt.world_size == 1:
        return Topology(device, (), None, nccl_note)
    pairs = [(i, j) for i in range(rt.world_size) for j in range(i + 1, rt.world_size)]
    seconds = _exchange_pairs(rt, pairs) if timed else {}
    mine = {"node": int(os.environ.get("GROUP_RANK", 0)), "local_rank": rt.local_rank, "peer": peer,
            "seconds": seconds, "tflops": _compute_rate(rt.device) if timed else None, "note": nccl_note}
    records = gather_json(mine, rt.control)
    sent = EXCHANGE_BYTES[device] * TIMED_ROUNDS
    found = []
    for i, j in pairs:
        a, b = records[i], records[j]
        p2p = a["node"] == b["node"] and a["peer"] is not None and \
            a["peer"][a["local_rank"]][b["local_rank"]] and a["peer"][b["local_rank"]][a["local_rank"]]
        key = f"{i},{j}"
        bandwidth = round(sent / max(a["seconds"][key], b["seconds"][key]) / 1e9, 3) if timed else None
        found.append(Pair((i, j), bool(p2p), bandwidth))
    tflops = min(r["tflops"] for r in records) if timed else None
    notes = list(dict.fromkeys(r["note"] for r in records if r["note"]))  # one per node that differs
    return Topology(device, tuple(found), tflops, "; ".join(notes) or None)


def _exchange_pairs(rt, pairs: list[tuple[int, int]]) -> dict[str, float]:
    """This rank's seconds for the timed rounds of each pair it belongs to, keyed "i,j"."""
    device = rt.device
    elements = EXCHANGE_BYTES[device.type]
    send = torch.ones(elements, dtype=torch.uint8, device=device)  # [bytes]
    recv = torch.empty_like(send)  # [bytes]
    # Batched point-to-point among a subset of a group's ranks is allowed only after a collective
    # of the whole group (torch's batch_isend_irecv note): this one involves every rank.
    dist.all_reduce(torch.ones(1, device=device))  # [1]
    seconds = {}
    for i, j in pairs:
        if rt.rank not in (i, j):
            continue
        partner = j if rt.rank == i else i
        _exchange(send, recv, partner)  # warm-up: connects the pair and lines both ranks up
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(TIMED_ROUNDS):
            _exchange(send, recv, partner)
        _synchronize(device)
        seconds[f"{i},{j}"] = time.perf_counter() - started
    return seconds


def _exchange(send: torch.Tensor, recv: torch.Tensor, partner: int) -> None:
    """Both directions at once, posted together so neither rank's send waits for the other's receive."""
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, partner), dist.P2POp(dist.irecv, recv, partner)])
    for work in works:
        work.wait()


def _compute_rate(device: torch.device) -> float:
    """This rank's matmul rate (TFLOP/s) in the dtype requests default to on this device."""
    n = MATMUL_SIZE[device.type]
    a = torch.full((n, n), 1.0 / n, dtype=compute_dtype("auto", device), device=device)  # [n, n]
    torch.mm(a, a)  # warm-up (kernel selection, first-touch allocation)
    _synchronize(device)
    started = time.perf_counter()
    for _ in range(TIMED_ROUNDS):
        torch.mm(a, a)
    _synchronize(device)
    return round(2 * n ** 3 * TIMED_ROUNDS / (time.perf_counter() - started) / 1e12, 4)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
