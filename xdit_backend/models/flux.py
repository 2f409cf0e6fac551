"""Flux: diffusers ``FluxTransformer2DModel`` fed the way ComfyUI feeds its own Flux model.

Joint text+image attention (MM-DiT, double- then single-stream blocks), 2-D RoPE over
(0, row, column) token positions. Sequence parallelism cuts the transformer's inputs, as
diffusers' own ``_cp_plan`` for Flux does: the image tokens and their positions, and the text
tokens and theirs, so each rank's RoPE matches its tokens; it gathers after ``proj_out``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan, reference_rows, references
from .patch_embed import pack, pad_to_patch, unpack
from .resize import upscale

FLUX_DEFAULT_SHIFT = 1.15  # ComfyUI's ModelSamplingFlux default
FLUX_DEFAULT_GUIDANCE = 3.5  # ComfyUI's default when no FluxGuidance node sets one


def image_ids(h: int, w: int, device: torch.device | None = None) -> torch.Tensor:
    """[(h/2)·(w/2), 3] positions (0, row, column) of the image tokens, as ComfyUI and diffusers build
    them; made on ``device`` (no host→device copy)."""
    rows = torch.arange(h // 2, device=device).view(-1, 1).expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=device).view(1, -1).expand(h // 2, w // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()


def kontext_offsets(latents: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each reference latent's position offset (index, row, column) [3] in tokens, as ComfyUI's Flux places
    references by default ("offset", comfy/ldm/flux/model.py ``_forward``): index 1, each next to the ones before,
    below them or to their right, whichever keeps the canvas squarer."""
    offsets, h, w = [], 0, 0
    for latent in latents:
        rows, columns = latent.shape[-2:]
        h_offset = w_offset = 0
        if rows + h > columns + w:
            w_offset = w
        else:
            h_offset = h
        h, w = max(h, rows + h_offset), max(w, columns + w_offset)
        offsets.append(torch.tensor([1.0, (h_offset + 1) // 2, (w_offset + 1) // 2]))  # latent cells → tokens
    return offsets


def per_row(guidance: float | torch.Tensor, rows: int, device) -> torch.Tensor:
    """The guidance scale [rows] float32: one value for every row (the xDiT Sampler), or a value per row as
    ComfyUI's model call carries it (the xDiT MODEL: FluxGuidance may differ between cond and uncond)."""
    if torch.is_tensor(guidance):
        return guidance.to(device, torch.float32)
    return torch.full((rows,), guidance, device=device)


@contextmanager
def time_embedded_in_float32(time_text_embed, timestep: torch.Tensor, guidance: torch.Tensor | None):
    """For one forward of diffusers' Flux: its time (and guidance) embedding gets 1000·σ and
    1000·guidance computed in float32 from σ and guidance [B] (float32), as ComfyUI's Flux embeds
    them. diffusers' forward rounds σ to the weights' dtype and multiplies in it: in bf16, 1000·σ
    lands up to 4 off (σ's rounding, then the product's: spacing 4 near 1000), which turns the
    embedding's fastest frequencies by radians, and guidance 3.5 becomes 3504.
    (diffusers and BFL's reference code round; this backend takes ComfyUI's side, since it stands
    in for KSampler and its results are compared with KSampler's.)"""
    scaled = (timestep * 1000,) if guidance is None else (timestep * 1000, guidance * 1000)  # [B] float32 each

    def float32_times(module, args):  # diffusers passes (timestep, [guidance,] pooled) positionally
        return (*scaled, args[-1])

    handle = time_text_embed.register_forward_pre_hook(float32_times)
    try:
        yield
    finally:
        handle.remove()


class FluxProcessor:
    """The attention of Flux's modules (double- and single-stream blocks alike) with a pluggable core:
    the projections, QK norms and RoPE as diffusers' processor computes them, the attention itself
    ``core(q, k, v, text_tokens=L)`` on [B, S, H, D] laid out [text (L); image]."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("parallel Flux attention does not take an attention mask")
        # RoPE comes from the token ids the module is given, so it matches its tokens. q, k, v: [B, S, H, D], text first
        query, key, value = attention_inputs(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        text_tokens = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]  # single-stream: joint
        out = self.core(query, key, value, text_tokens=text_tokens).to(query.dtype)
        return attention_outputs(attn, out, encoder_hidden_states)


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on flux-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (0.1771, -0.02494, 0.04274)


@dataclass(frozen=True)
class FluxSpec(FamilySpec):
    """What a Flux model takes and allows, read from its config: enough to validate a request
    without building (or loading) the model."""

    context_dim: int
    pooled_dim: int
    heads: int
    blocks: int  # double-stream plus single-stream, as PipeFusion counts them
    has_guidance: bool
    concat: int = 0  # latent channels ComfyUI concatenates to the input: Fill 80 (image, 8×8 mask), Depth/Canny 16

    family = "flux"
    # comfy/ldm/flux/model.py Flux.forward(x, timestep, context, y, guidance, ref_latents, control, …); its default
    # reference placement, "offset" (Flux.1 Kontext)
    comfy_model_inputs = {"y": "pooled", "guidance": "guidance", "ref_latents": "references",
                          "ref_latents_method": "offset"}
    # InpaintModelConditioning (Fill) and InstructPixToPixConditioning (Depth, Canny): comfy_extras/nodes_*.py
    comfy_conditioning = {"concat_latent_image": "concat_latent_image", "concat_mask": "concat_mask"}
    takes_references = True
    latent_format = latent_formats.FLUX
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(
        cuts=(Cut("", "hidden_states", 1), Cut("", "img_ids", 0),  # [B, N, 64], [N, 3]
              Cut("", "encoder_hidden_states", 1, text=True), Cut("", "txt_ids", 0, text=True)),  # [B, L, C], [L, 3]
        attention=(("attn", FluxProcessor),))  # double- and single-stream blocks alike
    takes_controlnets = True  # InstantX's and Shakker-Labs' (models/flux_controlnet.py)
    # a ControlNet: the image, its hint and their positions cut as the model's, the text where the union's type
    # token has joined it; the model's attention; its residuals left split
    control_plan = SequencePlan(
        cuts=(Cut("", "hidden_states", 1), Cut("", "controlnet_cond", 1), Cut("", "img_ids", 0),  # [B, N, ·], [N, 3]
              Cut("control_text", None, 1, text=True)),  # [B, (1 +) L, D]
        attention=(("attn", FluxProcessor),), gather=None)
    stage_plan = StagePlan(block_lists=("transformer_blocks", "single_transformer_blocks"),
                           attention=(("attn", FluxProcessor, True),), joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks", "single_transformer_blocks"),
                           returns={"transformer_blocks": ("encoder_hidden_states", "hidden_states"),
                                    "single_transformer_blocks": ("encoder_hidden_states", "hidden_states")},
                           probe="temb", teacache=TEACACHE)

    @property
    def default_guidance(self) -> float | None:
        return FLUX_DEFAULT_GUIDANCE if self.has_guidance else None

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(FLUX_DEFAULT_SHIFT if shift is None else shift, flux=True)

    @classmethod
    def from_config(cls, config) -> FluxSpec:
        def get(key: str):
            return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

        packed_in = get("in_channels")
        packed_out = get("out_channels") or packed_in
        return cls(get("joint_attention_dim"), get("pooled_projection_dim"), get("num_attention_heads"),
                   get("num_layers") + get("num_single_layers"), bool(get("guidance_embeds")),
                   (packed_in - packed_out) // 4)

    @property
    def concat_channels(self) -> int:
        return self.concat

    @property
    def model_reads_noise_mask(self) -> bool:
        return self.concat > self.latent_format.channels  # Fill: Flux.concat_cond's mask, else the noise mask

    @property
    def optional_conditioning(self) -> tuple[str, ...]:
        if not self.concat:
            return ()
        return ("concat_latent_image", "concat_mask") if self.concat > self.latent_format.channels else (
            "concat_latent_image",)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """The tensors a request must carry for one side (positive or negative) of the guidance."""
        shapes = {"context": (batch, text_tokens, self.context_dim), "pooled": (batch, self.pooled_dim)}
        if self.concat:  # the image to inpaint or to follow (raw latent) and, for Fill, its pixel mask
            shapes["concat_latent_image"] = (batch, self.latent_format.channels, None, None)
        if self.concat > self.latent_format.channels:
            shapes["concat_mask"] = (batch, None, None, None)  # [B, 1, H, W], 1: to be made
        return shapes


class FluxModel(DiffusionModel):
    """A loaded Flux transformer (whole, or one PipeFusion stage of it)."""

    @property
    def has_guidance(self) -> bool:
        return self.spec.has_guidance

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for ``x`` [B, 16, h, w] at ``timestep`` [B] (σ: the embedding multiplies by 1000,
        as ComfyUI does). Reference latents [B, 16, h', w'] (raw VAE space; Flux.1 Kontext) join as more image
        tokens, placed as ComfyUI's default "offset" method places them, and only the noisy latent's come out."""
        b, _, h, w = x.shape
        timestep = timestep.to(self.device, torch.float32)  # [B]
        context = cond["context"].to(self.device, self.dtype)  # [B, L, context_dim]
        guidance = per_row(guidance, b, self.device) if self.has_guidance else None  # [B] float32
        reference_tokens, reference_ids = self._references(cond, b)
        tokens = [pack(self.with_concat(x, cond)), *(t.to(x.dtype) for t in reference_tokens)]  # [B, N, 64 (+ 4·E)]…
        ids = [image_ids(h, w, self.device), *reference_ids]  # [N, 3], [R_i, 3]…
        double, single = self._control_residuals(pack(x), context, cond, timestep, guidance, ids[0])
        with time_embedded_in_float32(self.transformer.time_text_embed, timestep, guidance):
            velocity = self.transformer(
                hidden_states=torch.cat(tokens, dim=1),  # [B, N (+ R), 64]
                encoder_hidden_states=context,
                pooled_projections=cond["pooled"].to(self.device, self.dtype),  # [B, pooled_dim]
                timestep=timestep,
                img_ids=torch.cat(ids),  # [N (+ R), 3]
                txt_ids=torch.zeros(context.shape[1], 3, device=self.device),  # [L, 3]
                guidance=guidance,
                controlnet_block_samples=double,  # one per block: diffusers adds block i's to its image tokens
                controlnet_single_block_samples=single,
                return_dict=False,
            )[0]
        return unpack(velocity[:, :h // 2 * (w // 2)], h, w)  # the noisy latent's [B, N, 64] → [B, 16, h, w]

    def _control_residuals(self, tokens, context, cond, timestep, guidance, ids) -> tuple[list | None, list | None]:
        """The residual of each double and each single block from the ControlNets active at this σ, summed in
        their order (ComfyUI's control_merge), or None. ``tokens`` [B, N, 64] the noisy latent's (a ControlNet sees
        no references nor a Fill model's concatenated channels), ``ids`` their positions [N, 3]."""
        active = [control for control in self.controlnets if control.active(float(timestep[0]))]
        if not active:
            return None, None
        from .flux_controlnet import model_residuals
        blocks = (len(self.transformer.transformer_blocks), len(self.transformer.single_transformer_blocks))
        sums: list[list | None] = [None, None]
        for control in active:
            samples = control.network(
                hidden_states=tokens, controlnet_cond=control.hint.expand(tokens.shape[0], -1, -1),
                encoder_hidden_states=context, pooled_projections=cond["pooled"].to(self.device, self.dtype),
                timestep=timestep, img_ids=ids, guidance=guidance, mode=control.mode)  # per block: [B, N, D]
            for which, (made, count) in enumerate(zip(samples, blocks)):
                if not made:
                    continue
                tiled = control.network.input_hint_block is not None  # XLabs' residuals repeat as a list
                adds = [add * control.strength for add in model_residuals(made, count, bool(which), tiled)]
                sums[which] = adds if sums[which] is None else [a + b for a, b in zip(sums[which], adds)]
        return sums[0], sums[1]

    def _references(self, cond: dict, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reference latents (Flux.1 Kontext) as packed tokens [batch, R_i, 64] (float32) and their ids [R_i, 3],
        placed as ComfyUI's default "offset" method places them."""
        tokens, ids = [], []
        placed = references(cond)
        for index, (reference, offset) in enumerate(zip(placed, kontext_offsets(placed))):
            latent = pad_to_patch(self.latent_format.process_in(reference.to(self.device).float()), self.spec.patch)
            tokens.append(pack(reference_rows(latent, batch, index)))  # [batch, 16, h', w'] → [batch, R_i, 64]
            ids.append(image_ids(*latent.shape[-2:], self.device) + offset.to(self.device))  # [R_i, 3]
        return tokens, ids

    def concat(self, shape, cond) -> torch.Tensor | None:
        """ComfyUI's Flux.concat_cond for a latent of ``shape`` [B, 16, h, w]: the image in model space resized to
        the latent (Depth / Canny: that alone), then (Fill) the pixel mask's mean over its channels, resized to
        8·h × 8·w and folded into 64 channels, one per pixel of a latent cell: [B, 16 (+ 64), h, w]."""
        if not self.spec.concat:
            return None
        b, _, h, w = shape
        image = cond.get("concat_latent_image")
        image = (self.latent_format.process_in(torch.zeros(shape, device=self.device)) if image is None
                 else self.image_in(image, h, w))
        if self.spec.concat <= self.latent_format.channels:
            return image
        mask = cond.get("concat_mask", cond.get("denoise_mask"))  # as Flux.concat_cond: the noise mask without one
        mask = (torch.ones(b, 1, h, w, device=self.device) if mask is None
                else mask.to(self.device, torch.float32).mean(dim=1, keepdim=True))
        mask = upscale(mask, 8 * h, 8 * w)  # [B, 1, 8h, 8w]
        mask = mask.view(b, h, 8, w, 8).permute(0, 2, 4, 1, 3).reshape(b, 64, h, w)  # pixel (r, c) → channel 8r + c
        return torch.cat([image, mask], dim=1)  # [B, 80, h, w]

    # PipeFusion stages (base.DiffusionModel): text travels with the step's first patch.

    def positions(self, shape):
        return image_ids(shape[-2], shape[-1], self.device)  # [N, 3]

    def stage_references(self, cond, positions):
        tokens, ids = self._references(cond, cond["context"].shape[0])
        if not tokens:
            return None, positions
        return torch.cat(tokens, dim=1).to(self.dtype), torch.cat([positions, *ids])  # [B, R, 64], [N + R, 3]

    def embed_references(self, tokens):
        return self.transformer.x_embedder(tokens)  # [B, R, 64] → [B, R, D]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time (and guidance) embedding, as diffusers' forward computes it but from float32
        1000·σ and 1000·guidance, as ComfyUI's (see ``time_embedded_in_float32``)."""
        t = self.transformer
        timestep = timestep.to(self.device, torch.float32) * 1000  # [B]
        pooled = cond["pooled"].to(self.device, self.dtype)  # [B, pooled_dim]
        if self.has_guidance:
            scale = per_row(guidance, timestep.shape[0], self.device) * 1000  # [B] float32
            temb = t.time_text_embed(timestep, scale, pooled)
        else:
            temb = t.time_text_embed(timestep, pooled)
        return {"temb": temb, "context": cond["context"]}  # temb [B, D]

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.x_embedder(pack(x))  # [B, C, rows, w] → [B, n, 64] → [B, n, D]

    def embed_text(self, inputs):
        return self.transformer.context_embedder(inputs["context"].to(self.device, self.dtype))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        ids = torch.cat([positions.new_zeros(text_tokens, 3), positions[tokens]])  # [L + n, 3]
        return {"temb": inputs["temb"], "image_rotary_emb": self.transformer.pos_embed(ids)}

    def run_block(self, block, image, text, kwargs):
        text, image = block(hidden_states=image, encoder_hidden_states=text, **kwargs)
        return image, text

    def head(self, image, inputs, tokens):
        return self.transformer.proj_out(self.transformer.norm_out(image, inputs["temb"]))  # [B, n, 64]

    def unpatchify(self, tokens, shape):
        return unpack(tokens, shape[-2], shape[-1])  # [B, n, 64] → [B, 16, rows, w]


def attention_inputs(attn, hidden_states, encoder_hidden_states=None, image_rotary_emb=None):
    """Q, K, V [B, S, H, D] of a diffusers Flux attention module, text first, RoPE applied, as
    diffusers' own processor builds them; for processors that replace only the attention itself."""
    from diffusers.models.embeddings import apply_rotary_emb

    query, key, value = (proj(hidden_states).unflatten(-1, (-1, attn.head_dim))  # [B, N, H, D]
                         for proj in (attn.to_q, attn.to_k, attn.to_v))
    query, key = attn.norm_q(query), attn.norm_k(key)
    if encoder_hidden_states is not None:  # double-stream block: text arrives separately
        text = [proj(encoder_hidden_states).unflatten(-1, (-1, attn.head_dim))  # [B, L, H, D]
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, (query, key, value)))
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    return query, key, value


def attention_outputs(attn, out, encoder_hidden_states=None):
    """The module's output projections on the attention result out [B, S, H, D]: what diffusers'
    processor returns (image, text) for a double-stream block, or the joint sequence for a single one."""
    out = out.flatten(2, 3)  # [B, S, H·D]
    if encoder_hidden_states is None:
        return out
    text_tokens = encoder_hidden_states.shape[1]
    image_out = attn.to_out[1](attn.to_out[0](out[:, text_tokens:].contiguous()))
    return image_out, attn.to_add_out(out[:, :text_tokens].contiguous())
