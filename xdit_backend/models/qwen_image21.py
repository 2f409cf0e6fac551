"""Qwen-Image 2.1: diffusers ``QwenImage21Transformer2DModel`` run the way ComfyUI runs it (Comfy-Org/ComfyUI
comfy/ldm/qwen_image21/model.py 08f68f09 ``QwenImage21Transformer2DModel``).

One stream of single blocks over [text | target image]: the text (Qwen3-VL's states through ``txt_in``) is a prefix
the image follows. Attention is block-causal: a text token sees the tokens up to itself, an image token sees the
whole prefix and its own image. The prefix is modulated at t = 0 (the shared modulation at [t; 0]: its last row), so
it depends on neither the latent nor the step: its keys and values in every block are computed once per prompt
(ComfyUI's prefix cache does the same) and each step runs the image's tokens alone, attending over [prefix; image].

Sequence parallelism therefore cuts the image's tokens only (and their positions); the prefix's keys and values are
whole on every rank (``USPAttention``'s ``prefix``: each rank's Ulysses heads of them, joined to its own K/V block),
and the output is gathered after ``proj_out``. The latent is ComfyUI's [B, 64, H/16, W/16] (no patches: a token per
latent cell). PipeFusion and the step cache are refused (each says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan

ROPE_THETA = 10000  # model.py's EmbedND
DEFAULT_SHIFT = 0.69  # supported_models.QwenImage21 sampling_settings (01f03bbd): ModelSamplingFlux, multiplier 1
PREFIX_CACHE = 2  # prompts whose prefix keys and values a generation keeps (its positive and negative)


def rope_angles(positions: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """Each token's rotation [S, D/2] (complex64) for its (frame, row, column) ``positions`` [S, 3]: per axis the
    position times 1/θ^(2k/d), in float64 as ComfyUI's flux rope computes it."""
    parts = []
    for axis, dim in enumerate(axes):
        omega = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [d/2]
        parts.append(positions[:, axis:axis + 1].double() * omega)  # [S, d/2]
    angle = torch.cat(parts, dim=1)
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


