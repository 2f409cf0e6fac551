"""The written memory model of one rank: the bytes a request needs there, before anything is loaded.

Per rank, ``total = weights + activations + workspace`` (bytes), read from the transformer's own
modules (on the meta device, or loaded) and its config, never from a table of models:

weights
    resident: every parameter and buffer at its storage precision (``storage_bytes_per_value``:
    2 for bf16, 1 for fp8, a GGUF block type's bytes per value: ``gguf_storage``). When sharded
    (FSDP2, ``shard_ranks`` > 1) a block parameter of dim 0 = n keeps ⌈n/R⌉ of its rows on each of
    the R ranks (FSDP2 pads dim 0 to a multiple of R); the rest (embedders, final layers) is whole
    on every rank. Under PipeFusion a rank holds its stage's share of the blocks (1/stages).
    transient: when sharded, the gathered blocks (the running one and, with prefetch, the next)
    whole at their storage precision; when the storage is not the compute dtype, one layer's weight
    upcast to the compute dtype (the largest Linear's out × in).
activations (what one block's forward holds at its peak, per token, × rows × tokens per rank)
    With C = heads × head dim (the hidden width) and F the widest per-token projection of a block
    (its MLP's up-projection, or a fused QKV+MLP projection; modulation layers, whose input is the
    timestep embedding and whose output is per row, are not per-token), the elements per token are
        3·C   the residual stream: the block's input, its normed copy and its output
      + 3·C   Q, K and V
      + C     the attention's output
      + 2·F   the widest projection's output and its activation's (GELU/SwiGLU) output
    at the compute dtype's size, plus per row 12·C for the modulation vectors (two streams × shift,
    scale and gate for attention and MLP). A timestep per token (Wan 2.2 TI2V-5B under a noise mask,
    ``modulation_per_token``) adds per token the time embedding and its projection (7·C at the compute
    dtype) and a block's modulation sum, taken in float32 (6·C at 4 bytes): diffusers' per-token form.
    Inference holds no graph: one block's peak is the peak.
    Under PipeFusion each of the stage's blocks also keeps its attention's K and V over the whole
    sequence (parallel/stale_kv.py: every sequence rank holds the whole chunk's), 2·C per token of
    all ring × ulysses ranks, × rows × the stage's blocks (⌈blocks / stages⌉) × the buffers a block
    keeps (``stale_buffers``: the most of any block, 2 for SD3.5's dual attention), for the whole
    generation.
workspace (the attention kernel's own, per rank)
    fused kernels (flash, cuDNN, memory-efficient; the CPU's flash kernel): the float32 log-sum-exp,
    rows × heads × tokens per rank × 4 bytes (Ulysses trades tokens for heads: the product is the
    same). The math path (``attention="math"``): the score matrix and its softmax, 2 × rows ×
    (heads/U) × (tokens per rank × U)² per ring step, at the compute dtype. Sequence parallelism
    adds its buffers per token: Ulysses the all-to-all's outputs for Q, K, V and the attention output
    (4·C); Ring the K/V block in flight (2·C) and the float32 output accumulator (C at 4 bytes).

Pure: no process group, no device query; the model cache's fit check and ``bench memory`` call it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

StorageRule = float | Callable[[str, torch.nn.Parameter], float]
# modulation layers, applied per row (a timestep), not per token: AdaLayerNorm's .linear, Qwen's img_mod, MiniMax-H3's
# adaln_proj
_PER_ROW = re.compile(r"(^|\.)(norm\w*|\w*mod\w*|adaln\w*)(\.|$)")
MODULATION_PER_ROW = 12  # × C: two streams × (shift, scale, gate) × (attention, MLP)


@dataclass(frozen=True)
class Estimate:
    """Bytes one rank needs for a request; ``weights_resident`` is the part that stays between requests."""

    weights: int
    activations: int
    workspace: int
    weights_resident: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.workspace


def block_lists(transformer: torch.nn.Module) -> tuple[str, ...]:
    """The transformer's top-level ModuleLists of blocks (what FSDP2 shards block by block)."""
    return tuple(name for name, child in transformer.named_children() if isinstance(child, torch.nn.ModuleList))


def in_blocks(name: str, lists: tuple[str, ...]) -> bool:
    return name.split(".", 1)[0] in lists


