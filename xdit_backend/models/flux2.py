"""Flux.2 (dev, klein): diffusers ``Flux2Transformer2DModel`` fed the way ComfyUI feeds its Flux.2.

Joint text+image attention (MM-DiT: double-stream blocks, then single-stream ones whose attention
and MLP share their projections), 4-D RoPE over (index, row, column, text position). The latent is
ComfyUI's: 128 channels at 1/16 of the pixels (the VAE's 32 channels already in 2×2 patches), one
token per latent cell. Reference images (editing) are more tokens after the image's, at RoPE index
10, 20, …; the output keeps the image's. Sequence parallelism cuts the image (and reference) tokens
with their positions, and the text tokens with theirs, as diffusers' ``_cp_plan`` for Flux.2 does,
and gathers after ``proj_out``.

ComfyUI facts used here (Comfy-Org/ComfyUI): comfy/supported_models.py ``Flux2`` (shift 2.02,
ModelSamplingFlux), comfy/model_base.py ``Flux2`` (text padded to 512 tokens, zeros in front; the
guidance default 3.5 and ``ref_latents`` through ``process_latent_in`` from ``Flux``),
comfy/model_detection.py (flux2: RoPE axes (32, 32, 32, 32), theta 2000, text positions on axis 3,
``default_ref_method`` "index", ``ref_index_scale`` 10), comfy/ldm/flux/model.py ``_forward`` and
``process_img`` (image ids (index, row, column, 0), references appended, ``out[:, :img_tokens]``).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan, references

FLUX2_DEFAULT_SHIFT = 2.02  # comfy/supported_models.py, Flux2.sampling_settings
FLUX2_DEFAULT_GUIDANCE = 3.5  # comfy/model_base.py, Flux.extra_conds: kwargs.get("guidance", 3.5)
# comfy/model_base.py, Flux2.extra_conds: target_text_len, zeros in front of a shorter cross_attn. dev's text is
# shorter (comfy/text_encoders/flux.py Mistral3Tokenizer: min_length 1, the prompt's own length); klein's is
# already 512 (Qwen3Tokenizer / Qwen3Tokenizer8B: min_length 512, pad tokens encoded). comfy/ldm/flux/model.py
# takes the context as it comes (txt_ids over context.shape[1]).
MIN_TEXT_TOKENS = 512
REFERENCE_INDEX_SCALE = 10.0  # comfy/model_detection.py, flux2: ref_index_scale


def pack(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, h·w, C]: one token per latent cell, row-major (patch size 1)."""
    return latent.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h·w, C] → [B, C, h, w], the inverse of ``pack``."""
    return tokens.transpose(1, 2).unflatten(2, (h, w))


def image_ids(h: int, w: int, index: float = 0.0, device: torch.device | None = None) -> torch.Tensor:
    """[h·w, 4] positions (index, row, column, 0) of a latent's tokens, as ComfyUI's process_img builds them."""
    rows = torch.arange(h, device=device, dtype=torch.float32).view(-1, 1).expand(h, w)
    cols = torch.arange(w, device=device, dtype=torch.float32).view(1, -1).expand(h, w)
    return torch.stack([torch.full_like(rows, index), rows, cols, torch.zeros_like(rows)], dim=-1).reshape(-1, 4)


def text_ids(length: int, device: torch.device | None = None) -> torch.Tensor:
    """[L, 4] positions (0, 0, 0, l) of the text tokens (ComfyUI's txt_ids_dims [3])."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def pad_text(context: torch.Tensor) -> torch.Tensor:
    """[B, L, C] → [B, max(L, 512), C]: zeros in front of a shorter text, as ComfyUI's Flux2.extra_conds
    (Flux2Spec.prepare_conditioning: once per generation, for every layout)."""
    missing = MIN_TEXT_TOKENS - context.shape[1]
    return torch.nn.functional.pad(context, (0, 0, missing, 0)) if missing > 0 else context


def to_batch(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    """Repeat or cut ``tensor`` [b, ...] to ``batch`` rows, as ComfyUI's repeat_to_batch_size."""
    if tensor.shape[0] == batch:
        return tensor
    return tensor.repeat(math.ceil(batch / tensor.shape[0]), *(1,) * (tensor.dim() - 1))[:batch]


def time_embedding(embed, sigma: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """ComfyUI's time (and guidance) embedding [B, D]: the sinusoids of 1000·σ and 1000·guidance (σ and
    guidance [B] float32) computed in float32, then cast to ``dtype`` for the MLPs. diffusers' forward
    rounds σ to the weights' dtype first (in bf16, 1000·σ lands up to 4 off)."""
    temb = embed.timestep_embedder(embed.time_proj(sigma * 1000).to(dtype))
    if embed.guidance_embedder is not None and guidance is not None:
        temb = temb + embed.guidance_embedder(embed.time_proj(guidance * 1000).to(dtype))
    return temb


@contextmanager
def time_embedded_in_float32(embed, sigma: torch.Tensor, guidance: torch.Tensor | None, dtype: torch.dtype):
    """For one forward of diffusers' Flux.2: its time embedding module computes ``time_embedding`` from the
    float32 σ and guidance instead of the rounded values the forward passes it (an instance ``forward``,
    removed after)."""
    embed.forward = lambda *rounded: time_embedding(embed, sigma, guidance, dtype)
    try:
        yield
    finally:
        del embed.forward


class Flux2Processor:
    """The attention of Flux.2's modules (``Flux2Attention`` in double-stream blocks,
    ``Flux2ParallelSelfAttention`` in single-stream ones) with a pluggable core: the projections,
    QK norms and RoPE as diffusers' processors compute them, the attention itself
    ``core(q, k, v, text_tokens=L)`` on [B, S, H, D] laid out [text (L); image]."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, *args, **kwargs):
        # diffusers calls (attn, hidden_states, encoder_hidden_states, mask, rope) for Flux2Attention and
        # (attn, hidden_states, mask, rope) for Flux2ParallelSelfAttention
        if hasattr(attn, "to_qkv_mlp_proj"):
            return self._single(attn, hidden_states, *args, **kwargs)
        return self._double(attn, hidden_states, *args, **kwargs)

    def _double(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("Flux2Processor does not take an attention mask")
        heads = _heads(attn)
        query = attn.norm_q(heads(attn.to_q(hidden_states)))  # [B, N, H, D]
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        text = encoder_hidden_states.shape[1]
        text_query = attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states)))  # [B, L, H, D]
        text_key = attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states)))
        text_value = heads(attn.add_v_proj(encoder_hidden_states))
        query, key, value = (torch.cat(pair, dim=1) for pair in  # [B, L + N, H, D]
                             ((text_query, query), (text_key, key), (text_value, value)))
        query, key = _rotate(query, key, image_rotary_emb)
        out = self.core(query, key, value, text_tokens=text).flatten(2, 3).to(query.dtype)  # [B, L + N, H·D]
        text_out, image_out = out[:, :text], out[:, text:]
        return attn.to_out[1](attn.to_out[0](image_out.contiguous())), attn.to_add_out(text_out.contiguous())

    def _single(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("Flux2Processor does not take an attention mask")
        projected = attn.to_qkv_mlp_proj(hidden_states)  # [B, L + N, 3·H·D + 2·M]
        qkv, mlp = projected.split([3 * attn.inner_dim, projected.shape[-1] - 3 * attn.inner_dim], dim=-1)
        heads = _heads(attn)
        query, key, value = (heads(part) for part in qkv.chunk(3, dim=-1))  # [B, L + N, H, D] each
        query, key = _rotate(attn.norm_q(query), attn.norm_k(key), image_rotary_emb)
        # [text share; image share] joined, no text length: the cores know it (USPAttention from its cut,
        # StaleKV from its chunk), so 0 says "whatever the joint sequence holds"
        out = self.core(query, key, value, text_tokens=0)
        out = out.flatten(2, 3).to(query.dtype)  # [B, L + N, H·D]
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


def _heads(attn):
    return lambda t: t.unflatten(-1, (-1, attn.head_dim))  # [B, S, H·D] → [B, S, H, D]


def _rotate(query, key, rope):
    if rope is None:
        return query, key
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(query, rope, sequence_dim=1), apply_rotary_emb(key, rope, sequence_dim=1)


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on flux2-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.04993, 0.1406, -0.01897)


@dataclass(frozen=True)
class Flux2Spec(FamilySpec):
    """What a Flux.2 model takes and allows, read from its config."""

    context_dim: int  # the text features: 15360 (dev, Mistral), 7680 (klein 4B, Qwen3-4B), 12288 (klein 9B)
    heads: int
    blocks: int  # double-stream plus single-stream, as PipeFusion counts them
    has_guidance: bool  # dev: a guidance embedding (FluxGuidance); klein: none

    family = "flux2"
    latent_format = latent_formats.FLUX2
    vae_factor = 16  # comfy/latent_formats.py Flux2.spacial_downscale_ratio
    patch = (1, 1, 1)  # one token per latent cell: the 2×2 patches are in the latent's 128 channels
    takes_references = True
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(
        cuts=(Cut("", "hidden_states", 1), Cut("", "img_ids", 0),  # [B, N + R, 128], [N + R, 4]
              Cut("", "encoder_hidden_states", 1, text=True), Cut("", "txt_ids", 0, text=True)),  # [B, L, C], [L, 4]
        attention=(("attn", Flux2Processor),))  # double- and single-stream blocks alike
    stage_plan = StagePlan(block_lists=("transformer_blocks", "single_transformer_blocks"),
                           attention=(("attn", Flux2Processor, True),), joint_text=True)
    cache_plan = CachePlan(blocks=("single_transformer_blocks",),
                           returns={"single_transformer_blocks": ("hidden_states",)},
                           probe="temb_mod", teacache=TEACACHE)

    @property
    def default_guidance(self) -> float | None:
        return FLUX2_DEFAULT_GUIDANCE if self.has_guidance else None

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(FLUX2_DEFAULT_SHIFT if shift is None else shift, flux=True)

    @classmethod
    def from_config(cls, config) -> Flux2Spec:
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
        return cls(get("joint_attention_dim"), get("num_attention_heads"),
                   get("num_layers") + get("num_single_layers"), bool(get("guidance_embeds")))

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}

    def prepare_conditioning(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The text padded to 512 tokens, zeros in front, as ComfyUI's Flux2.extra_conds pads it before
        the model (and so before PipeFusion sizes its K/V buffers and ulysses/ring cut the text)."""
        return {**cond, "context": pad_text(cond["context"])}


class Flux2Model(DiffusionModel):
    """A loaded Flux.2 transformer (whole, or one PipeFusion stage of it)."""

    def _guidance(self, batch: int, guidance: float | None) -> torch.Tensor | None:
        return torch.full((batch,), guidance, device=self.device) if self.spec.has_guidance else None  # [B] float32

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 128, h, w] at timestep σ [B], with the references in ``cond`` as more tokens."""
        b, _, h, w = x.shape
        sigma = timestep.to(self.device, torch.float32)  # [B]
        context = cond["context"].to(self.device, self.dtype)  # [B, L ≥ 512, C]: Flux2Spec.prepare_conditioning
        reference_tokens, reference_ids = self._references(cond, b)
        tokens = [pack(x), *reference_tokens]  # [B, h·w, 128], [B, h_r·w_r, 128]…
        ids = [image_ids(h, w, device=self.device), *reference_ids]  # [h·w, 4], [h_r·w_r, 4]…
        scale = self._guidance(b, guidance)
        with time_embedded_in_float32(self.transformer.time_guidance_embed, sigma, scale, self.dtype):
            velocity = self.transformer(
                hidden_states=torch.cat(tokens, dim=1),  # [B, N + R, 128]
                encoder_hidden_states=context,
                timestep=sigma,
                img_ids=torch.cat(ids),  # [N + R, 4]
                txt_ids=text_ids(context.shape[1], self.device),  # [L, 4]
                guidance=scale,
                return_dict=False,
            )[0]
        return unpack(velocity[:, :h * w], h, w)  # the image's tokens [B, N, 128] → [B, 128, h, w]

    def _references(self, cond: dict, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reference latents as packed tokens [batch, h_r·w_r, 128] and their ids [h_r·w_r, 4] (time index 10,
        20, …)."""
        tokens, ids = [], []
        for number, reference in enumerate(references(cond), start=1):
            reference = self.latent_format.process_in(to_batch(reference, batch).to(self.device, torch.float32))
            tokens.append(pack(reference.to(self.dtype)))  # [batch, 128, h_r, w_r] → [batch, h_r·w_r, 128]
            ids.append(image_ids(*reference.shape[-2:], index=number * REFERENCE_INDEX_SCALE, device=self.device))
        return tokens, ids

    # PipeFusion stages (base.DiffusionModel): text (and references) travel with the step's first patch.

    def positions(self, shape):
        return image_ids(shape[-2], shape[-1], device=self.device)  # [N, 4]

    def stage_references(self, cond, positions):
        tokens, ids = self._references(cond, cond["context"].shape[0])
        if not tokens:
            return None, positions
        return torch.cat(tokens, dim=1), torch.cat([positions, *ids])  # [B, R, 128], [N + R, 4]

    def embed_references(self, tokens):
        return self.transformer.x_embedder(tokens)  # [B, R, 128] → [B, R, D]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time embedding and the three shared modulations, once per step."""
        t = self.transformer
        sigma = timestep.to(self.device, torch.float32)  # [B]
        temb = time_embedding(t.time_guidance_embed, sigma, self._guidance(sigma.shape[0], guidance), self.dtype)
        return {"temb": temb, "image_mod": t.double_stream_modulation_img(temb),  # [B, D], [B, 6·D]
                "text_mod": t.double_stream_modulation_txt(temb), "single_mod": t.single_stream_modulation(temb),
                "context": cond["context"]}

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.x_embedder(pack(x))  # [B, 128, rows, w] → [B, n, 128] → [B, n, D]

    def embed_text(self, inputs):
        return self.transformer.context_embedder(inputs["context"].to(self.device, self.dtype))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        ids = torch.cat([text_ids(text_tokens, self.device), positions[tokens]])  # [L + n, 4]
        return {**inputs, "rope": self.transformer.pos_embed(ids)}

    def run_block(self, block, image, text, kwargs):
        if hasattr(block, "ff_context"):  # double-stream
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod_img=kwargs["image_mod"],
                                temb_mod_txt=kwargs["text_mod"], image_rotary_emb=kwargs["rope"])
            return image, text
        text, image = block(hidden_states=image, encoder_hidden_states=text, temb_mod=kwargs["single_mod"],
                            image_rotary_emb=kwargs["rope"], split_hidden_states=True)
        return image, text

    def head(self, image, inputs, tokens):
        return self.transformer.proj_out(self.transformer.norm_out(image, inputs["temb"]))  # [B, n, 128]

    def unpatchify(self, tokens, shape):
        return unpack(tokens, shape[-2], shape[-1])  # [B, n, 128] → [B, 128, rows, w]