def sequence_positions(text: int, rows: int, columns: int) -> torch.Tensor:
    """(frame, row, column) of every token [L + N, 3] (model.py build_sequence): text token i at (i, i, i); the image
    at frame L, its rows and columns centred on zero."""
    index = torch.arange(text, dtype=torch.float64)
    r = torch.arange(rows, dtype=torch.float64) - (rows - rows // 2)
    c = torch.arange(columns, dtype=torch.float64) - (columns - columns // 2)
    grid_r, grid_c = torch.meshgrid(r, c, indexing="ij")
    image = torch.stack([torch.full_like(grid_r, text), grid_r, grid_c], dim=-1).reshape(-1, 3)
    return torch.cat([index[:, None].expand(text, 3), image])


class PrefixCache:
    """One prompt's prefix keys and values, one (k, v) [B, L, H, D] per block, filled by the prefix pass."""

    def __init__(self, context: torch.Tensor):
        self.context = context
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []


class PrefixedAttention:
    """The blocks' attention (a diffusers processor for their ``attn`` modules). In the prefix pass (``prefix`` a
    list being filled) the text's tokens attend causally among themselves, whole on every rank, and their keys and
    values are kept; in a step (``prefix`` the block's kept pair) the image's tokens attend over [prefix; image]
    through ``core(q, k, v, prefix=(k, v))`` (USPAttention, or one device's attention)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, rotary_emb=None, layer_cache=None, **unused):
        """``layer_cache``: the block's prefix (the diffusers block passes it through by that name)."""
        from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

        head_dim = attn.inner_dim // attn.heads
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q).to(v.dtype), attn.norm_k(k).to(v.dtype)  # [B, n, H, D] each
        q = apply_rotary_emb_qwen(q, rotary_emb, use_real=False)
        k = apply_rotary_emb_qwen(k, rotary_emb, use_real=False)
        prefix = layer_cache
        if isinstance(prefix, list):  # the prefix pass: causal over the text, kept for the steps
            prefix.append((k, v))
            causal = torch.ones(q.shape[1], q.shape[1], dtype=torch.bool, device=q.device).tril()
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal).transpose(1, 2)
        else:
            out = self.core(q, k, v, prefix=prefix)  # [B, n, H, D]
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def local_attention(q, k, v, prefix=None):
    """One device's attention of q over [prefix; k, v] ([B, S, H, D] each)."""
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], dim=1), torch.cat([prefix[1], v], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def build_transformer(fused_mlp: bool = True, **config):
    """diffusers' Qwen-Image 2.1 transformer (``fused_mlp`` says only how the file stores the feed-forward)."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(**config)


@dataclass(frozen=True)
class QwenImage21Spec(FamilySpec):
    """What a Qwen-Image 2.1 model takes and allows, read from its config."""

    context_dim: int  # Qwen3-VL's 4096
    heads: int
    blocks: int

    family = "qwen_image21"
    latent_format = latent_formats.QWEN_IMAGE21
    vae_factor = 16
    patch = (1, 1, 1)  # a token per latent cell
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    method_refusals: ClassVar[dict[str, str]] = {
        "pipefusion": "its image attends over a text prefix whose keys each stage would have to compute and keep for "
                      "its own blocks, which is not built; use ulysses or ring, or cfg"}
    step_cache_refusal: ClassVar[str] = "its blocks run from its own loop over the image's tokens, not cached yet"
    sequence_plan = SequencePlan(
        cuts=(Cut("image_tokens", None, 1), Cut("image_rope", None, 0)),  # [B, N, D], [N, D/2]
        attention=(("attn", PrefixedAttention),))
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=())
    cache_plan = CachePlan(blocks=("transformer_blocks",), returns={"transformer_blocks": ("hidden_states",)},
                           probe="modulation", teacache=(1.0, 0.0))  # refused (step_cache_refusal)

    @classmethod
    def from_config(cls, config) -> QwenImage21Spec:
        def get(key: str):
            return config.get(key) if isinstance(config, dict) else getattr(config, key)

        return cls(get("context_in_dim"), get("num_attention_heads"), get("num_layers"))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """ComfyUI's model sampling for Qwen-Image 2.1: ModelSamplingFlux at shift 0.69 (model_base 094c74c1:
        ModelType.FLUX), timestep = σ."""
        return FlowSampling(DEFAULT_SHIFT if shift is None else shift, flux=True)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """Qwen3-VL's hidden states as ComfyUI's Qwen-Image 2.1 text encoder gives them (no padding)."""
        return {"context": (batch, text_tokens, self.context_dim)}

    def split_text_tokens(self, cond: dict) -> int:
        return 0  # the prefix is whole on every rank


class QwenImage21Model(DiffusionModel):
    """A loaded Qwen-Image 2.1 transformer."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # where sequence parallelism cuts the image's tokens and their rotations (the sequence plan)
        for name in ("image_tokens", "image_rope"):
            setattr(transformer, name, torch.nn.Identity())
        for block in transformer.transformer_blocks:
            block.attn.set_processor(PrefixedAttention(local_attention))  # sequence parallelism swaps the core
        self._generation = None  # the running generation: prefixes are kept within it only (a LoRA may change)
        self._prefixes: list[PrefixCache] = []

    def predict_x0(self, x, sigma, cond, gen):
        if gen is not self._generation:
            self._generation, self._prefixes = gen, []
        return super().predict_x0(x, sigma, cond, gen)

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 64, h, w] at σ = ``timestep`` [B], as ComfyUI's Qwen-Image 2.1 computes it."""
        t = self.transformer
        b, channels, h, w = x.shape
        context = cond["context"]
        sigma = ((timestep.to(self.device) * 1000).to(self.dtype) / 1000).to(self.dtype)  # model.py's rounding
        dtype_of = sigma.new_empty(0)  # the embedding's input dtype: the compute dtype
        temb = t.time_text_embed(torch.cat([sigma, sigma.new_zeros(1)]), dtype_of)  # [B + 1, D]: [t; 0]
        modulation = t.modulation(temb)  # [B + 1, 4·D]: scale1, gate1, scale2, gate2 of each row
        positions = sequence_positions(context.shape[1], h, w).to(self.device)
        text_rope = rope_angles(positions[:context.shape[1]], self._axes)  # [L, D/2]
        prefix = self._prefix(context, modulation[-1:].expand(b, -1), text_rope)
        tokens = x.flatten(2).transpose(1, 2).to(self.device, self.dtype)  # [B, N, 64]
        image = t.image_tokens(t.img_in(tokens))  # [B, n, D]: this rank's tokens
        rope = t.image_rope(rope_angles(positions[context.shape[1]:], self._axes).to(self.device))  # [n, D/2]
        for block, kept in zip(t.transformer_blocks, prefix.blocks):
            image = block(hidden_states=image, modulation=modulation[:-1], rotary_emb=rope, layer_cache=kept)
        out = t.proj_out(t.norm_out(image, temb[:-1]))  # [B, N, 64]: gathered under sequence parallelism
        return out.transpose(1, 2).reshape(b, channels, h, w)

    @property
    def _axes(self) -> tuple[int, ...]:
        return tuple(self.transformer.config.axes_dims_rope)

    def _prefix(self, context: torch.Tensor, zero_modulation: torch.Tensor, rope: torch.Tensor) -> PrefixCache:
        """The prompt's prefix keys and values in every block, computed once per prompt in a generation (the text at
        t = 0, whole on every rank, causal)."""
        for kept in self._prefixes:
            if kept.context.shape == context.shape and torch.equal(kept.context, context):
                return kept
        if not torch.isfinite(context).all():
            raise UserError("the prompt's conditioning holds NaN or infinite values",
                            "re-encode the prompt (CLIP Text Encode) with the Qwen-Image 2.1 text encoder")
        t = self.transformer
        kept = PrefixCache(context)
        text = t.txt_in(context.to(self.device, self.dtype))  # [B, L, D]
        for block in t.transformer_blocks:
            text = block(hidden_states=text, modulation=zero_modulation, rotary_emb=rope.to(self.device),
                         layer_cache=kept.blocks)
        self._prefixes = [kept, *self._prefixes][:PREFIX_CACHE]
        return kept
