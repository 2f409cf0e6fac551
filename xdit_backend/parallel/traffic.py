"""Counting the bytes a rank sends in the collectives of one request (for the bench).

Opt-in, per request: while counting, the torch.distributed entry points that the data plane
uses are wrapped, so yunchang's all-to-all and ring traffic is counted as well as our own.
"Sent" is the algorithmic volume each rank must put on the wire:
all_gather: its piece to every other rank, (W−1)·n; the single-tensor all-gather (FSDP2's gather of a
sharded block's weights, parallel/shard.py; ``all_gather_single`` from torch 2.13, ``all_gather_into_tensor``
before: distributed/compat.py; counted as ``shard_all_gather``): the same, (W−1)·n; all_to_all_single: all but its own share,
(W−1)/W·n; isend: n (point-to-point goes through batch_isend_irecv, ours as yunchang's).
Broadcasts, and any collective on the ``control`` group (the step gate, the model cache's memory
agreement), are the control plane and counted apart, as ``control``.

A compiled model's traffic is not counted. Dynamo guards on the torch.distributed functions a
compiled block calls (``dist.all_to_all_single`` in yunchang's all-to-all, ``dist.all_gather``):
swapping them for a profiled request would compile every block again for that request (its step
times would include the compile) and keep a second set of graphs against the recompile limit.
Compiled and eager requests send the same bytes, so the eager count serves for both.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch.distributed as dist

from ..distributed import compat


def _nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


@contextmanager
def counting(compiled: bool, control=None):
    """Yields a Counter of bytes sent by this rank, by collective, while the block runs; for a
    ``compiled`` model, None, with torch.distributed left as it is. ``control``: the control group,
    whose gathers are counted as ``control``, not as data."""
    if compiled:
        yield None
        return
    sent: Counter = Counter()
    gathers = compat.single_tensor_all_gathers()
    originals = {name: getattr(dist, name) for name in ("all_gather", *gathers, "all_to_all_single",
                                                        "batch_isend_irecv", "broadcast")}

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        kind = "control" if control is not None and group is control else "all_gather"
        sent[kind] += _nbytes(tensor) * (dist.get_world_size(group) - 1)
        return originals["all_gather"](tensor_list, tensor, group=group, async_op=async_op)

    def single_tensor_all_gather(name: str):
        def gather(output_tensor, input_tensor, group=None, async_op=False):
            sent["shard_all_gather"] += _nbytes(input_tensor) * (dist.get_world_size(group) - 1)
            return originals[name](output_tensor, input_tensor, group=group, async_op=async_op)

        return gather

    def all_to_all_single(output, input, *args, group=None, **kwargs):
        world = dist.get_world_size(group)
        sent["all_to_all"] += _nbytes(input) * (world - 1) // world
        return originals["all_to_all_single"](output, input, *args, group=group, **kwargs)

    def batch_isend_irecv(ops):
        sent["p2p"] += sum(_nbytes(op.tensor) for op in ops if op.op is dist.isend)
        return originals["batch_isend_irecv"](ops)

    def broadcast(tensor, src, group=None, async_op=False):
        if dist.get_rank() == src:
            sent["control"] += _nbytes(tensor) * (dist.get_world_size(group) - 1)
        return originals["broadcast"](tensor, src=src, group=group, async_op=async_op)

    wrappers = {"all_gather": all_gather, **{name: single_tensor_all_gather(name) for name in gathers},
                "all_to_all_single": all_to_all_single, "batch_isend_irecv": batch_isend_irecv, "broadcast": broadcast}
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)
    try:
        yield sent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