def fp8_storage(compute_dtype: torch.dtype) -> Callable[[str, torch.nn.Parameter], float]:
    """fp8 storage (a ComfyUI fp8 file, or weight_dtype fp8_*): matrices at 1 byte a value, vectors
    (biases, norms) in the compute dtype."""
    size = compute_dtype.itemsize
    return lambda name, param: 1.0 if param.dim() >= 2 else float(size)


# GGUF block types: (values per block, bytes per block), as gguf.GGML_QUANT_SIZES gives them (gguf 0.19.0).
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q6_K": (256, 210), "Q5_K": (256, 176), "Q4_K": (256, 144),
               "Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_0": (32, 18), "Q4_1": (32, 20),
               "Q3_K": (256, 110), "Q2_K": (256, 84)}
GGUF_SMALL = 1024  # city96's QUANTIZATION_THRESHOLD: tensors of at most this many values stay unquantised


def gguf_storage(qtype: str, compute_dtype: torch.dtype,
                 lists: tuple[str, ...]) -> Callable[[str, torch.nn.Parameter], float]:
    """A GGUF file made the way city96's tools make them (tools/convert.py, then llama-quantize with
    its lcpp.patch): a block's 2-D weight of more than 1024 values whose rows (the input dim) are a
    whole number of quant blocks is quantised at ``qtype``; 1-D tensors, small tensors, rows that
    are not a multiple of the block (the patch's F16 fallback) and the input/output layers outside
    the blocks (img_in, time_in, txt_in, final_layer…, kept F16/F32) are not, and diffusers' GGUF
    loader holds those in the compute dtype."""
    try:
        values, nbytes = GGUF_BLOCKS[qtype]
    except KeyError:
        raise ValueError(f"GGUF type {qtype!r} is not one of {', '.join(GGUF_BLOCKS)}") from None
    size = float(compute_dtype.itemsize)

    def bytes_per_value(name: str, param: torch.nn.Parameter) -> float:
        quantised = (param.dim() == 2 and in_blocks(name, lists) and param.numel() > GGUF_SMALL
                     and param.shape[1] % values == 0)
        return nbytes / values if quantised else size

    return bytes_per_value


def _rule(storage: StorageRule) -> Callable[[str, torch.nn.Parameter], float]:
    return storage if callable(storage) else (lambda name, param, value=float(storage): value)


