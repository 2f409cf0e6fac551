"""One model evaluation shared by the ranks of a layout (the xDiT MODEL's call; parallel/denoiser.py is the
whole-loop path's).

- The call's batch rows (ComfyUI's cond, uncond and area chunks, concatenated) are split over the cfg × dp
  ranks: row group g = cfg index · dp + dp index takes rows [g·n, (g+1)·n) of the rows padded to a multiple
  of the groups (the last row repeated; its output dropped). Under cfg = 2 a call of cond and uncond is
  today's CFG split; a call of one row runs on both halves.
- Within a row group the tokens are split over ring × ulysses by the family's SequencePlan, as in a step.
- x is padded to the patch circularly and the output cropped back, as ComfyUI's models do
  (comfy/ldm/common_dit.py pad_to_patch_size), so an area crop of any size runs.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.patch_embed import pad_to_patch
from . import attention, sequence


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] → [rows, ...], the last row repeated (rows ≥ N)."""
    extra = rows - tensor.shape[0]
    return tensor if extra == 0 else torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


@dataclass(frozen=True)
class RowShare:
    """A row group's rows of a call: [first, first + per) of its rows padded to ``total`` (the last repeated)."""

    first: int
    per: int
    total: int
    device: torch.device

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """[N, ...] → this group's [per, ...] on ``device``."""
        return pad_rows(tensor, self.total)[self.first:self.first + self.per].to(self.device)


class Evaluation:
    """The ranks of ``layout`` (None: this rank alone) evaluating ``model`` once."""

    def __init__(self, model, layout=None):
        self.model = model
        self.layout = layout

    def row_groups(self) -> tuple[int, int]:
        """(how many row groups, this rank's): cfg × dp of them."""
        if self.layout is None:
            return 1, 0
        config = self.layout.config
        return config.cfg * config.dp, self.layout.index("cfg") * config.dp + self.layout.index("dp")

    def run(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, torch.Tensor],
            guidance: torch.Tensor | None, cache=None, step: int = 0, slot: int = 0,
            cond_rows: tuple[int, int] = (0, 0)) -> torch.Tensor:
        """The model's raw output for x [N, C, (T,) h, w] (float32, on the CPU, x's shape), from timestep [N],
        the conditioning ``inputs`` (key → [N, ...]) and guidance [N] or None. With ``cache`` (a StepCache kept
        across the calls of a sampling run), the call is its ``slot``-th of ``step``; slot 0 decides, from the
        cond rows ``cond_rows`` (first, count: this rank's share of them)."""
        n = x.shape[0]
        rows = self.rows_of(n)
        padded = pad_to_patch(x, self.model.spec.patch)
        cond = {key: rows(t) for key, t in inputs.items()}
        with self.sequence_parallel() as stack:
            if cache is not None:
                self.attach_cache(stack, cache, step, slot, self.cond_share(*cond_rows, n, rows.first, rows.per))
            out = self.model.output(rows(padded).to(self.model.dtype), rows(timestep.float()), cond,
                                    None if guidance is None else rows(guidance.float()))  # [per, C, ...]
        return self.gathered(out, x)

    def rows_of(self, n: int) -> RowShare:
        """This row group's share of a call of ``n`` rows."""
        groups, group = self.row_groups()
        per = -(-n // groups)
        return RowShare(group * per, per, per * groups, self.model.device)

    def gathered(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This row group's output [per, C, ...] (x padded to the patch) → the call's [N, C, ...], x's shape, on the
        CPU in float32: gathered over the row groups, the padded rows dropped and the padding cropped."""
        out = self.gather(out.float())[:x.shape[0]]  # [N, C, (T,) h', w']
        return out[(slice(None), slice(None), *(slice(0, size) for size in x.shape[2:]))].cpu()

    def sequence_parallel(self) -> ExitStack:
        """Sequence parallelism attached for this call (its ``shard`` attribute: the tokens' Shard, or None)."""
        stack = ExitStack()
        stack.shard = None
        if self.layout is not None and self.layout.config.sequence > 1:
            attached = sequence.attach_model(self.model, self.layout, attention.local_attention(self.model.device))
            for each in attached:
                stack.callback(each.detach)
            stack.shard = attached[0].shard
        return stack

    @staticmethod
    def cond_share(start: int, count: int, rows: int, first: int, per: int) -> slice | None:
        """This rank's rows [first, first + per) that are among the cond rows [start, start + count) of the call's
        ``rows`` real ones (not the padding): local, or None."""
        low, high = max(start, first), min(start + count, rows, first + per)
        return slice(low - first, high - first) if high > low else None

    def attach_cache(self, stack: ExitStack, cache, step: int, slot: int, rows: slice | None) -> None:
        """The step cache on the model for this call, agreeing over the ranks that run the same blocks."""
        stack.enter_context(cache.attached(self.model.transformer, self.model.spec.cache_plan))
        cache.group = self.layout.step_group if self.layout is not None else None
        cache.shard = stack.shard
        cache.step_done(step)
        stack.enter_context(cache.call(slot, slot == 0, rows))

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """This row group's [per, ...] → every group's [groups · per, ...] in row-group order: over dp, then cfg."""
        for axis in ("dp", "cfg"):
            group = None if self.layout is None else self.layout.group(axis)
            if group is None:
                continue
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, out.contiguous(), group=group)  # degree × [rows so far, C, ...]
            out = torch.cat(parts)
        return out
