"""PipeFusion's attention: a patch attends to its own fresh K/V and the other patches' stale K/V.

Every attention module the family's StagePlan lists keeps a K/V buffer over all tokens
[B, L + R + N, H, D]: the text, the reference latents' tokens (edits), then the image sequence.
A chunk writes its fresh K/V at its tokens' positions and attends to everything written so far: the other patches' K/V are one step old (or from earlier in this
step, for the patches ahead of it). Only written positions are read, so a first step without
warm-up attends to what exists. With sequence parallelism inside a stage, each rank holds a slice
of the chunk's tokens; the slices' fresh K/V are all-gathered in the sequence group (text is the
same on every rank, and so are the references), so every rank's buffer holds the whole chunk.
Text and references travel with each step's first chunk: written fresh once per step, before
any patch of that step reads them.

The processors are the families' own (the plan's classes, the same sequence parallelism uses),
which compute the module's Q/K/V and output projections and hand the attention itself to a
pluggable core; here the core is ``StaleKV``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Chunk:
    """The tokens the stage is processing now: the text and the references (when this chunk carries
    them), then a band of token rows in every frame. Plain ints: the buffers are cut with slices, so
    nothing here waits for the device."""

    def __init__(self):
        self.text_tokens = 0  # L when the chunk carries the text (joint families' first chunk of a step)
        self.all_text = 0  # the prompt's L: the buffers' text positions are [0, L)
        self.references = 0  # R when the chunk carries the reference tokens (the first chunk of a step)
        self.all_references = 0  # R: the buffers' reference positions are [L, L + R)
        self.grid = (1, 0, 0)  # (frames, token rows, columns) of the whole image sequence, row-major
        self.rows = (0, 0)  # the chunk's token rows [r0, r1), in every frame

    def describe(self, text_tokens: int, all_text: int, grid: tuple[int, int, int], rows: tuple[int, int],
                 references: int = 0, all_references: int = 0):
        self.text_tokens, self.all_text, self.grid, self.rows = text_tokens, all_text, grid, rows
        self.references, self.all_references = references, all_references

    @property
    def prefix(self) -> int:
        """L + R: the positions before the image sequence's."""
        return self.all_text + self.all_references

    @property
    def total(self) -> int:
        """L + R + N: every token a buffer holds."""
        frames, rows, columns = self.grid
        return self.prefix + frames * rows * columns


