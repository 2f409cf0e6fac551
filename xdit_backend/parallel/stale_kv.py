"""PipeFusion's attention: a patch attends to its own fresh K/V and the other patches' stale K/V.

Every attention module the family's StagePlan lists keeps a K/V buffer over all tokens
[B, L + N, H, D] (text first). A chunk writes its fresh K/V at its tokens' positions and attends
to everything written so far: the other patches' K/V are one step old (or from earlier in this
step, for the patches ahead of it). Only written positions are read, so a first step without
warm-up attends to what exists. With sequence parallelism inside a stage, each rank holds a slice
of the chunk's tokens; the slices' fresh K/V are all-gathered in the sequence group (text is the
same on every rank), so every rank's buffer holds the whole chunk.

The processors are the sequence-parallel ones (sequence.py), which compute the module's Q/K/V
and output projections and hand the attention itself to a pluggable core; here the core is
``StaleKV``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import sequence


class KVBuffer:
    """One attention layer's K and V over all tokens [B, L + N, H, D], and which positions hold data."""

    def __init__(self):
        self.k = self.v = self.filled = None

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, total: int):
        if self.k is None or self.k.shape[1] != total or self.k.shape[0] != k.shape[0]:
            shape = (k.shape[0], total, *k.shape[2:])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
            self.filled = torch.zeros(total, dtype=torch.bool, device=k.device)
        self.k[:, positions], self.v[:, positions] = k, v  # [B, n, H, D] into [B, L + N, H, D]
        self.filled[positions] = True

    def read(self):
        if bool(self.filled.all()):
            return self.k, self.v
        return self.k[:, self.filled], self.v[:, self.filled]


class Chunk:
    """The tokens the stage is processing now, as buffer positions (text first, then image tokens)."""

    def __init__(self):
        self.text_tokens = 0  # L when the chunk carries the text (joint families' first chunk of a step)
        self.text = torch.arange(0)  # [L] or [0]: the text's positions
        self.image = torch.arange(0)  # [n]: the whole chunk's image tokens (every sequence rank's slice)
        self.total = 0  # L + N

    def describe(self, text_tokens: int, all_text: int, band_tokens: torch.Tensor, image_tokens: int):
        self.text_tokens = text_tokens
        self.text = torch.arange(text_tokens, device=band_tokens.device)
        self.image = band_tokens + all_text
        self.total = all_text + image_tokens


class StaleKV:
    """Attention core of one module: (q, k, v) of this rank's [text; image slice] → out [B, S, H, D]."""

    def __init__(self, chunk: Chunk, sp_group, kernel, sees_text: bool):
        self.chunk, self.sp_group, self.kernel, self.sees_text = chunk, sp_group, kernel, sees_text
        self.buffer = KVBuffer()

    def __call__(self, query, key, value, text_tokens: int = 0):
        chunk = self.chunk
        L = chunk.text_tokens if self.sees_text else 0  # what the module was given, whatever the caller says
        if L:  # the text's K/V: the same on every sequence rank
            self.buffer.write(chunk.text, key[:, :L], value[:, :L], chunk.total)
        fresh_k, fresh_v = key[:, L:], value[:, L:]  # [B, n/P, H, D]
        if self.sp_group is not None:
            fresh_k, fresh_v = (gather_tokens(t, self.sp_group) for t in (fresh_k, fresh_v))  # [B, n, H, D]
        self.buffer.write(chunk.image, fresh_k, fresh_v, chunk.total)
        k_all, v_all = self.buffer.read()  # [B, written, H, D]
        out, _ = self.kernel(query, k_all, v_all)  # [B, S, H, D]
        return out.to(query.dtype)


def gather_tokens(local: torch.Tensor, group) -> torch.Tensor:
    """[B, n/P, ...] on each rank of the sequence group → [B, n, ...] on every rank."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)  # P × [B, n/P, H, D]
    return torch.cat(parts, dim=1)  # [B, n, H, D], in sequence-index order


PROCESSORS = {"joint": sequence.AttentionUSPProcessor, "wan": sequence.WanUSPProcessor,
              "flux": sequence.FluxUSPProcessor}


def attach(transformer, plan, chunk: Chunk, sp_group, kernel) -> None:
    """Give every attention module the plan lists a stale-K/V processor (one buffer each). Undo with
    ``transformer.set_attn_processor(saved)``, ``saved = transformer.attn_processors`` taken before."""
    kinds = {name: (kind, sees_text) for name, kind, sees_text in plan.attention}
    for name, module in transformer.named_modules():
        entry = kinds.get(name.rsplit(".", 1)[-1])
        if entry is not None:
            kind, sees_text = entry
            module.set_processor(PROCESSORS[kind](StaleKV(chunk, sp_group, kernel, sees_text)))
