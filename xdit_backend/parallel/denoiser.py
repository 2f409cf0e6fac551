"""The denoised estimate of one sampler step, shared by the ranks of a layout.

- CFG parallel (cfg=2): the rank at cfg index 0 runs the conditional pass, index 1 the
  unconditional one; both results are all-gathered and combined as ComfyUI does.
- Sequence parallel (ring × ulysses): the model runs on this rank's share of the tokens (sequence.py).
- Data parallel (dp): this rank's dp group owns a slice of the batch rows (``rows``).
Without a layout (or world 1) it is the serial computation, batching cond and uncond together.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext

import torch
import torch.distributed as dist

from ..sampling.generate import side_differences
from . import attention, sequence
from .step_cache import StepCache


class Denoiser:
    def __init__(self, model, layout=None):
        self.model = model
        self.layout = layout
        self.latent_format = model.latent_format
        self.device = model.device
        self.cfg_group = layout.group("cfg") if layout else None
        self.dp_group = layout.group("dp") if layout else None
        self.cache: StepCache | None = None  # the generation's step cache, when it asks for one (``attached``)
        self.shards: list = []  # the sequence split's shards of the model and its ControlNets (``attached``)

    def rows(self, batch: int) -> slice:
        """The batch rows this rank's dp group generates."""
        if self.dp_group is None:
            return slice(None)
        per = batch // self.layout.config.dp
        start = self.layout.index("dp") * per
        return slice(start, start + per)

    @contextmanager
    def attached(self, gen=None):
        """For one generation: sequence parallelism on the model, as its family's plan says, and the
        step cache ``gen`` asks for; then both undone."""
        with ExitStack() as stack:
            shard = None
            if self.layout is not None and self.layout.config.sequence > 1:
                attached = sequence.attach_model(self.model, self.layout, attention.local_attention(self.device))
                for each in attached:
                    stack.callback(each.detach)
                shard = attached[0].shard
                self.shards = [each.shard for each in attached]  # they hold the sequence group: dropped after
                stack.callback(self.shards.clear)
            if gen is not None and gen.cache is not None:
                plan = self.model.spec.cache_plan
                self.cache = StepCache(gen.cache, gen.steps, plan.teacache,
                                       self.layout.step_group if self.layout else None, shard)
                stack.enter_context(self.cache.attached(self.model.transformer, plan))
            try:
                yield self
            except BaseException:  # failed or stopped (rank 0 may stop between blocks, mid-step)
                self._forget_groups()
                raise

    def _forget_groups(self) -> None:
        """After a generation that failed or stopped: drop this object's references to the layout's process groups. A group's last
        reference closes its connections on gloo, which is how a peer still waiting on this rank learns of the
        failure at once (agreement.py); this object can outlive the generation (a closure cell of the failed
        sampler loop kept it, seen under Ulysses)."""
        self.layout = self.cfg_group = self.dp_group = None
        self.shards = []  # each holds the sequence group

    def step_done(self, done: int) -> None:
        if self.cache is not None:
            self.cache.step_done(done)

    def _call(self, slot: int, decides: bool, rows: slice | None):
        """A model call, as the step cache sees it (parallel/step_cache.py: which call decides, and its cond rows). The
        shards forget the last call's lengths: a family that runs its blocks from its own loop never calls the
        transformer, whose forward would (sequence.attach), and sides of different lengths call one after the other."""
        for shard in self.shards:
            shard.clear()
        return nullcontext() if self.cache is None else self.cache.call(slot, decides, rows)

    def conditioning(self, positive: dict, negative: dict | None, both: bool = False) -> dict | tuple[dict, dict]:
        """What this rank's model calls take, built once per generation from the sides on the device
        (generate.start): its side of the guidance under CFG parallel, else the two sides batched
        [2B, ...] (cond first) when there is a negative one, or the pair (positive, negative) where
        they cannot batch (generate.side_differences), else the positive. ``both``: the generation runs passes
        beyond cond and uncond (LTX-2's guidance), so every rank keeps the pair, whichever passes it runs."""
        if both:
            return positive, negative
        if self.cfg_group is not None:
            return positive if self.layout.index("cfg") == 0 else negative
        if negative is None:
            return positive
        if side_differences(positive, negative):
            return positive, negative
        return {key: torch.cat([positive[key], negative[key]]) for key in positive}

    def x0(self, x: torch.Tensor, sigma: torch.Tensor, conditioning: dict | tuple[dict, dict], gen) -> torch.Tensor:
        """Guided denoised estimate, uncond + (cond − uncond)·cfg, for x [B, C, (T,) h, w] at sigma [B],
        from ``conditioning`` (``self.conditioning``); with guidance beyond CFG (``gen.passes``: LTX-2's STG, modality
        and audio scales), every pass's estimate combined as sampling/guidance.py says."""
        if gen.passes is not None:
            return self._guided_passes(x, sigma, conditioning, gen)
        if self.cfg_group is not None:
            cond = self.layout.index("cfg") == 0
            with self._call(0, True, slice(None) if cond else None):
                mine = self.model.predict_x0(x, sigma, conditioning, gen)  # [B, C, (T,) h, w], this rank's side
            return guided(mine, gen.cfg, self.cfg_group)
        if not gen.uses_cfg:
            with self._call(0, True, slice(None)):
                return self.model.predict_x0(x, sigma, conditioning, gen)
        if isinstance(conditioning, tuple):  # sides that cannot batch: one call each, [B, ...] → [2B, ...]
            positive, negative = conditioning
            with self._call(0, True, slice(None)):
                cond = self.model.predict_x0(x, sigma, positive, gen)
            with self._call(1, False, None):
                uncond = self.model.predict_x0(x, sigma, negative, gen)
            both = torch.cat([cond, uncond])
        else:
            with self._call(0, True, slice(0, x.shape[0])):  # the cond rows come first
                both = self.model.predict_x0(torch.cat([x, x]), torch.cat([sigma, sigma]), conditioning, gen)  # [2B, ...]
        return guided(both, gen.cfg)

    def _guided_passes(self, x: torch.Tensor, sigma: torch.Tensor, conditioning: tuple[dict, dict | None],
                       gen) -> torch.Tensor:
        """LTX-2's guidance (sampling/guidance.py): cond, uncond where it runs, and the extra passes active at σ, each
        one model call, spread over the CFG ranks (rank i runs passes i, i + 2, …) or run one after the other;
        combined as ComfyUI's guider and post-CFG functions combine them."""
        positive, negative = conditioning
        kinds = ["cond", *(["uncond"] if gen.uses_cfg else []), *gen.passes.extra(float(sigma[0]))]
        mine = kinds if self.cfg_group is None else kinds[self.layout.index("cfg")::2]
        outputs = {}
        for slot, kind in enumerate(mine):
            extra = None if kind in ("cond", "uncond") else kind
            with self._call(slot, slot == 0, None), self.model.guidance_pass(extra, gen.passes):
                outputs[kind] = self.model.predict_x0(x, sigma, negative if kind == "uncond" else positive, gen)
        if self.cfg_group is not None:
            outputs = self._gather_passes(outputs, kinds, mine, x)
        return gen.passes.combine(outputs, gen.cfg, gen.parts)

    def _gather_passes(self, outputs: dict, kinds: list[str], mine: list[str], x: torch.Tensor) -> dict:
        """Every pass's x0 on both CFG ranks: each rank's, stacked and all-gathered (a rank with fewer passes pads)."""
        count = -(-len(kinds) // 2)
        stacked = torch.stack([outputs[kind] for kind in mine]
                              + [torch.zeros_like(x, dtype=torch.float32)] * (count - len(mine)))  # [count, B, ...]
        both = [torch.empty_like(stacked) for _ in range(2)]
        dist.all_gather(both, stacked.contiguous(), group=self.cfg_group)  # by cfg index, [count, B, ...] each
        return {kinds[rank + 2 * j]: both[rank][j] for rank in range(2) for j in range(count)
                if rank + 2 * j < len(kinds)}

    def gather_rows(self, latent: torch.Tensor) -> torch.Tensor:
        """[B/dp, C, ...] from each dp group → [B, C, ...] on every rank."""
        if self.dp_group is None:
            return latent
        parts = [torch.empty_like(latent) for _ in range(self.layout.config.dp)]
        dist.all_gather(parts, latent.contiguous(), group=self.dp_group)  # dp × [B/dp, C, ...]
        return torch.cat(parts)


def guided(mine: torch.Tensor, cfg: float, cfg_group=None) -> torch.Tensor:
    """ComfyUI's CFG combine, uncond + (cond − uncond)·cfg, from this rank's prediction ``mine``: the
    cond and uncond halves of a batched [2B, ...] prediction, or (cfg parallel) this rank's side
    [B, ...], cond at cfg index 0, all-gathered with the other side. The normal path and PipeFusion
    both guide here."""
    if cfg_group is not None:
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine.contiguous(), group=cfg_group)  # [cond, uncond], by cfg index, [B, ...] each
        cond, uncond = both
    else:
        cond, uncond = mine.chunk(2)  # [2B, ...] → [B, ...] twice
    return uncond + (cond - uncond) * cfg
