"""The control plane between ranks: commands and small records over a CPU process group.

Commands travel as protocol frames inside uint8 tensors, so nothing is pickled between ranks
either. The group given here is a gloo group (the default group on CPU, a side group next to
NCCL on CUDA), so none of this touches the accelerator or synchronises with it.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ..wire import protocol


class PeerLost(Exception):
    """A collective failed because another rank stopped answering."""


# How a lost peer shows in a data collective. gloo's TCP transport raises RuntimeErrors from its own
# source files (read errors, closed or reset connections, timed-out receives), which the message
# names. PyTorch raises every NCCL failure as a DistBackendError naming NCCL's result code: only
# ncclRemoteError (a peer exited or cannot be reached) and the watchdog's timeout point at another
# rank; ncclUnhandledCudaError is this rank's own CUDA (out of memory, say), ncclInvalidUsage its call.
_PEER_CAUSES = ("gloo/transport/", "ncclRemoteError", "Watchdog caught collective operation timeout")


def is_peer_failure(exc: BaseException) -> bool:
    """Did a collective fail because another rank went away (rather than this rank's own work)?

    Told by the exception's type and, for the backends' own errors, by the cause the backend names,
    never by a word such as "NCCL" that this rank's own failures carry too. Data-plane collectives
    (yunchang's all-to-all, the ring, gathers) raise gloo's transport errors as plain RuntimeErrors;
    those mean a peer is gone, exactly as PeerLost does on the control plane.
    """
    if isinstance(exc, (PeerLost, dist.DistNetworkError, dist.DistStoreError)):
        return True
    if isinstance(exc, torch.OutOfMemoryError):  # this rank's allocation, whoever raised it
        return False
    return isinstance(exc, RuntimeError) and any(cause in str(exc) for cause in _PEER_CAUSES)


def _collective(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistBackendError) as exc:
        raise PeerLost(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


def broadcast_bytes(data: bytes | None, group, src: int = 0) -> bytes:
    """Send ``data`` from ``src`` to every rank of ``group``; every rank returns it."""
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    _collective(dist.broadcast, length, src=src, group=group)  # [1]
    if dist.get_rank() == src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    else:
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
    if buffer.numel():
        _collective(dist.broadcast, buffer, src=src, group=group)  # [length]
    return buffer.numpy().tobytes()


def broadcast_message(message: protocol.Message | None, group, src: int = 0) -> protocol.Message | None:
    """Broadcast one protocol message (tensors included) from ``src``; None is a heartbeat. A group of one rank
    has no one to tell: the message is returned as it is (not encoded and decoded for nobody)."""
    if dist.get_world_size(group) == 1:
        return message
    frame = protocol.encode_bytes(message) if message is not None else b""
    data = broadcast_bytes(frame if dist.get_rank() == src else None, group, src)
    if not data:
        return None
    return protocol.decode_bytes(data, protocol.Limits(max_payload_bytes=len(data)), direction="request")


def barrier(group) -> None:
    """Wait until every rank of ``group`` has arrived."""
    _collective(dist.barrier, group=group)


def gather_json(record: dict, group) -> list[dict]:
    """Every rank contributes a small JSON record; every rank gets the list ordered by rank."""
    data = json.dumps(record).encode()
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    _collective(dist.all_gather, lengths, length, group=group)  # world × [1]
    width = int(max(t.item() for t in lengths))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
    _collective(dist.all_gather, gathered, padded, group=group)  # world × [width]
    return [json.loads(g[: int(n.item())].numpy().tobytes()) for g, n in zip(gathered, lengths)]


class StepGate:
    """Once per denoising step, every rank learns whether to go on: rank 0 may stop (a cancel, a
    client that went away), and any rank may report that it failed.

    This is how a cancel or a failure anywhere stops every rank within one step (two under
    PipeFusion, whose stages meet a step's gate where they stand when it ends), and it bounds how
    long any rank waits. A request always ends with one closed gate: ranks other than 0 loop
    ``while gate.passes()`` without knowing the step count, rank 0 calls ``close()`` however its
    work ended, and a rank that raised calls ``fail()`` (the others see ``failed`` at the gate).
    """

    def __init__(self, group):
        self.group = group
        self._flags = torch.zeros(2, dtype=torch.int64)  # [stop: rank 0's say, failed: any rank's]
        self.open = False
        self.failed = False

    def passes(self, stop: bool = False, failed: bool = False) -> bool:
        """Returns True on every rank when the work should go on."""
        self._flags[0], self._flags[1] = int(stop), int(failed)
        _collective(dist.all_reduce, self._flags, op=dist.ReduceOp.MAX, group=self.group)  # [2]
        self.failed = bool(self._flags[1])
        self.open = not (self._flags[0] or self._flags[1])
        return self.open

    def begin(self) -> None:
        """Every rank: a request starts; the ranks meet at the gate after each step."""
        self.open, self.failed = True, False

    def close(self) -> None:
        """Rank 0: close the gate unless it is closed already."""
        if self.open:
            self.passes(stop=True)

    def fail(self) -> None:
        """This rank raised: meet the others at the gate with the news (unless it is closed already)."""
        if self.open:
            self.passes(failed=True)
