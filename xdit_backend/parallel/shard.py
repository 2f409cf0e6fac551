"""Weight sharding on torch's FSDP2: each rank keeps 1/S of every transformer block's weights.

S is the size of the layout's shard mesh (mesh.py): the ranks that run the same blocks, all of
them, or under PipeFusion the ranks of one stage. What ``shard_blocks`` does to a model:

- Every block of the family's StagePlan block lists (a PipeFusion stage: the blocks it kept) gets
  ``fully_shard(block, mesh, reshard_after_forward=True)``. Its parameters become DTensors of
  ⌈rows/S⌉ dim-0 rows each (the last rank's padded), all-gathered together, one collective per
  block call, in the block's forward pre-hook, and freed again in its forward hook.
- The transformer gets ``fully_shard`` as well, with every parameter outside the blocks ignored:
  the embeddings and the final norm and projection stay whole on every rank, and the transformer
  is the one FSDP root that owns the blocks' shared state (streams, the all-gather in flight).
- Forward prefetch: block i's pre-hook starts block i + 1's all-gather (across the block lists:
  Flux's last double block prefetches its first single block), so on CUDA the gather runs on
  FSDP's all-gather stream while block i computes. Peak: two gathered blocks besides the shards.
- The root is initialised at once: PipeFusion calls the blocks without the transformer's forward,
  and the first block called would otherwise make itself a root (and its prefetch target, not
  initialised yet, would have no streams).

The rule FSDP relies on: every rank of the shard mesh calls the blocks the same number of times,
in the same order (each call's all-gather is a collective over the mesh). It holds for every
layout ParallelConfig accepts: CFG's halves each run one pass per model call (cond on one, uncond
on the other); sequence ranks each run the blocks on their slice of the tokens; dp groups run
equal batch slices (the dp rule), one model call per sampler call each; a PipeFusion stage's
ranks (across cfg, dp and sequence) run the same work list (schedule.items) through its blocks.
What would break it, a rank skipping a model call, no layout does; validate refuses the one case
where sharding means nothing (a shard mesh of one rank).

Loading (``RowSharding``): each block is built on meta, sharded there, materialised on the device and
filled with only this rank's rows of each parameter, read from the memory-mapped file (the other rows
are never read): a rank's host and device hold its shards and the layers outside the blocks, never a
whole block, and the file's pages a rank touches are its own share. Where FSDP2 keeps some parameters
whole (torch 2.7: one dtype per block; before 2.13: a GGUF model's integer blocks; ``whole_on_every_rank``)
the model is built on the CPU and ``fully_shard`` moves each block to the device as it shards it: the
host holds the whole model, the device the shards and one whole block.

Storage precision: parameters of several dtypes in one block (an fp8 file's float8 matrices next to
its bf16 norms) are all-gathered as bytes in the same single collective (FSDP2 views them as uint8).
Torch 2.7's FSDP2 takes one dtype per block: there the parameters of the block's other dtypes (by
bytes, the minor ones: biases, norms) stay whole on every rank (distributed/compat.py).

Traffic: per call of a block, each rank sends its shard to the S − 1 others and receives theirs:
(S − 1) · ⌈rows/S⌉ · (bytes per row), summed over the block's parameters, ≈ (S − 1)/S of the
block's bytes (``gathered_bytes``; traffic.py counts it as ``shard_all_gather``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from ..distributed import compat


def blocks_of(model) -> list[nn.Module]:
    """The transformer's blocks in execution order (its family's StagePlan block lists, concatenated)."""
    transformer = model.transformer
    return [block for name in model.spec.stage_plan.block_lists for block in getattr(transformer, name)]


class RowSharding:
    """Loading straight into the shards (models/weights.BlockSharding): each block is built with meta stand-ins
    of its parameters, sharded on meta, materialised on the device, and given this rank's rows as read from the
    file, so no rank ever holds a whole block's values (the file's other rows are never read). FSDP2 cuts dim 0
    as ``torch.chunk`` does: ⌈rows/S⌉ rows a rank, the last ones shorter or empty."""

    def __init__(self, mesh: DeviceMesh, device: torch.device):
        self.mesh, self.device = mesh, device
        self.rank, self.size = mesh.get_local_rank(), mesh.size()

    def rows(self, length: int) -> tuple[int, int]:
        chunk = math.ceil(length / self.size)
        return min(length, self.rank * chunk), min(length, (self.rank + 1) * chunk)

    def shard(self, block: nn.Module, parts: dict[str, torch.Tensor]) -> None:
        real = [(module, name, buffer) for module in block.modules()
                for name, buffer in module._buffers.items() if buffer is not None and not buffer.is_meta]
        fully_shard(block, mesh=self.mesh, reshard_after_forward=True)  # meta parameters → meta DTensor shards
        block.to_empty(device=self.device)  # the shards allocated, uninitialised (and the buffers emptied…)
        for module, name, buffer in real:  # …so they are put back: a stored weight's scale, computed tables
            module._buffers[name] = buffer
        with torch.no_grad():
            for name, param in block.named_parameters():
                param.to_local().copy_(parts[name])  # FSDP2 pads it into its own storage at lazy init


def row_sharding(mesh: DeviceMesh, device: torch.device, integer_weights: bool = False) -> RowSharding | None:
    """A loader that reads only this rank's rows of each block, or None where this torch's FSDP2 keeps some of a
    block's parameters whole (``whole_on_every_rank``: 2.7's minor dtypes; before 2.13 a GGUF model's
    ``integer_weights``): then the blocks are built whole on the CPU and sharded after, by shard_blocks."""
    return None if builds_whole_first(integer_weights) else RowSharding(mesh, device)


def builds_whole_first(integer_weights: bool) -> bool:
    """Whether a sharded model is built whole in host memory before it is sharded, on this torch (row_sharding)."""
    return not compat.fsdp_shards_mixed_dtypes() or (integer_weights and not compat.fsdp_shards_integer_parameters())


def shards_its_matrices(gguf: bool) -> bool:
    """Whether sharding shrinks a model's weight matrices on this torch: not a GGUF model's before 2.13, whose
    quantized blocks stay whole on every rank (``whole_on_every_rank``), so the fit check counts them whole."""
    return not gguf or compat.fsdp_shards_integer_parameters()


def whole_on_every_rank(block: nn.Module) -> set[nn.Parameter] | None:
    """The parameters of ``block`` this torch's FSDP2 cannot shard, kept whole on every rank (compat.py): on 2.7 those
    of its minor dtypes, before 2.13 the integer ones (GGUF blocks); None when it shards them all."""
    whole = set() if compat.fsdp_shards_mixed_dtypes() else minor_dtype_parameters(block)
    if not compat.fsdp_shards_integer_parameters():
        whole |= {param for param in block.parameters() if not param.is_floating_point()}
    return whole or None


def shard_blocks(model, mesh: DeviceMesh, device: torch.device):
    """Shard every block of ``model`` over ``mesh`` (1-D) with forward prefetch (blocks a RowSharding loaded are
    sharded already), keep the other layers whole, and put those on ``device``; returns the model."""
    transformer = model.transformer
    blocks = blocks_of(model)
    for block in blocks:
        if isinstance(block, FSDPModule):
            continue
        # moves the block to the mesh's device
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=whole_on_every_rank(block))
    replicated = {p for p in transformer.parameters() if not isinstance(p, DTensor)}
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True, ignored_params=replicated)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    _place_unsharded(transformer, blocks, device)
    fully_shard.state(transformer)._lazy_init()  # the root now, not the first block PipeFusion calls
    model.shard_mesh = mesh
    return model


def shard_network(network: nn.Module, blocks, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """Shard ``blocks`` (a ModuleList of ``network``, on ``device``) over ``mesh`` as ``shard_blocks`` shards a model's,
    the rest of ``network`` whole: a model patch's control blocks beside the model's own (each rank calls them
    one by one, in the model's block order)."""
    blocks = list(blocks)
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, ignored_params=whole_on_every_rank(block))
    replicated = {p for p in network.parameters() if not isinstance(p, DTensor)}
    fully_shard(network, mesh=mesh, reshard_after_forward=True, ignored_params=replicated)
    for block, following in zip(blocks, blocks[1:]):
        block.set_modules_to_forward_prefetch([following])
    fully_shard.state(network)._lazy_init()  # its blocks are called directly, never through its forward
    return network


