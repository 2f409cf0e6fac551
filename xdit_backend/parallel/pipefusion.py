"""PipeFusion (arXiv 2405.14430): blocks in pipeline stages, the latent in patches, stale K/V.

For any family, from its StagePlan (models/base.py) and its model wrapper's stage methods:

- Stages: the plan's block lists, concatenated, cut into ``pipefusion`` contiguous runs; a rank
  keeps only its run (plus the small embedding and output layers).
- Patches: bands of token rows. For video, a patch is the same band of rows in every frame, so
  in the latent it is always the slice [..., rows, :] of dim −2, whatever the rank, and its tokens
  are frames × band rows × columns (positions: those of the whole latent, cut to the patch). The
  first ``warmup_steps`` steps send the whole latent as one chunk (exact); later steps send
  ``num_pipeline_patch`` patches. Joint-text families' text travels with each step's first chunk,
  and so do reference latents' tokens (edits: DiffusionModel.stage_references), ahead of the
  chunk's image tokens and replicated on the sequence ranks; the last stage drops them before the head.
- Carried tensors (StagePlan.carries: HunyuanDiT's long skips): a patch's blocks may leave
  tensors [B, n/P, D] for its later blocks on a per-patch list; the ones still on it at a stage's
  end travel with the patch's activations, [text; image; carried...] along the tokens.
- Stale K/V: stale_kv.py. Schedule and step gate: schedule.py — patches of step k + 1 enter stage
  0 while the last stage finishes step k; each stage meets the gate where it stands then.
- Sampler: the one implementation (sampling/samplers.py). The last stage keeps one walk per
  patch (its own history: dpmpp_2m's previous x0, uni_pc's predictions) and sends each patch's
  next model input (or, after the last step, its final latent) back to stage 0. Whole-latent
  noise is drawn once per step and cut to each patch (sampling/noise.py). A sampler with two model
  calls in a step (heun) cannot be pipelined: the leader refuses it before the ranks start
  (service/leader.py), and the last stage stops if a walk ever asks for a second call in a step.
- Step cache (step_cache.StageCache): the stage holding the cache span's first block decides at each
  step's first chunk; the decision rides on every activation as one more token row to the later stages.
- Guidance and latent format: the normal path's (denoiser.guided, generate.start/finish).
- Hybrids: sequence-parallel ranks hold a slice of each chunk's tokens and all-gather its fresh
  K/V and its output; CFG halves each run a pipeline and combine x0 at the last stage; dp groups
  run separate pipelines over their batch rows.
- Transport: a pipeline is a ring of one-way links, stage s → s + 1 and last → 0 (the patches
  coming back), each a 2-rank process group of its own (mesh.Links). A stage receives only on its
  incoming link and sends only on its outgoing one.

Why no cycle can form on NCCL. NCCL runs every batched point-to-point op of a group on the
group's one communicator and one stream, in posting order, and a receive holds that stream until
its send arrives. With one group carrying both directions, stage 0's receives of the returns
(posted ahead) sat in front of its sends to stage 1, and stage 1's receives in front of its
returns: a cycle at the first step (gloo runs each op on its own, so the CPU tests passed). On a
link one rank only sends and the other only receives, both in the order of the work list
(schedule.py): the k-th send can only meet the k-th receive anyway, so running them in order adds
no wait, and a link's stream waits for nothing but its own peer's matching op. An op on one link
never queues behind an op on another. What a rank waits for is then exactly what the schedule
makes it wait for on gloo (an op starts where it is posted, a receive ends when its send has
run), and the gloo tests run that schedule to the end: it has no cycle. Receives posted ahead
hold only the incoming link's stream, so a middle stage's sends never queue behind its receives
and the stages overlap. Both members of a 2-rank group take part in every op on it (NCCL's rule
for a group's first batched op), and every rank creates every link in the same order (mesh.py).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.mesh import Link
from ..sampling import samplers
from ..sampling.generate import GenerationStopped, finish, start
from ..sampling.noise import SharedDraws
from . import attention, schedule, stale_kv
from .denoiser import guided
from .step_cache import StageCache, StepCache


def stage_bounds(sizes: list[int], stages: int, counts: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) block indices per stage: the given counts, or the contiguous split whose heaviest
    stage has the fewest parameters (``sizes`` are the blocks' parameter counts, in order)."""
    if counts is None:
        counts = _balanced_counts(sizes, stages)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [(s, s + c) for s, c in zip(starts, counts)]


