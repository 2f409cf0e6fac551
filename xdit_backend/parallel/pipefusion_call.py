"""PipeFusion for one model call of ComfyUI's sampler (the xDiT MODEL's ``evaluate``), its stale K/V kept across
the calls of a sampling run.

Where ComfyUI's sampler calls the model once per step (the leader refuses a second call in a step), each call is
one step of parallel/pipefusion.py's, without the overlap between steps (the next call's input is ComfyUI's to
compute, after this call returns):

- A call at a step before ``warmup_steps`` runs the whole latent as one chunk (exact); a later call runs
  ``num_pipeline_patch`` patches, each attending to its own fresh K/V, the patches' before it from this call and
  those after it from the call before. The K/V buffers (stale_kv.KVBuffer) belong to the run and outlive its
  calls (the executor keeps them by run), so the calls give what the xDiT Sampler's PipeFusion gives at the same
  settings: its patches see the same K/V.
- Rows as Evaluation's: the call's rows over the cfg × dp row groups; each row group is one pipeline of
  ``pipefusion`` stages, whose ranks split each chunk's tokens over ring × ulysses.
- The last stage sends each chunk's output rows back to stage 0 on the last → 0 link (as PipeFusion returns a
  patch's next input); stage 0 gathers the row groups' outputs over dp and cfg, and rank 0 answers with them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..models.patch_embed import pad_to_patch
from . import attention, schedule, stale_kv
from .evaluation import Evaluation
from .pipefusion import PipeFusion, _isend
from .step_cache import StageCache, StepCache


@dataclass
class RunStage:
    """What one stage keeps across the calls of a sampling run: its attention modules' K/V (module name →
    KVBuffer, filled in by the first call), and with a step cache its residuals and carried counts per chunk
    (step_cache.StageCache's)."""

    buffers: dict = field(default_factory=dict)
    residuals: dict = field(default_factory=dict)
    carried: dict = field(default_factory=dict)


class PipelinedCall(PipeFusion):
    """One rank's stage of a PipeFusion layout, running one model call."""

    def __init__(self, model, layout, device, blocks, run: RunStage, holds_cache_head: bool = False):
        super().__init__(model, layout, device, blocks, holds_cache_head)
        self.kept = run

    def run(self, x: torch.Tensor, timestep: torch.Tensor, inputs: dict[str, torch.Tensor],
            guidance: torch.Tensor | None, step: int, cache: StepCache | None = None,
            cond_rows: tuple[int, int] = (0, 0)) -> torch.Tensor | None:
        """The model's raw output for x [N, C, (T,) h, w] (x's shape, float32, on the CPU) on stage 0, None on the
        other stages; ``step``: the call's position in its run (warm-up or patched). With ``cache`` (the run's
        StepCache, its ``computes`` PipeFusion's), the stages skip the span's blocks together, deciding from the
        cond rows ``cond_rows`` (first, count) as Evaluation's call does."""
        evaluation = Evaluation(self.model, self.layout)
        rows = evaluation.rows_of(x.shape[0])
        self.input = rows(pad_to_patch(x, self.model.spec.patch)).float()  # [per, C (+ E), (T,) H, W]
        latent = self.model.spec.latent_format.channels
        self.x = self.input.new_zeros(self.input.shape[0], latent, *self.input.shape[2:])  # stage 0: the output
        self.timestep = rows(timestep.float())  # [per]
        self.guidance = None if guidance is None else rows(guidance.float())  # [per]
        self.sides = {key: rows(tensor) for key, tensor in inputs.items()}  # key → [per, ...]
        self._lay_out(tuple(self.input.shape))
        self.work = [item for item in schedule.items(step + 1, self.warmup, self.patches) if item.step == step]
        everything = [[len(self.work) - 1]] * self.stages  # one gate, after the call: every message before it
        transformer = self.model.transformer
        saved = transformer.attn_processors
        stale_kv.attach(transformer, self.plan, self.chunk, self.sp_group, attention.local_attention(self.device),
                        self.kept.buffers)
        self.pending, self.returns, self.sends, self.inputs = {}, deque(), [], {}
        if cache is not None:
            cache.group = self.layout.step_group
            mine = evaluation.cond_share(*cond_rows, x.shape[0], rows.first, rows.per)
            self.cache = StageCache(cache, transformer, self.model.spec.cache_plan, self.blocks,
                                    self.holds_cache_head, mine, self.device)
            self.cache.residuals, self.cache.carried = self.kept.residuals, self.kept.carried
        try:
            self._post(everything, 0)
            for index, item in enumerate(self.work):
                self._run_item(index, item)
            self._drain()
            if self.cache is not None:
                self.cache.share_decision(self.layout.group("pipefusion"), self.stages - 1, step)
        finally:
            transformer.set_attn_processor(saved)
            if self.cache is not None:
                self.cache.detach()
                cache.group = None  # the layout's: the run's cache outlives this call
        return evaluation.gathered(self.x, x) if self.first else None

    def _inputs(self, step: int) -> dict:
        if step not in self.inputs:
            self.inputs = {step: self.model.step_inputs(tuple(self.input.shape), self.timestep, self.sides,
                                                        self.guidance)}
        return self.inputs[step]

    def _model_input(self, item) -> torch.Tensor:
        a, b = self._rows(item)
        return self._with_concat(self.input[..., a:b, :], a, b)  # [per, C (+ E), (T,) b − a, W]

    def _finish(self, item, out: torch.Tensor) -> None:
        """Last stage: the item's output rows [per, C, (T,) b − a, W], back to stage 0 (``_apply_returns`` there)."""
        raw = self._raw_rows(item, out)[2].contiguous()
        self.sends.append((raw, _isend(raw, self.links.outgoing)))
