"""Step cache: skip the blocks whose output barely changes between denoising steps, every rank agreeing.

Two methods, for every family through its ``CachePlan`` (models/base.py). Both always run the first
block of the span and, on a reused step, skip the others: the image stream leaves the span as the
first block's output plus what the other blocks added at the last computed step (their residual).

- ``fbcache`` (first-block cache, ParaAttention's and xDiT's): the first block's residual r (its image
  output − its image input) is compared with r at the last computed step c: Σ|r − r_c| / Σ|r_c| below
  the threshold reuses.
- ``teacache`` (TeaCache, Liu et al. 2024): the relative change of the first block's time embedding
  (``CachePlan.probe``) since the previous step, rescaled by the family's fitted polynomial
  (``CachePlan.teacache``), is added up; while the sum stays below the threshold the steps reuse, and
  the step that reaches it computes and starts the sum again. (TeaCache reads the modulated input
  inside the first block; the time embedding is what every family's first block takes as an argument,
  outside the compiled block, and is the indicator TeaCache uses for Wan.)

The first ``start`` steps and the last ``end`` steps always compute.

One decision for all ranks. Each rank holds a part of what the serial run decides from: its share
of the tokens (sequence parallel), its batch rows (dp), one side of the guidance (cfg). The decision
is taken from the positive side (cond) of the guidance: its rows are in every layout's first model
call of a step (the batched [cond; uncond] call, the cond call when the sides run one call each, the
cond rank under cfg), so every layout can decide before running the rest. Each rank sums over its
cond rows and its real tokens (a padded share's padding left out), and one 2-element all-reduce over
the ranks that run the same blocks (dp × cfg × ring × ulysses; the uncond rank adds zeros) gives every
rank the serial run's two sums, hence its ratio and its decision. The decision is a Python branch
around the blocks' forwards, outside the compiled blocks: a decision compiles nothing.

Under PipeFusion a stage runs its blocks through ``StageCache`` (below): the stage holding the span's
first block decides once per step and the decision travels with the activations.

Unit: a model evaluation of the sampler (one per step for euler and the other one-call samplers;
heun and the two-call samplers decide at each of theirs). With weight sharding, a skipped block's
weights are still all-gathered (FSDP's hooks run around the skipped forward): the compute is saved,
the gather is not.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy
import torch
import torch.distributed as dist

from ..errors import UserError


@dataclass(frozen=True)
class CacheOptions:
    method: str  # schema.CACHE_METHODS, not "none"
    threshold: float
    start: int  # steps always computed first (schema's cache_start)
    end: int  # steps always computed last (schema's cache_end)


@dataclass
class _Call:
    """One model call inside a sampler evaluation."""

    slot: int  # 0: the call that decides; 1: the uncond call when the sides run one call each
    decides: bool
    rows: slice | None  # this call's cond rows (None: it has none, the uncond rank under cfg)


@dataclass
class Decision:
    step: int
    ratio: float | None  # what the threshold was compared with (fbcache: the ratio; teacache: the sum); None:
    # forced, or (PipeFusion) taken on another stage
    reused: bool


@dataclass
class StepCache:
    options: CacheOptions
    steps: int  # of the generation: the last ``end`` always compute
    coefficients: tuple[float, ...] = (1.0, 0.0)  # teacache's polynomial: the family's CachePlan.teacache
    group: object = None  # the ranks that run the same blocks (None: this rank alone)
    shard: object = None  # sequence.Shard of a sequence-parallel layout (its padding is left out)
    computes: frozenset = frozenset()  # more steps that always compute (PipeFusion's first patched step)
    step: int = 0  # the sampler's current step (``step_done``)
    trace: list[Decision] = field(default_factory=list)
    _call: _Call | None = None
    _reuse: bool = False
    _skip: bool = False  # this call skips the span's blocks: reused, and its slot has a residual from a computed call
    _previous: torch.Tensor | None = None  # fbcache: r at the last computed step; teacache: the last probe
    _accumulated: float = 0.0
    _slots: dict = field(default_factory=dict)  # slot → {"head": first block's image output, "tail": residual}

    @property
    def counts(self) -> dict:
        reused = sum(d.reused for d in self.trace)
        return {"computed": len(self.trace) - reused, "reused": reused}

    def step_done(self, done: int) -> None:
        self.step = done

    @contextmanager
    def call(self, slot: int, decides: bool, rows: slice | None):
        """A model call of the current evaluation (parallel/denoiser.py says which)."""
        self._call = _Call(slot, decides, rows)
        try:
            yield
        finally:
            self._call = None

    # ------------------------------------------------------------------ attaching to a model

    @contextmanager
    def attached(self, transformer, plan):
        """The span's blocks run through the cache until the context ends; their forwards are then restored."""
        blocks = [(name, block) for name in plan.blocks for block in getattr(transformer, name)]
        if len(blocks) < 2:
            raise UserError(f"the step cache needs at least 2 blocks in {', '.join(plan.blocks)}; this model has "
                            f"{len(blocks)}", "run it without a cache")
        saved = [(block, block.__dict__.get("forward")) for _, block in blocks]
        head_name, head = blocks[0]
        head.forward = self._head(head.forward, BlockStreams(head, plan, plan.returns[head_name]))
        for index, (name, block) in enumerate(blocks[1:], start=1):
            block.forward = self._rest(block.forward, BlockStreams(block, plan, plan.returns[name]),
                                       tail=index == len(blocks) - 1)
        try:
            yield self
        finally:
            for block, forward in saved:
                if forward is None:
                    del block.forward
                else:
                    block.forward = forward
            self.group = self.shard = None  # the generation's groups: this object outlives it (its counts, its trace)

    def _head(self, forward, signature: BlockStreams):
        def head(*args, **kwargs):
            out = forward(*args, **kwargs)
            call = self._call
            if call is None:
                return out
            image_in, outs = signature.argument(signature.image, args, kwargs), signature.outputs(out)
            image_out = outs[signature.image]
            if call.decides:
                self._reuse = self.decide(image_out, image_in, signature.argument(signature.probe, args, kwargs),
                                          call.rows)
            slot = self._slots.setdefault(call.slot, {})
            # a slot first seen at a reused step (the xDiT MODEL's calls: an area chunk that joins later) computes
            self._skip = self._reuse and "tail" in slot
            if self._skip:
                return signature.returned({**outs, signature.image: image_out + slot["tail"]})
            slot["head"] = image_out
            return out

        return head

    def _rest(self, forward, signature: BlockStreams, tail: bool):
        def rest(*args, **kwargs):
            call = self._call
            if call is not None and self._skip:  # skipped: the streams go through unchanged
                return signature.returned({name: signature.argument(name, args, kwargs) for name in signature.names})
            out = forward(*args, **kwargs)
            if call is not None and tail:
                slot = self._slots[call.slot]
                slot["tail"] = signature.outputs(out)[signature.image] - slot.pop("head")
            return out

        return rest

    # ------------------------------------------------------------------ the decision

    def decide(self, image_out, image_in, probe, rows: slice | None) -> bool:
        """Reuse at this evaluation of ``step``? The same answer on every rank of ``group``. From the span's
        first block: its image output and input, its probe argument, and the cond ``rows`` of them (None:
        none here). A model call's head decides through it, and a PipeFusion stage (StageCache) directly."""
        forced = (self.step < self.options.start or self.step >= self.steps - self.options.end
                  or self.step in self.computes)
        if self.options.method == "fbcache":
            residual = image_out - image_in  # [B, S, D] this rank's rows and tokens
            ratio = None if forced or self._previous is None else self._ratio(residual, self._previous, rows)
            reuse = ratio is not None and ratio < self.options.threshold
            if not reuse:
                self._previous = residual
        else:
            probe = flat_probe(probe)  # [B, features]
            change = None if self._previous is None else self._ratio(probe, self._previous, rows, tokens=False)
            self._previous = probe
            ratio, reuse = None, False
            if change is not None and not forced:
                self._accumulated += float(numpy.polyval(self.coefficients, change))
                ratio = self._accumulated  # what the threshold is compared with
                reuse = ratio < self.options.threshold
            if not reuse:
                self._accumulated = 0.0
        self.trace.append(Decision(self.step, ratio, reuse))
        return reuse

    def _ratio(self, now: torch.Tensor, before: torch.Tensor, rows: slice | None, tokens: bool = True) -> float:
        """Σ|now − before| / Σ|before| over the cond rows and real tokens of every rank of ``group``."""
        sums = torch.zeros(2, dtype=torch.float64, device=now.device)
        if rows is not None:
            change, reference = (now - before)[rows], before[rows]  # [b, S, D] (tokens) or [b, F]
            real = self._real_tokens(change.shape[1]) if tokens else None
            if real is not None:
                change, reference = change[:, real], reference[:, real]  # [b, real tokens, D]
            sums = torch.stack([change.abs().sum(dtype=torch.float64), reference.abs().sum(dtype=torch.float64)])
        if self.group is not None:  # a gloo group (mesh.py): the sums go through the host, as they would anyway
            sums = sums.cpu()
            dist.all_reduce(sums, group=self.group)  # [Σ|change|, Σ|reference|] of the serial run's cond rows
        change_sum, reference_sum = sums.tolist()
        return change_sum / reference_sum if reference_sum > 0 else math.inf

    def _real_tokens(self, local: int) -> torch.Tensor | None:
        """Which of this rank's ``local`` tokens are real (None: no share is padded)."""
        shard = self.shard
        if shard is None or shard.padding is None:
            return None
        image, text = shard.lengths.get("image", 0), shard.lengths.get("text", 0)

        def real(length: int) -> torch.Tensor:
            return torch.arange(shard.share(length)) < shard.counts(length)[shard.index]  # [⌈S/P⌉] bool

        if local == shard.share(image):
            return real(image)
        if local == shard.share(text) + shard.share(image):
            return torch.cat([real(text), real(image)])  # [text share; image share]
        raise RuntimeError(f"the step cache got {local} tokens, not this rank's image share ({shard.share(image)}) "
                           f"nor its text and image shares: the family's CachePlan names another stream")