def _balanced_counts(sizes: list[int], stages: int) -> tuple[int, ...]:
    """Minimise the largest stage (a small dynamic programme: blocks ≤ a few dozen, stages ≤ 8)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    # best[k][i]: (heaviest stage, counts) splitting the first i blocks into k stages
    best = [[None] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, ())
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            options = [(max(best[k - 1][j][0], prefix[i] - prefix[j]), best[k - 1][j][1] + (i - j,))
                       for j in range(k - 1, i) if best[k - 1][j] is not None]
            best[k][i] = min(options)
    return best[stages][n][1]


def keep_stage(transformer, plan, start: int, end: int) -> list[nn.Module]:
    """Drop every block outside [start, end) of the plan's concatenated block lists; returns the kept blocks in order."""
    kept, offset = [], 0
    for name in plan.block_lists:
        blocks = list(getattr(transformer, name))
        mine = [b for i, b in enumerate(blocks, start=offset) if start <= i < end]
        setattr(transformer, name, nn.ModuleList(mine))
        kept.extend(mine)
        offset += len(blocks)
    return kept


def _isend(tensor: torch.Tensor, link: Link):
    """Post a send to the other end of ``link`` (through batch_isend_irecv, the one point-to-point
    entry the traffic count sees). The link's group carries the layout's timeout, half the control
    group's, so after a stage raises, a peer stuck waiting for it times out and reaches the step
    gate while the failed rank still waits there (agreement.py)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, link.peer, link.group)])[0]


def _irecv(tensor: torch.Tensor, link: Link):
    """Post a receive into ``tensor`` from the other end of ``link``."""
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, link.peer, link.group)])[0]


def call_sigmas(name: str, sigmas: torch.Tensor, sampling) -> list[float]:
    """The σ of each step's model call, read off the sampler itself (dpmpp_2m_sde moves σ = 1 of a
    flow model; uni_pc's times): its walk over a one-element latent with x0 = x. ``sigmas`` on the
    host; the σ come back as host floats, so the step loop never reads one off the device."""
    walk = samplers.walk(name, torch.zeros(1), sigmas, sampling, samplers.StepNoise((1,), 0))
    found, call = [], next(walk)
    try:
        while True:
            found.append(float(call.sigma))
            call = walk.send(call.x)
    except StopIteration:
        return found


def always_computed(warmup: int, patches: int, steps: int) -> frozenset[int]:
    """The steps a step cache under PipeFusion always computes: the first patched one, where the chunks change
    (StageCache keeps its residuals per chunk)."""
    return frozenset({warmup} if 0 < warmup < steps and patches > 1 else ())


class PipeFusion:
    """One rank's stage of a PipeFusion layout, and the loop that drives its chunks."""

    def __init__(self, model, layout, device, blocks: list[nn.Module], holds_cache_head: bool = False):
        config = layout.config
        self.model, self.layout, self.device = model, layout, device
        self.plan = model.spec.stage_plan
        self.stages, self.stage = config.pipefusion, layout.index("pipefusion")
        self.first, self.last = self.stage == 0, self.stage == config.pipefusion - 1
        self.links, self.sp_group = layout.links, layout.sequence_group
        self.sp_index, self.sp_parts = layout.sequence_index, config.sequence
        self.cfg_group = layout.group("cfg")
        self.patches = config.patches
        self.warmup = config.warmup_steps
        self.blocks = blocks  # this stage's blocks, in order
        self.holds_cache_head = holds_cache_head  # the step cache's first block: this stage decides (step_cache.py)
        self.cache: StageCache | None = None  # a generation's step cache on this stage
        self.chunk = stale_kv.Chunk()
        self.trace: list[tuple[str, int, int]] = []  # ("post" | "wait", step, first patch): receives posted ahead

    def run(self, gen, rows: slice, after_step) -> torch.Tensor:
        """This rank's batch ``rows`` of the final latent in raw VAE space (stage 0 holds the result)."""
        if gen.steps == 0:  # start_step past the end: the input, as KSamplerAdvanced returns it
            return gen.latent.float()[rows].to(self.device)  # on the device, like a result: dp gathers it there
        self.gen = gen
        begin = start(gen, self.model.latent_format, rows, self.device)
        self.x = begin.x.clone()  # stage 0: each patch's next model input; at the end, the final latent
        shape = tuple(begin.x.shape)  # [B, C, (T,) h, w]
        self.sides = self._sides(begin)
        self.inpaint = begin.inpaint
        self._lay_out(shape)
        self.sigmas = call_sigmas(gen.sampler, gen.sigmas, gen.sampling)
        self.work = schedule.items(gen.steps, self.warmup, self.patches)
        gates = schedule.gate_positions(self.work, self.stages, gen.steps)
        self.walks, self.calls = self._walks(gen, begin)
        transformer = self.model.transformer
        saved = transformer.attn_processors
        stale_kv.attach(transformer, self.plan, self.chunk, self.sp_group, attention.local_attention(self.device))
        self.pending, self.returns, self.sends, self.inputs = {}, deque(), [], {}
        self.cache = self._step_cache(gen, begin)
        try:
            self._post(gates, 0)
            gate = 0
            for index, item in enumerate(self.work):
                self._run_item(index, item)
                while gate < gen.steps and gates[self.stage][gate] == index:
                    self._wait_sends()  # matched: the peers posted these receives after the gate before
                    if not after_step(gate + 1, gen.steps):
                        self._drain()
                        raise GenerationStopped()
                    gate += 1
                    if gate < gen.steps:
                        self._post(gates, gate)
            self._drain()
            if self.cache is not None:
                self.cache.share_trace(self.layout.group("pipefusion"), self.stages - 1)
        finally:
            transformer.set_attn_processor(saved)
            if self.cache is not None:
                self.cache.detach()
        return finish(gen, self.model.latent_format, self.x, begin.sigmas)

    def _lay_out(self, shape: tuple[int, ...]) -> None:
        """The chunks of a latent of ``shape`` [B, C, (T,) h, w] conditioned by ``self.sides``: the rows a chunk
        carries, its text, the blocks' width and carried tensors, the token grid, the patches' bands, the positions."""
        self.batch = self.sides["context"].shape[0]
        self.text = self.model.joint_text_tokens(self.sides) if self.plan.joint_text else 0
        self.width = self.model.width  # the blocks' hidden size D
        # per-patch tensors [B, n/P, D] arriving with each patch (StagePlan.carries); stage 0 gets none
        self.carried = self.model.carried(self.blocks[0]) if self.plan.carries and not self.first else 0
        pt, ph, pw = self.model.spec.patch
        frames = shape[2] // pt if len(shape) == 5 else 1
        token_rows, columns = shape[-2] // ph, shape[-1] // pw
        # the image sequence is frames × rows × columns, row-major: token indices as that grid
        self.grid = torch.arange(frames * token_rows * columns, device=self.device).view(frames, token_rows, columns)
        self.latent_rows = ph  # latent rows per token row
        self.bands = [(int(b[0]), int(b[-1]) + 1)  # token rows [r0, r1) per patch
                      for b in torch.tensor_split(torch.arange(token_rows), self.patches)]
        self.positions = self.model.positions(shape)
        # reference latents (edits): model-input tokens [batch, R, C_in] that travel with each step's first chunk,
        # their positions appended to the image sequence's at indices [N, N + R)
        self.reference_input, self.positions = self.model.stage_references(self.sides, self.positions)
        self.references = 0 if self.reference_input is None else self.reference_input.shape[1]
        image_tokens = self.grid.numel()
        self.reference_tokens = torch.arange(image_tokens, image_tokens + self.references, device=self.device)  # [R]
        # the channels ComfyUI concatenates to the model input (image to video), for the whole latent: [batch, E, ...]
        latent = shape[1] == self.model.spec.latent_format.channels
        self.concat = self.model.concat((self.batch, *shape[1:]), self.sides) if latent else None

    def _with_concat(self, x: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """A chunk's model input [batch, C, (T,) b − a, w] with its rows of the concatenated channels."""
        return x if self.concat is None else torch.cat([x, self.concat[..., a:b, :].to(x)], dim=1)

    def _step_cache(self, gen, begin) -> StageCache | None:
        """The generation's step cache on this stage (None without one). Its cond rows: all of this
        pipeline's under cfg parallel (none on the uncond one), else the first B of [cond; uncond]."""
        if gen.cache is None:
            return None
        steps = StepCache(gen.cache, gen.steps, self.model.spec.cache_plan.teacache, self.layout.step_group,
                          computes=always_computed(self.warmup, self.patches, gen.steps))
        if self.cfg_group is not None:
            rows = slice(None) if self.layout.index("cfg") == 0 else None
        else:
            rows = slice(0, begin.x.shape[0])
        return StageCache(steps, self.model.transformer, self.model.spec.cache_plan, self.blocks,
                          self.holds_cache_head, rows, self.device)

    def _sides(self, begin) -> dict:
        """The conditioning this pipeline carries: one side with cfg=2, else both batched (as serial)."""
        if self.cfg_group is not None:
            return begin.positive if self.layout.index("cfg") == 0 else begin.negative
        if begin.negative is None:
            return begin.positive
        return {k: torch.cat([begin.positive[k], begin.negative[k]]) for k in begin.positive}

    def _walks(self, gen, begin):
        """Stage 0 and the last stage: one sampler walk per patch over its band of rows, and its first call."""
        if not (self.first or self.last):
            return [], []
        shared = SharedDraws(begin.noise, self.patches)
        walks, calls = [], []
        for r0, r1 in self.bands:
            band = slice(r0 * self.latent_rows, r1 * self.latent_rows)
            walk = samplers.walk(gen.sampler, begin.x[..., band, :], begin.sigmas, gen.sampling, shared.band(band))
            walks.append(walk)
            calls.append(next(walk))
        if self.first:
            self.x = torch.cat([call.x for call in calls], dim=-2)  # [B, C, (T,) h, w]
        return walks, calls

    def _token_rows(self, item) -> tuple[int, int]:
        """Token rows [r0, r1) of an item's patches."""
        return self.bands[item.first][0], self.bands[item.end - 1][1]

    def _rows(self, item) -> tuple[int, int]:
        """Latent rows [a, b) of an item's patches."""
        r0, r1 = self._token_rows(item)
        return r0 * self.latent_rows, r1 * self.latent_rows

    def _tokens(self, item) -> tuple[torch.Tensor, torch.Tensor]:
        """The item's tokens in the whole image sequence [n] (frames × band rows × columns), and this rank's slice."""
        r0, r1 = self._token_rows(item)
        band = self.grid[:, r0:r1].reshape(-1)
        per = band.numel() // self.sp_parts
        return band, band[self.sp_index * per:(self.sp_index + 1) * per]

    def _prefix(self, index: int) -> tuple[int, int]:
        """(text, reference) tokens item ``index`` carries ahead of its image tokens: all of them with a step's first
        chunk, none with the others."""
        if index == 0 or self.work[index - 1].step != self.work[index].step:
            return self.text, self.references
        return 0, 0

    def _post(self, gates, gate: int) -> None:
        """Post the receives of the messages the peer sends between gate − 1 and gate (schedule.window)."""
        if self.first:  # the last stage's returns: next model inputs (or final latents) of its items
            for index in schedule.window(gates[self.stages - 1], gate):
                item = self.work[index]
                a, b = self._rows(item)
                buffer = torch.empty(*self.x.shape[:-2], b - a, self.x.shape[-1], device=self.device)
                request = _irecv(buffer, self.links.incoming)  # a patch back from the last stage
                self.returns.append((item, a, b, buffer, request))
                self.trace.append(("post", item.step, item.first))
            return
        for index in schedule.window(gates[self.stage - 1], gate):
            item = self.work[index]
            local = self._tokens(item)[1].numel()
            tokens = local * (1 + self.carried) + sum(self._prefix(index)) + (self.cache is not None)
            buffer = torch.empty(self.batch, tokens, self.width, device=self.device, dtype=self.model.dtype)
            # [B, (L + R +) n/P + carried·n/P (+ 1: the step cache's flag), D] from the previous stage
            self.pending[index] = (buffer, _irecv(buffer, self.links.incoming))
            self.trace.append(("post", item.step, item.first))

    def _apply_returns(self, step: int, until: int) -> None:
        """Stage 0: wait for the returns of steps before ``step`` that start above latent row ``until``, in order."""
        while self.returns and self.returns[0][0].step < step and self.returns[0][1] < until:
            item, a, b, buffer, request = self.returns.popleft()
            self.trace.append(("wait", item.step, item.first))
            request.wait()
            self.x[..., a:b, :] = buffer

    def _run_item(self, index: int, item) -> None:
        """Run one item through this stage: take it in (embed, or receive), run the blocks, pass it on."""
        model = self.model
        inputs = self._inputs(item.step)
        band, local = self._tokens(item)
        text, references = self._prefix(index)
        self.chunk.describe(text, self.text, tuple(self.grid.shape), self._token_rows(item), references,
                            self.references)
        if self.first:
            image = model.embed(self._model_input(item).to(model.dtype), band, inputs, self.positions)
            image = image[:, self.sp_index * local.numel():(self.sp_index + 1) * local.numel()]  # [batch, n/P, D]
            if references:  # [batch, R + n/P, D]: the references ahead of the patch's tokens
                image = torch.cat([model.embed_references(self.reference_input), image], dim=1)
            context = model.embed_text(inputs) if text else None
            if self.text and not text:
                context = image.new_zeros(self.batch, 0, image.shape[2])  # joint blocks without the text this time
            carry = []
        else:
            received, request = self.pending.pop(index)
            self.trace.append(("wait", item.step, item.first))
            request.wait()
            if self.cache is not None:
                self.cache.read_flag(received[:, -1:], (item.first, item.end), item.step)  # [batch, 1, D]
                received = received[:, :-1]
            n = local.numel()
            # [batch, L or 0, D], [batch, (R +) n/P, D]
            context, image = received[:, :text], received[:, text:text + references + n]
            # carried × [batch, n/P, D]
            carry = list(received[:, text + references + n:].split(n, dim=1)) if self.carried else []
            if not self.text:
                context = None
        placed = torch.cat([self.reference_tokens, local]) if references else local  # [(R +) n/P]: references first
        kwargs = model.block_kwargs(inputs, self.positions, placed, text)
        if self.plan.carries:
            kwargs["carry"] = carry  # the blocks pop and push the patch's carried tensors here
        if self.cache is None:
            for block in self.blocks:
                image, context = model.run_block(block, image, context, kwargs)
        else:
            image, context = self.cache.run(self.blocks, model.run_block, image, context, kwargs,
                                            (item.first, item.end), item.step)
        if not self.last:
            parts = [*([context] if self.text else []), image, *carry,
                     *([self.cache.flag(image)] if self.cache is not None else [])]
            activation = (torch.cat(parts, dim=1) if len(parts) > 1 else image).contiguous()
            # [batch, (L + R +) n/P + carried·n/P (+ 1), D] to the next stage
            self.sends.append((activation, _isend(activation, self.links.outgoing)))
            return
        self._finish(item, model.head(image[:, references:], inputs, local))  # the patch's tokens alone

    def _sigma(self, step: int) -> torch.Tensor:
        return self.x.new_full([self.batch], self.sigmas[step])  # [batch], filled from the host float

    def _inputs(self, step: int) -> dict:
        """The family's per-step inputs (time embedding, projected text), computed once per step."""
        if step not in self.inputs:
            timestep = self.gen.sampling.timestep(self._sigma(step))  # [batch]
            self.inputs = {step: self.model.step_inputs(tuple(self.x.shape), timestep, self.sides, self.gen.guidance)}
        return self.inputs[step]

    def _model_input(self, item) -> torch.Tensor:
        """Stage 0: the model input of the item's rows [batch, C, (T,) b − a, w], once the last stage has returned
        them from the step before."""
        a, b = self._rows(item)
        self._apply_returns(item.step, b)
        x = self._inpainted(self.x[..., a:b, :], item, a, b)
        x = x.repeat(self.batch // x.shape[0], *(1,) * (x.dim() - 1))  # cond and uncond batched: [batch, ...]
        return self._with_concat(self.gen.sampling.calculate_input(self._sigma(item.step), x), a, b)

    def _inpainted(self, x: torch.Tensor, item, a: int, b: int) -> torch.Tensor:
        """The walk's x [B, C, (T,) b − a, w] as the model takes it under a noise mask (sampling/inpaint.py)."""
        if self.inpaint is None:
            return x
        return self.inpaint.band(a, b).model_input(x, self.sigmas[item.step], self.gen.sampling)

    def _finish(self, item, out: torch.Tensor) -> None:
        """Last stage: the item's x0 (gathered, guided), each patch's sampler update, the return to stage 0."""
        sigma = self._sigma(item.step)
        a, b, raw = self._raw_rows(item, out)
        x = torch.cat([self.calls[p].x for p in range(item.first, item.end)], dim=-2)  # [B, C, (T,) b − a, w]
        x = self._inpainted(x, item, a, b)  # what the model was given
        batched = x.repeat(self.batch // x.shape[0], *(1,) * (x.dim() - 1))
        x0 = self.gen.sampling.calculate_denoised(sigma, raw, batched)
        if self.cfg_group is not None:
            x0 = guided(x0, self.gen.cfg, self.cfg_group)
        elif self.batch != x.shape[0]:
            x0 = guided(x0, self.gen.cfg)  # [B, ...]
        if self.inpaint is not None:
            x0 = self.inpaint.band(a, b).output(x0)
        following = []
        for p in range(item.first, item.end):
            r0, r1 = (r * self.latent_rows - a for r in self.bands[p])
            if self.calls[p].step != item.step:
                raise RuntimeError(f"PipeFusion: sampler {self.gen.sampler!r} asked for a second model call in "
                                   f"step {item.step}; only samplers in {samplers.ONE_CALL_PER_STEP} can be pipelined")
            try:
                self.calls[p] = self.walks[p].send(x0[..., r0:r1, :])
                following.append(self.calls[p].x)
            except StopIteration as end:  # the patch's last step: its final latent
                following.append(end.value)
        self.x[..., a:b, :] = update = torch.cat(following, dim=-2)  # [B, C, (T,) b − a, w]
        self.sends.append((update, _isend(update, self.links.outgoing)))  # back to stage 0

    def _raw_rows(self, item, out: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """Last stage: the item's latent rows [a, b) and the model's raw output on them [batch, C, (T,) b − a, w]
        (float32), from the head's tokens ``out`` [batch, n/P, V] (gathered over the sequence ranks)."""
        if self.sp_group is not None:
            out = stale_kv.gather_tokens(out, self.sp_group)  # [batch, n/P, V] → [batch, n, V]
        a, b = self._rows(item)
        shape = (self.batch, *self.x.shape[1:-2], b - a, self.x.shape[-1])
        return a, b, self.model.unpatchify(out, shape).float()

    def _wait_sends(self) -> None:
        for _, request in self.sends:  # (tensor kept alive until sent, request)
            request.wait()
        self.sends = []

    def _drain(self) -> None:
        """Complete every posted receive and send (each has its peer by the schedule's windows)."""
        self._apply_returns(self.work[-1].step + 1, self.x.shape[-2])
        for _, request in self.pending.values():
            request.wait()
        self.pending = {}
        self._wait_sends()
