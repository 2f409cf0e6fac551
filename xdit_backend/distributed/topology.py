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

The figures are kept per machine (``kept_file``) and a later start of the same ranks on the same devices
reuses them instead of timing again: a probe's figure varies from start to start (0.80 against 1.53 GB/s
between two starts of one machine), and ``auto`` deciding from a fresh one gave the same request ring=2
before a restart and ulysses=2 after, a different latent for the same seed. ``--topology-probe again``
times anew and replaces what was kept; ``off`` skips the timing (multi-node, or tests that do not need it):
peer access is still known, the bandwidths are None, and ``auto`` keeps its fixed order.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..device import compute_dtype
from ..launch import gpus
from .control import gather_json

P2P_ENV = "NCCL_P2P_DISABLE"
KEPT_ENV = "XDIT_TOPOLOGY_FILE"  # where the measured figures are kept (kept_file)
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
    measured: str | None = None  # when the figures were timed, and whether kept from an earlier start

    def to_json(self) -> dict:
        return {"pairs": [p.to_json() for p in self.pairs], "compute_tflops": self.compute_tflops,
                "nccl_p2p": self.nccl_p2p, "measured": self.measured}

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
        return f"{kind} at {pair.bandwidth_gbps:.3g} GB/s" + (f" ({self.measured})" if self.measured else "")


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

def probe(rt, peer: list[list[bool]] | None, nccl_note: str | None, mode: str = "on") -> Topology:
    """Every rank: the same Topology on every rank. ``mode`` (--topology-probe): "on" reuses the figures
    kept for these ranks on these devices (kept_file) and times the pairs' bandwidth and this rank's
    compute rate only when none are kept; "again" times and keeps anew; "off" times nothing. ``rt`` is
    the Runtime."""
    device = rt.device.type
    if rt.world_size == 1:
        return Topology(device, (), None, nccl_note)
    pairs = [(i, j) for i in range(rt.world_size) for j in range(i + 1, rt.world_size)]
    records = gather_json({"node": int(os.environ.get("GROUP_RANK", 0)), "local_rank": rt.local_rank,
                           "peer": peer, "note": nccl_note, "identity": _identity(rt)}, rt.control)
    notes = "; ".join(dict.fromkeys(r["note"] for r in records if r["note"])) or None  # one per node that differs
    links = [(i, j, _p2p(records[i], records[j])) for i, j in pairs]
    if mode == "off":
        return Topology(device, tuple(Pair((i, j), p2p, None) for i, j, p2p in links), None, notes)
    key = json.dumps([r["identity"] for r in records])
    kept = _read_kept(key, pairs) if rt.rank == 0 and mode == "on" else None
    figures = gather_json({"kept": kept}, rt.control)[0]["kept"]  # rank 0's answer: every rank decides alike
    if figures is None:
        figures = _measure(rt, pairs)
        if rt.rank == 0:
            _keep(key, figures)
        when = "measured at this start"
    else:
        when = time.strftime("measured %Y-%m-%d %H:%M, kept", time.localtime(figures["at"]))
    found = tuple(Pair((i, j), p2p, figures["gbps"][f"{i},{j}"]) for i, j, p2p in links)
    return Topology(device, found, figures["tflops"], notes, when)


def _identity(rt) -> list:
    """What a kept measurement belongs to: this rank's machine, device, threads and torch."""
    cuda = rt.device.type == "cuda"
    return [socket.gethostname(), str(rt.device), torch.cuda.get_device_name(rt.device) if cuda else "cpu",
            gpus.device_uuid(rt.device) if cuda else None, torch.get_num_threads(), torch.__version__]


def _p2p(a: dict, b: dict) -> bool:
    """The two ranks' GPUs can access each other's memory (same node, both directions)."""
    return bool(a["node"] == b["node"] and a["peer"] is not None
                and a["peer"][a["local_rank"]][b["local_rank"]] and a["peer"][b["local_rank"]][a["local_rank"]])


def _measure(rt, pairs: list[tuple[int, int]]) -> dict:
    """Time every pair's link and every rank's matmul rate: {"gbps": {"i,j": GB/s}, "tflops", "at"}."""
    timed = gather_json({"seconds": _exchange_pairs(rt, pairs), "tflops": _compute_rate(rt.device)}, rt.control)
    sent = EXCHANGE_BYTES[rt.device.type] * TIMED_ROUNDS
    gbps = {f"{i},{j}": round(sent / max(timed[i]["seconds"][f"{i},{j}"], timed[j]["seconds"][f"{i},{j}"]) / 1e9, 3)
            for i, j in pairs}
    return {"gbps": gbps, "tflops": min(r["tflops"] for r in timed), "at": time.time()}


def kept_file(environ: Mapping[str, str] = os.environ) -> Path:
    """This machine's kept figures: $XDIT_TOPOLOGY_FILE, else $XDG_CACHE_HOME (~/.cache)/comfyui-xdit/topology.json;
    one entry per set of ranks and devices measured."""
    if environ.get(KEPT_ENV):
        return Path(environ[KEPT_ENV])
    cache = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "comfyui-xdit" / "topology.json"


def _kept_entries() -> dict:
    """Every entry of the kept file; none when it is missing or damaged (then it is written anew)."""
    try:
        entries = json.loads(kept_file().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _read_kept(key: str, pairs: list[tuple[int, int]]) -> dict | None:
    """The figures kept for ``key``, or None: none kept, or a damaged entry (then they are measured, and the
    entry rewritten)."""
    figures = _kept_entries().get(key)
    try:
        numbers = [figures["tflops"], figures["at"], *(figures["gbps"][f"{i},{j}"] for i, j in pairs)]
    except (KeyError, TypeError):
        return None
    sane = all(isinstance(n, (int, float)) and not isinstance(n, bool) and 0 < n < float("inf") for n in numbers)
    return figures if sane else None


def _keep(key: str, figures: dict) -> None:
    """Add these figures to the kept file (written whole, then renamed: a reader never sees half of it). A
    file that cannot be written only means the next start measures again."""
    path = kept_file()
    entries = {**_kept_entries(), key: figures}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)
    except OSError:
        pass


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