class KVBuffer:
    """One attention layer's K and V over all tokens [B, L + R + N, H, D] (text, references, then the
    image sequence frames × rows × columns), and which of them hold data. That is tracked on the host,
    for the text, the references and per token row (a chunk always writes whole rows in every frame), so reading
    never waits for the device: no mask to count, no flag to read back."""

    def __init__(self):
        self.k = self.v = None
        self.text = False  # the text's K/V are written
        self.references = False  # the references' K/V are written
        self.rows: list[bool] = []  # [token rows]: that row's K/V are written

    def write_text(self, chunk: Chunk, k: torch.Tensor, v: torch.Tensor) -> None:
        """The text's K/V [B, L, H, D] into positions [0, L)."""
        self._fit(chunk, k)
        self.k[:, :chunk.text_tokens], self.v[:, :chunk.text_tokens] = k, v
        self.text = True

    def write_references(self, chunk: Chunk, k: torch.Tensor, v: torch.Tensor) -> None:
        """The references' K/V [B, R, H, D] into positions [L, L + R)."""
        self._fit(chunk, k)
        self.k[:, chunk.all_text:chunk.prefix], self.v[:, chunk.all_text:chunk.prefix] = k, v
        self.references = True

    def write_rows(self, chunk: Chunk, k: torch.Tensor, v: torch.Tensor) -> None:
        """The chunk's image K/V [B, n, H, D], n = frames × (r1 − r0) × columns, into its rows of every frame."""
        self._fit(chunk, k)
        frames, _, columns = chunk.grid
        r0, r1 = chunk.rows
        for buffer, fresh in ((self.k, k), (self.v, v)):
            self._image(buffer, chunk)[:, :, r0:r1] = fresh.reshape(fresh.shape[0], frames, r1 - r0, columns,
                                                                     *fresh.shape[2:])  # [B, T, r1 − r0, C, H, D]
        self.rows[r0:r1] = [True] * (r1 - r0)

    def read(self, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the written positions [B, written, H, D], in token order: views of the buffer
        once every row is written, a copy of the written part before (a first step without warm-up)."""
        # a module that never sees the text (cross-attention families) leaves the text positions empty
        first = 0 if self.text else chunk.all_text
        if all(self.rows) and (self.references or not chunk.all_references):
            return self.k[:, first:], self.v[:, first:]
        runs, start = [], None  # the written rows as [a, b) runs
        for row, written in enumerate([*self.rows, False]):
            if written and start is None:
                start = row
            elif not written and start is not None:
                runs.append((start, row))
                start = None
        return tuple(self._written(buffer, chunk, runs, first) for buffer in (self.k, self.v))

    def _written(self, buffer: torch.Tensor, chunk: Chunk, runs: list[tuple[int, int]], first: int) -> torch.Tensor:
        image = self._image(buffer, chunk)  # [B, T, rows, C, H, D]
        image = torch.cat([image[:, :, a:b] for a, b in runs], dim=2).flatten(1, 3)  # [B, T·written rows·C, H, D]
        end = chunk.prefix if self.references else chunk.all_text
        return torch.cat([buffer[:, first:end], image], dim=1)  # [B, (L) (+ R) + written, H, D]

    @staticmethod
    def _image(buffer: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """The image part of ``buffer`` as a grid view [B, T, rows, C, H, D]."""
        return buffer[:, chunk.prefix:].view(buffer.shape[0], *chunk.grid, *buffer.shape[2:])

    def _fit(self, chunk: Chunk, like: torch.Tensor) -> None:
        """(Re)allocate for this request's batch and token count; nothing written yet."""
        if self.k is None or tuple(self.k.shape[:2]) != (like.shape[0], chunk.total):
            shape = (like.shape[0], chunk.total, *like.shape[2:])
            self.k, self.v = like.new_zeros(shape), like.new_zeros(shape)
            self.text, self.references, self.rows = False, False, [False] * chunk.grid[1]


class StaleKV:
    """Attention core of one module: (q, k, v) of this rank's [text; references; image slice] → out [B, S, H, D]."""

    def __init__(self, chunk: Chunk, sp_group, kernel, sees_text: bool, buffer: KVBuffer):
        self.chunk, self.sp_group, self.kernel, self.sees_text = chunk, sp_group, kernel, sees_text
        self.buffer = buffer

    def __call__(self, query, key, value, text_tokens: int = 0, prefix: tuple | None = None):
        """``prefix``: keys and values [B, L, H, D] that come ahead of the chunk's rather than with its queries
        (Qwen-Image 2.1's prefix, which attends apart: its queries are not the core's); the chunk carries them."""
        if prefix is not None:
            key, value = torch.cat([prefix[0], key], dim=1), torch.cat([prefix[1], value], dim=1)  # [B, L + s, H, D]
        chunk = self.chunk
        L = chunk.text_tokens if self.sees_text else 0  # what the module was given, whatever the caller says
        if L:  # the text's K/V: the same on every sequence rank
            self.buffer.write_text(chunk, key[:, :L], value[:, :L])
        R = chunk.references
        if R:  # the references' K/V: the same on every sequence rank
            self.buffer.write_references(chunk, key[:, L:L + R], value[:, L:L + R])
        fresh_k, fresh_v = key[:, L + R:], value[:, L + R:]  # [B, n/P, H, D]
        if self.sp_group is not None:
            fresh_k, fresh_v = (gather_tokens(t, self.sp_group) for t in (fresh_k, fresh_v))  # [B, n, H, D]
        self.buffer.write_rows(chunk, fresh_k, fresh_v)
        k_all, v_all = self.buffer.read(chunk)  # [B, written, H, D]
        out, _ = self.kernel(query, k_all, v_all)  # [B, S, H, D]
        return out.to(query.dtype)


def gather_tokens(local: torch.Tensor, group) -> torch.Tensor:
    """[B, n/P, ...] on each rank of the sequence group → [B, n, ...] on every rank."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)  # P × [B, n/P, H, D]
    return torch.cat(parts, dim=1)  # [B, n, H, D], in sequence-index order


def attach(transformer, plan, chunk: Chunk, sp_group, kernel, buffers: dict[str, KVBuffer] | None = None) -> None:
    """Give every attention module the plan lists (StagePlan.stale_modules) a stale-K/V processor, one buffer each:
    new ones, or those of ``buffers`` (module name → KVBuffer, filled in where missing), which keeps them across
    model calls. Undo with ``transformer.set_attn_processor(saved)``, ``saved = transformer.attn_processors`` taken
    before."""
    buffers = {} if buffers is None else buffers
    for name, module, processor, sees_text in plan.stale_modules(transformer):
        buffer = buffers.setdefault(name, KVBuffer())
        module.set_processor(processor(StaleKV(chunk, sp_group, kernel, sees_text, buffer)))