class StageCache:
    """The step cache on one PipeFusion stage (parallel/pipefusion.py), run over the stage's blocks
    through the family's ``run_block`` (the (image, text) interface PipeFusion runs every family by).

    The stage that holds the span's first block (``decides``) decides at the first chunk of each step,
    as above: over the whole latent during warm-up (the serial run's statistic, exactly), over the
    first patch afterwards, with the all-reduce over its stage's ranks (dp × cfg × ring × ulysses). The
    decision travels to the later stages as a flag row on every activation (``flag``/``read_flag``), so
    every stage skips the same steps for every patch. Each stage keeps, per chunk, the residual its own
    span blocks add to the image stream and adds it on a reused step: the stages' residuals add up to
    the serial cache's. The step after warm-up always computes (residuals are kept per chunk, and the
    chunks change there). The span is the last blocks of the stage order, so the stages before the
    decider hold none of it; they learn the decisions at the end (``share_trace``), for the counts."""

    def __init__(self, cache: StepCache, transformer, plan, blocks: list, decides: bool, rows: slice | None, device):
        span = [block for name in plan.blocks for block in getattr(transformer, name)]  # on this stage
        in_span = [any(block is b for b in span) for block in blocks]
        if in_span != sorted(in_span):
            raise RuntimeError("the step cache's span must be the last blocks of the PipeFusion stage order")
        self.cache, self.decides, self.follows = cache, decides, bool(span) and not decides
        self.rows = rows  # the cond rows of this stage's chunks, as StepCache.call's (None: the uncond pipeline)
        self.head = span[0] if decides else None
        self.rest = [block for block in span if block is not self.head]  # skipped on a reused step
        self.first_span = len(blocks) - len(span)  # index in ``blocks`` of this stage's first span block
        self.reuse = False  # the current step's decision, as far as this stage knows it
        self.residuals: dict = {}  # chunk → [batch, n/P, D]: what this stage's span blocks after the head add
        self.carried: dict = {}  # chunk → how many carried tensors it leaves with (StagePlan.carries)
        self._probe, self._device = None, device
        self._hook = None if self.head is None else self.head.register_forward_pre_hook(
            self._read_probe(BlockStreams(self.head, plan, plan.returns[plan.blocks[0]])), with_kwargs=True)

    def _read_probe(self, streams: BlockStreams):
        def hook(_, args, kwargs):  # outside the block's compiled forward (compile.py)
            self._probe = streams.argument(streams.probe, args, kwargs)
        return hook

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()

    def run(self, blocks: list, run_block, image, text, kwargs, chunk: tuple[int, int], step: int):
        """This stage's ``blocks`` over one chunk (its patches [first, end); a step's first chunk starts at 0)."""
        entering = None  # the image stream entering the first span block after the head
        for index, block in enumerate(blocks):
            if index < self.first_span:
                image, text = run_block(block, image, text, kwargs)
            elif block is self.head:
                before = image
                image, text = run_block(block, image, text, kwargs)
                if chunk[0] == 0:
                    self.cache.step = step
                    self.reuse = self.cache.decide(image, before, self._probe, self.rows)
            elif self.reuse:  # skipped: this stage's residual at the chunk's last computed step, added once
                if block is self.rest[0]:
                    image = image + self.residuals[chunk]  # [batch, n/P, D]
            else:
                if block is self.rest[0]:
                    entering = image
                image, text = run_block(block, image, text, kwargs)
                if block is self.rest[-1]:
                    self.residuals[chunk] = image - entering
        carry = kwargs.get("carry")
        if carry is not None and self.rest:  # skipped blocks neither pop nor push: leave with the usual count
            if not self.reuse:
                self.carried[chunk] = len(carry)
            else:
                count = self.carried[chunk]
                del carry[count:]
                carry.extend(torch.zeros_like(image) for _ in range(count - len(carry)))  # read by skipped blocks only
        return image, text

    def flag(self, like: torch.Tensor) -> torch.Tensor:
        """The decision as one more token row of an activation: [batch, 1, D]."""
        return like.new_full((like.shape[0], 1, like.shape[2]), float(self.reuse))

    def read_flag(self, row: torch.Tensor, chunk: tuple[int, int], step: int) -> None:
        """A stage after the decider: the step's decision from the flag row [batch, 1, D] of its first
        chunk (one host read per step). The read waits on the NCCL receive the row came in with, no longer
        than the activation it rides on, which the stage needs anyway: if the stage before failed, the link
        group's timeout (half the control group's) ends the receive, the watchdog aborts that communicator only
        (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, no heartbeat monitor: worker_env.py) and the read returns, so this
        rank reaches the step gate while the failed one still waits there (review gpu-paths-2 B3). The flag on
        gloo instead would add a message per step and end no wait sooner."""
        if self.follows and chunk[0] == 0:
            self.reuse = bool(row[0, 0, 0].item() > 0.5)
            self.cache.trace.append(Decision(step, None, self.reuse))

    def share_decision(self, group, last_stage: int, step: int) -> None:
        """After one step (a pipelined model call: parallel/pipefusion_call.py): the last stage gives the step's
        decision to the stages before the decider, one broadcast of [1] over the pipeline."""
        decided = torch.tensor([float(self.cache.trace[-1].reused if self.cache.trace else 0.0)], device=self._device)
        dist.broadcast(decided, src=dist.get_global_rank(group, last_stage), group=group)  # [1]: 1 reused
        if not self.cache.trace or self.cache.trace[-1].step != step:
            self.cache.trace.append(Decision(step, None, bool(decided.item())))

    def share_trace(self, group, last_stage: int) -> None:
        """The last stage, which follows or takes every decision, gives them to the stages before the
        decider: one broadcast of [steps] (1 reused, 0 computed) over the pipeline."""
        trace = self.cache.trace
        decided = torch.tensor([float(d.reused) for d in trace] if trace else [0.0] * self.cache.steps,
                               device=self._device)
        dist.broadcast(decided, src=dist.get_global_rank(group, last_stage), group=group)  # [steps]
        if not trace:
            self.cache.trace = [Decision(step, None, bool(reused)) for step, reused in enumerate(decided.tolist())]

class BlockStreams:
    """How one block's forward takes and returns the streams a CachePlan names."""

    def __init__(self, block, plan, names: tuple[str, ...]):
        self.names, self.image, self.probe = names, plan.image, plan.probe
        self.parameters = list(inspect.signature(type(block).forward).parameters)[1:]  # without self

    def argument(self, name: str, args: tuple, kwargs: dict):
        return kwargs[name] if name in kwargs else args[self.parameters.index(name)]

    def outputs(self, out) -> dict:
        return dict(zip(self.names, out if len(self.names) > 1 else (out,)))

    def returned(self, streams: dict):
        values = tuple(streams[name] for name in self.names)
        return values if len(values) > 1 else values[0]


def flat_probe(probe) -> torch.Tensor:
    """A time embedding (a tensor, or a tuple of them) as [B, features]."""
    parts = probe if isinstance(probe, (tuple, list)) else (probe,)
    return torch.cat([p.reshape(p.shape[0], -1).float() for p in parts], dim=1)
