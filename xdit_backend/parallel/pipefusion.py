"""PipeFusion (arXiv 2405.14430): blocks in pipeline stages, the latent in patches, stale K/V.

- Stages: the transformer's blocks, double-stream then single-stream, cut into ``pipefusion``
  contiguous runs; a rank keeps only its run (plus the small embedding and output layers).
- Patches: bands of token rows. The first ``warmup_steps`` steps send the whole latent as one
  patch (exact); later steps send ``num_pipeline_patch`` patches. Text tokens travel with patch 0.
- Stale K/V: every attention layer keeps a K/V buffer over all tokens. A patch writes its fresh
  K/V there and attends to the whole buffer, so the other patches' K/V are the ones written one
  step earlier (or earlier in this step, for patches ahead of it). Only written positions are read.
- Schedule: receives for all patches of a step are posted before the first is waited on, so
  transfers overlap compute; the last stage applies the sampler step to each patch and sends it
  back to stage 0 for the next step.
- Hybrids: sequence-parallel ranks split each patch and all-gather its fresh K/V (no all-to-all);
  CFG halves exchange each patch's velocity at the last stage; dp groups run separate pipelines.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import attention
from ..models.flux import attention_inputs, attention_outputs, image_ids, pack, unpack
from ..sampling.generate import GenerationStopped, comfy_noise


def _isend(tensor: torch.Tensor, peer: int):
    """Post a send (through batch_isend_irecv, the one point-to-point entry the traffic count sees)."""
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer)])[0]


def _irecv(tensor: torch.Tensor, peer: int):
    """Post a receive into ``tensor``."""
    return dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, peer)])[0]


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


def keep_stage(transformer, start: int, end: int) -> list[nn.Module]:
    """Drop every block outside [start, end) of the combined list; returns the kept blocks in order."""
    double = len(transformer.transformer_blocks)
    blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
    transformer.transformer_blocks = nn.ModuleList(b for i, b in enumerate(blocks[:double]) if start <= i < end)
    transformer.single_transformer_blocks = nn.ModuleList(
        b for i, b in enumerate(blocks[double:], start=double) if start <= i < end)
    return blocks[start:end]


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
    """What the stage is processing now: the buffer positions of its tokens, text first."""

    def __init__(self):
        self.positions = None  # [n] long: this rank's tokens (text, then its image tokens)
        self.patch_positions = None  # [n_patch] long: the whole patch across the SP group (image part)
        self.text_tokens = 0
        self.total = 0


class StaleKVProcessor:
    """Flux attention against a per-layer K/V buffer; fresh K/V of the chunk shared in the SP group."""

    def __init__(self, chunk: Chunk, sp_group, kernel):
        self.chunk, self.sp_group, self.kernel = chunk, sp_group, kernel
        self.buffer = KVBuffer()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        # q, k, v: [B, n, H, D] for this rank's tokens of the chunk (text first when it carries text)
        query, key, value = attention_inputs(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        chunk = self.chunk
        L = chunk.text_tokens
        if self.sp_group is None:
            self.buffer.write(chunk.positions, key, value, chunk.total)
        else:  # text is the same on every SP rank; the image part of the patch is gathered
            if L:
                self.buffer.write(chunk.positions[:L], key[:, :L], value[:, :L], chunk.total)
            parts = dist.get_world_size(self.sp_group)
            for name, fresh in (("k", key[:, L:]), ("v", value[:, L:])):
                gathered = [torch.empty_like(fresh) for _ in range(parts)]
                dist.all_gather(gathered, fresh.contiguous(), group=self.sp_group)  # P × [B, n/P, H, D]
                setattr(self, f"_{name}", torch.cat(gathered, dim=1))  # [B, n, H, D]
            self.buffer.write(chunk.patch_positions, self._k, self._v, chunk.total)
        k_all, v_all = self.buffer.read()  # [B, written, H, D]
        out, _ = self.kernel(query, k_all, v_all)  # [B, n, H, D]
        return attention_outputs(attn, out.to(query.dtype), encoder_hidden_states)


class PipeFusion:
    """One rank's stage of a PipeFusion layout, and the sampler loop that drives the patches."""

    def __init__(self, model, layout, device, blocks: list[nn.Module]):
        config = layout.config
        self.model, self.layout, self.device = model, layout, device
        self.stages = config.pipefusion
        self.stage = layout.index("pipefusion")
        self.pp_group = layout.group("pipefusion")
        self.sp_group = layout.sequence_group
        self.sp_index, self.sp_parts = layout.sequence_index, config.sequence
        self.cfg_group = layout.group("cfg")
        self.patches = config.num_pipeline_patch or config.pipefusion
        self.warmup = config.warmup_steps
        self.blocks = blocks  # this stage's blocks, in order
        self.chunk = Chunk()
        self.trace: list[tuple[str, int, int]] = []  # ("post" | "wait", step, patch): shows receives posted ahead
        self.updates: list = []  # stage 0: (start, end, buffer, request) of patches the last stage will send back

    def _peer(self, stage: int) -> int:
        """Global rank of the given stage at this rank's other coordinates."""
        return dist.get_global_rank(self.pp_group, stage)

    def run(self, gen, rows: slice, after_step) -> torch.Tensor:
        if gen.steps == 0:  # start_step past the end: the input, as KSamplerAdvanced returns it
            return gen.latent.float()[rows]
        t = self.model.transformer
        full = gen.latent.float()
        b, _, h, w = full.shape
        fmt = self.model.latent_format
        noise = comfy_noise(tuple(full.shape), gen.seed) if gen.add_noise else torch.zeros_like(full)
        start = (fmt.process_in(full) if torch.count_nonzero(full) > 0 else full)[rows]
        sigmas = gen.sigmas.to(self.device)
        x = pack(gen.sampling.noise_scaling(sigmas[0], noise[rows].to(self.device), start.to(self.device)))  # [B, N, 64]
        n_tokens = x.shape[1]
        ids = image_ids(h, w).to(self.device)  # [N, 3]
        sides = self._sides(gen, rows)
        text = sides["context"].shape[1]
        total = text + n_tokens
        grid_rows = h // 2
        processors = {name: StaleKVProcessor(self.chunk, self.sp_group, attention.local_attention(self.device))
                      for name in t.attn_processors}
        saved = t.attn_processors
        t.set_attn_processor(processors)
        try:
            for step in range(gen.steps):
                n_patches = 1 if step < self.warmup else self.patches
                bands = torch.tensor_split(torch.arange(grid_rows), n_patches)
                spans = [(int(r[0]) * (w // 2), (int(r[-1]) + 1) * (w // 2)) for r in bands]  # token [start, end)
                x = self._step(step, x, spans, sides, ids, text, total, sigmas, gen)
                if not after_step(step + 1, gen.steps):
                    raise GenerationStopped()
            if self.stage == 0:
                x = self._apply_updates(x, until=n_tokens)  # the final patches
        finally:
            t.set_attn_processor(saved)
            self.updates = []
        x = gen.sampling.inverse_noise_scaling(sigmas[-1], unpack(x.float(), h, w))  # [B, 16, h, w]
        return fmt.process_out(x)

    def _sides(self, gen, rows) -> dict:
        """The conditioning this pipeline carries: one side with cfg=2, else both batched (as serial)."""
        positive = {k: v[rows] for k, v in gen.positive.items()}
        negative = {k: v[rows] for k, v in gen.negative.items()} if gen.uses_cfg else None
        if self.cfg_group is not None:
            return positive if self.layout.index("cfg") == 0 else negative
        if negative is None:
            return positive
        return {k: torch.cat([positive[k], negative[k]]) for k in positive}

    def _step(self, step, x, spans, sides, ids, text, total, sigmas, gen):
        t, dtype = self.model.transformer, self.model.dtype
        batch = sides["context"].shape[0]
        sigma = sigmas[step]
        timestep = torch.full((batch,), float(sigma), device=self.device, dtype=dtype) * 1000
        guidance = torch.full((batch,), gen.guidance, device=self.device, dtype=dtype) * 1000
        pooled = sides["pooled"].to(self.device, dtype)
        temb = (t.time_text_embed(timestep, guidance, pooled) if self.model.has_guidance
                else t.time_text_embed(timestep, pooled))
        width = t.inner_dim
        first, last = self.stage == 0, self.stage == self.stages - 1

        # Receives for every patch of this step, posted before any is waited on: activations from the
        # previous stage, or (stage 0) this step's patches coming back from the last stage's sampler step.
        pending, posted = {}, []
        for p, (a, b) in enumerate(spans):
            if first:
                update = torch.empty(x.shape[0], b - a, x.shape[2], device=self.device, dtype=x.dtype)
                posted.append((a, b, update, _irecv(update, self._peer(self.stages - 1))))
            else:
                rows = (text if p == 0 else 0) + (b - a) // self.sp_parts
                buffer = torch.empty(batch, rows, width, device=self.device, dtype=dtype)
                pending[p] = (buffer, _irecv(buffer, self._peer(self.stage - 1)))
            self.trace.append(("post", step, p))
        sends = []
        for p, (a, b) in enumerate(spans):
            local_a = a + self.sp_index * ((b - a) // self.sp_parts)
            local_b = local_a + (b - a) // self.sp_parts
            self._describe_chunk(p, a, b, local_a, local_b, text, total)
            rotary = t.pos_embed(torch.cat([torch.zeros(text if p == 0 else 0, 3, device=self.device),
                                            ids[local_a:local_b]]))
            if first:
                x = self._apply_updates(x, until=b, step=step)  # the previous step's patches up to this one
                image = t.x_embedder(x[:, local_a:local_b].to(dtype).repeat(batch // x.shape[0], 1, 1))
                context = t.context_embedder(sides["context"].to(self.device, dtype)) if p == 0 else \
                    image.new_zeros(batch, 0, image.shape[2])
            else:
                received, request = pending[p]
                self.trace.append(("wait", step, p))
                request.wait()
                split = text if p == 0 else 0
                context, image = received[:, :split], received[:, split:]
            for block in self.blocks:
                context, image = block(hidden_states=image, encoder_hidden_states=context, temb=temb,
                                       image_rotary_emb=rotary)
            if not last:
                activation = torch.cat([context, image], dim=1).contiguous()
                sends.append((activation, _isend(activation, self._peer(self.stage + 1))))
                continue
            velocity = t.proj_out(t.norm_out(image, temb)).float()  # [batch, n/P, 64]
            x = self._sampler_step(x, velocity, a, b, sigmas, step, gen)
            if not first:
                patch = x[:, a:b].contiguous()
                sends.append((patch, _isend(patch, self._peer(0))))
        self.updates.extend(posted)
        for _, request in sends:
            request.wait()
        return x

    def _apply_updates(self, x, until: int, step: int = -1):
        """Stage 0: wait for the returned patches that start before token ``until``, in order, and apply them."""
        while self.updates and self.updates[0][0] < until:
            a, b, update, request = self.updates.pop(0)
            self.trace.append(("wait", step, a))
            request.wait()
            x[:, a:b] = update
        return x

    def _describe_chunk(self, p, a, b, local_a, local_b, text, total):
        image_positions = torch.arange(text + local_a, text + local_b, device=self.device)
        with_text = p == 0 and text > 0
        self.chunk.text_tokens = text if with_text else 0
        self.chunk.positions = torch.cat([torch.arange(text, device=self.device), image_positions]) \
            if with_text else image_positions
        self.chunk.patch_positions = torch.arange(text + a, text + b, device=self.device)
        self.chunk.total = total

    def _sampler_step(self, x, velocity, a, b, sigmas, step, gen):
        """Last stage: gather the patch's velocity (SP, CFG), then ComfyUI's Euler step for its tokens."""
        if self.sp_group is not None:
            parts = [torch.empty_like(velocity) for _ in range(self.sp_parts)]
            dist.all_gather(parts, velocity.contiguous(), group=self.sp_group)
            velocity = torch.cat(parts, dim=1)  # [batch, n, 64]
        sigma, following = sigmas[step], sigmas[step + 1]
        x_patch = x[:, a:b]
        if self.cfg_group is not None:
            both = [torch.empty_like(velocity) for _ in range(2)]
            dist.all_gather(both, velocity.contiguous(), group=self.cfg_group)
            cond_x0, uncond_x0 = (x_patch - v * sigma for v in both)
            x0 = uncond_x0 + (cond_x0 - uncond_x0) * gen.cfg
        elif velocity.shape[0] != x.shape[0]:  # cond and uncond batched together
            cond_v, uncond_v = velocity.chunk(2)
            cond_x0, uncond_x0 = x_patch - cond_v * sigma, x_patch - uncond_v * sigma
            x0 = uncond_x0 + (cond_x0 - uncond_x0) * gen.cfg
        else:
            x0 = x_patch - velocity * sigma
        x = x.clone()
        x[:, a:b] = x_patch + (x_patch - x0) / sigma * (following - sigma)
        return x
