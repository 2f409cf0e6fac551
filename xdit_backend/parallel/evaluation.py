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

import torch
import torch.distributed as dist

from . import attention, sequence


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, ...] → [rows, ...], the last row repeated (rows ≥ N)."""
    extra = rows - tensor.shape[0]
    return tensor if extra == 0 else torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


def pad_to_patch(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """x [N, C, (T,) h, w] padded circularly at the end of each patched axis to a multiple of the patch."""
    sizes = patch if x.dim() == 5 else patch[1:]
    pad = ()
    for axis, size in enumerate(sizes):
        pad = (0, -x.shape[axis + 2] % size) + pad  # F.pad lists the last axis first
    return x if not any(pad) else torch.nn.functional.pad(x, pad, mode="circular")


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
            guidance: torch.Tensor | None) -> torch.Tensor:
        """The model's raw output for x [N, C, (T,) h, w] (float32, on the CPU, x's shape), from timestep [N],
        the conditioning ``inputs`` (key → [N, ...]) and guidance [N] or None."""
        groups, group = self.row_groups()
        n = x.shape[0]
        per = -(-n // groups)
        mine = slice(group * per, (group + 1) * per)
        device, dtype = self.model.device, self.model.dtype

        def rows(t: torch.Tensor) -> torch.Tensor:
            return pad_rows(t, per * groups)[mine].to(device)

        padded = pad_to_patch(x, self.model.spec.patch)
        cond = {key: rows(t) for key, t in inputs.items()}
        with self.sequence_parallel():
            out = self.model.output(rows(padded).to(dtype), rows(timestep.float()), cond,
                                    None if guidance is None else rows(guidance.float()))  # [per, C, ...]
        out = self.gather(out.float())[:n]  # [N, C, (T,) h', w']
        return out[(slice(None), slice(None), *(slice(0, size) for size in x.shape[2:]))].cpu()  # the padding cropped

    def sequence_parallel(self):
        stack = ExitStack()
        if self.layout is not None and self.layout.config.sequence > 1:
            attached = sequence.attach(self.model.transformer, self.model.spec.sequence_plan, self.layout,
                                       attention.local_attention(self.model.device))
            stack.callback(attached.detach)
        return stack

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