def minor_dtype_parameters(block: nn.Module) -> set[nn.Parameter]:
    """The parameters of ``block`` whose dtype is not the one holding most of its bytes."""
    by_dtype: dict[torch.dtype, int] = {}
    for param in block.parameters():
        by_dtype[param.dtype] = by_dtype.get(param.dtype, 0) + param.numel() * param.element_size()
    major = max(by_dtype, key=by_dtype.get, default=None)
    return {param for param in block.parameters() if param.dtype != major}


def _place_unsharded(transformer: nn.Module, blocks: list[nn.Module], device: torch.device) -> None:
    """Move the parameters FSDP ignored (it leaves them where they are: the layers outside the blocks, and those
    ``whole_on_every_rank`` keeps on an older torch) and the buffers outside the blocks to ``device``."""
    inside = {id(module) for block in blocks for module in block.modules()}
    with torch.no_grad():
        for module in transformer.modules():
            for name, param in module._parameters.items():
                if param is not None and not isinstance(param, DTensor) and param.device != device:
                    module._parameters[name] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
            if id(module) in inside:
                continue
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)


def mesh_of(model) -> DeviceMesh | None:
    """The mesh ``model``'s blocks are sharded over (None: not sharded)."""
    return getattr(model, "shard_mesh", None)


def resident_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds for ``module``: a sharded parameter's local shard only."""
    return sum(_local(p).numel() * p.element_size() for p in module.parameters())


def gathered_bytes(blocks: list[nn.Module], shard_size: int) -> int:
    """Bytes each rank sends (and receives) to gather ``blocks`` once each over ``shard_size`` ranks:
    (S − 1) · ⌈rows/S⌉ · bytes per row, per parameter (the all-gather's input is the padded shard)."""
    total = 0
    for block in blocks:
        for param in block.parameters():
            rows = param.shape[0] if param.dim() else 1
            per_row = param.numel() // rows * param.element_size()
            total += (shard_size - 1) * math.ceil(rows / shard_size) * per_row
    return total


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param