def _sharded_values(param: torch.Tensor, ranks: int) -> int:
    """Values one rank keeps of a parameter FSDP2 shards on dim 0: ⌈rows/R⌉ rows (dim 0 padded)."""
    if param.dim() == 0 or ranks == 1:
        return param.numel()
    rows = param.shape[0]
    return math.ceil(rows / ranks) * (param.numel() // rows)


def _linears(module: torch.nn.Module):
    return ((name, m) for name, m in module.named_modules() if isinstance(m, torch.nn.Linear))


def weight_bytes(transformer: torch.nn.Module, storage: StorageRule, compute_dtype: torch.dtype,
                 shard_ranks: int = 1, stages: int = 1, prefetch: bool = True) -> tuple[int, int]:
    """(resident, transient) weight bytes on one rank: the module docstring's rules."""
    rule, lists = _rule(storage), block_lists(transformer)
    outside, blocks, block_full = 0.0, 0.0, {}
    upcast = False
    for name, param in transformer.named_parameters():
        per_value = rule(name, param)
        upcast |= per_value != compute_dtype.itemsize
        if not in_blocks(name, lists):
            outside += param.numel() * per_value
            continue
        blocks += _sharded_values(param, shard_ranks) * per_value
        block = ".".join(name.split(".")[:2])  # "transformer_blocks.3"
        block_full[block] = block_full.get(block, 0.0) + param.numel() * per_value
    buffers = sum(b.numel() * b.element_size() for b in transformer.buffers())
    resident = outside + blocks / stages + buffers
    transient = 0.0
    if shard_ranks > 1 and block_full:
        transient += (2 if prefetch else 1) * max(block_full.values())
    if upcast:
        transient += max((m.in_features * m.out_features for _, m in _linears(transformer)), default=0) \
            * compute_dtype.itemsize
    return int(resident), int(transient)


@dataclass(frozen=True)
class Widths:
    """What the activation formula reads of an architecture: C, F and the heads."""

    hidden: int  # C = heads × head dim
    widest: int  # F: the widest per-token projection in a block
    heads: int

    @classmethod
    def of(cls, transformer: torch.nn.Module) -> Widths:
        from ..models.registry import attention_geometry

        heads, head = attention_geometry(transformer.config)
        lists = block_lists(transformer)
        widest = max((m.out_features for list_name in lists for block in getattr(transformer, list_name)[:1]
                      for name, m in _linears(block) if not _PER_ROW.search(name)), default=0)
        return cls(heads * head, widest, heads)


def activation_bytes(widths: Widths, compute_dtype: torch.dtype, tokens_per_rank: int, rows: int,
                     modulation_per_token: bool = False) -> int:
    """One block's peak at ``tokens_per_rank`` tokens: (7·C + 2·F) per token + 12·C per row; with a timestep
    per token, 7·C more per token and 6·C float32."""
    c, f, e = widths.hidden, widths.widest, compute_dtype.itemsize
    per_token = (3 * c + 3 * c + c + 2 * f) * e
    if modulation_per_token:
        per_token += 7 * c * e + 6 * c * 4
    return rows * (tokens_per_rank * per_token + MODULATION_PER_ROW * c * e)


def workspace_bytes(widths: Widths, compute_dtype: torch.dtype, tokens_per_rank: int, rows: int,
                    attention: str = "fused", ulysses: int = 1, ring: int = 1) -> int:
    """The attention kernel's workspace and the sequence-parallel buffers (module docstring)."""
    c, e = widths.hidden, compute_dtype.itemsize
    if attention == "fused":
        kernel = rows * widths.heads * tokens_per_rank * 4
    elif attention == "math":
        queries = tokens_per_rank * ulysses  # after Ulysses' all-to-all: all of the ring rank's tokens, H/U heads
        kernel = 2 * rows * (widths.heads // ulysses) * queries * queries * e
    else:
        raise ValueError(f"attention {attention!r} is not 'fused' (flash, cuDNN, memory-efficient) or 'math'")
    buffers = 0
    if ulysses > 1:
        buffers += 4 * c * e
    if ring > 1:
        buffers += 2 * c * e + c * 4
    return kernel + rows * tokens_per_rank * buffers


def estimate(transformer: torch.nn.Module, *, storage_bytes_per_value: StorageRule, compute_dtype: torch.dtype,
             shard_ranks: int, tokens_per_rank: int, rows: int, stages: int = 1, prefetch: bool = True,
             attention: str = "fused", ulysses: int = 1, ring: int = 1, stale_buffers: int = 1,
             modulation_per_token: bool = False) -> Estimate:
    """One rank's bytes for a request.

    ``transformer``: a diffusers transformer, on the meta device or loaded. ``storage_bytes_per_value``:
    a number, or ``(parameter name, parameter) → bytes per value`` (``fp8_storage``, ``gguf_storage``;
    for a loaded model, ``lambda name, p: p.element_size()``). ``shard_ranks``: the ranks FSDP2 shards
    each block over (1: not sharded). ``tokens_per_rank``: the joint sequence's tokens (image + text)
    one rank holds. ``rows``: the sequences one forward carries on this rank (batch/dp, ×2 when CFG's
    two passes share a forward). ``stages``: PipeFusion stages (a rank holds 1/stages of the blocks).
    ``ulysses``, ``ring``: the sequence-parallel degrees (their buffers; the math path's score matrix).
    ``stale_buffers``: PipeFusion's K/V buffers per block (StagePlan.buffers_per_block).
    ``modulation_per_token``: a timestep per token (Wan 2.2 TI2V-5B under a noise mask).
    """
    if shard_ranks < 1 or tokens_per_rank < 0 or rows < 1 or stages < 1:
        raise ValueError(f"shard_ranks={shard_ranks}, tokens_per_rank={tokens_per_rank}, rows={rows}, "
                         f"stages={stages}: shard_ranks, rows and stages must be ≥ 1, tokens ≥ 0")
    resident, transient = weight_bytes(transformer, storage_bytes_per_value, compute_dtype, shard_ranks, stages,
                                       prefetch)
    widths = Widths.of(transformer)
    stale = 0
    if stages > 1:
        blocks = sum(len(getattr(transformer, name)) for name in block_lists(transformer))
        stale = 2 * widths.hidden * tokens_per_rank * ulysses * ring * rows * -(-blocks // stages) \
            * stale_buffers * compute_dtype.itemsize  # each buffer's K and V [rows, all tokens, C]
    return Estimate(weights=resident + transient,
                    activations=activation_bytes(widths, compute_dtype, tokens_per_rank, rows,
                                                 modulation_per_token) + stale,
                    workspace=workspace_bytes(widths, compute_dtype, tokens_per_rank, rows, attention, ulysses, ring),
                    weights_resident=resident)
