"""PixArt-α / PixArt-Σ: diffusers ``PixArtTransformer2DModel`` fed as ComfyUI feeds PixArt.

Self-attention over the image tokens and cross-attention to the T5 text (with its mask),
absolute 2-D position embeddings added by the patch embedding, size conditioning (α at 1024).
Sequence parallelism cuts the tokens after ``pos_embed`` and gathers after ``proj_out``; only
self-attention communicates. Model sampling: EPS over 1000 discrete "sqrt_linear" betas; the
model also predicts a variance (learned sigma), of which ComfyUI, like diffusers, takes ε only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.model_sampling import EpsSampling
from . import latent_formats, patch_embed
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan
from .joint_attention import JointAttentionProcessor

# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on pixart-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.5457, 0.7827, -0.08738)


@dataclass(frozen=True)
class PixArtSpec(FamilySpec):
    context_dim: int  # T5-XXL (4096)
    heads: int
    blocks: int
    channels: int  # latent channels (4)
    size_conditioning: bool  # resolution and aspect-ratio embeddings (PixArt-α at 1024)
    sigma: bool  # PixArt-Σ (SDXL's VAE); PixArt-α uses SD 1.5's

    family = "pixart"
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    optional_conditioning = ("context_mask",)  # [B, L] 1 for a real text token, 0 for padding
    takes_shift = False  # discrete EPS noise levels: no flow shift
    sequence_plan = SequencePlan(cuts=(Cut("pos_embed", None, 1),),  # [B, N, C], positions already added
                                 attention=(("attn1", JointAttentionProcessor),))
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=(("attn1", JointAttentionProcessor, False),))
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("hidden_states",)},
                           probe="timestep", teacache=TEACACHE)

    @property
    def latent_format(self):
        return latent_formats.SDXL if self.sigma else latent_formats.SD15

    @classmethod
    def from_config(cls, config: dict) -> PixArtSpec:
        """α or Σ from a diffusers config: Σ's configs set ``interpolation_scale``, α's leave it to
        diffusers (pixart_checkpoint.py reads the same from a file's text-length table)."""
        size = config.get("use_additional_conditions")
        if size is None:  # diffusers' own rule: only the 1024 model (sample size 128) takes it
            size = config.get("sample_size", 128) == 128
        return cls(config["caption_channels"], config["num_attention_heads"], config["num_layers"],
                   config.get("in_channels", 4), bool(size), config.get("interpolation_scale") is not None)

    def model_sampling(self, shift: float | None) -> EpsSampling:
        return EpsSampling()

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}


class PixArtModel(DiffusionModel):
    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """ε for x [B, 4, h, w] (already scaled by 1/√(σ²+1)) at the discrete timestep [B]."""
        b, c, h, w = x.shape
        mask = cond.get("context_mask")
        out = self.transformer(
            hidden_states=x,
            encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
            timestep=timestep.to(self.device),
            added_cond_kwargs=self._size_conditioning(b, h, w),
            encoder_attention_mask=None if mask is None else mask.to(self.device),  # [B, L]
            return_dict=False,
        )[0]  # [B, 2·C, h, w]: ε, then the learned variance
        return out[:, :c]

    def _size_conditioning(self, b: int, h: int, w: int) -> dict:
        """PixArt-α's resolution and aspect-ratio inputs for a [b, C, h, w] latent (None for Σ)."""
        if not self.spec.size_conditioning:
            return {"resolution": None, "aspect_ratio": None}

        def column(value: float) -> torch.Tensor:  # [B, 1], filled on the device (no host→device copy)
            return torch.full((b, 1), value, device=self.device, dtype=self.dtype)

        # pixels, as diffusers' pipeline and ComfyUI's c_size give them
        return {"resolution": torch.cat([column(h * 8.0), column(w * 8.0)], dim=1),  # [B, 2]
                "aspect_ratio": column(h / w)}

    # PipeFusion stages (base.DiffusionModel): every stage embeds the time and projects the text
    # itself (cross-attention only reads it); the size conditioning is the whole latent's.

    def positions(self, shape):
        return patch_embed.table(self.transformer.pos_embed, shape[-2], shape[-1])  # [1, N, D]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """As diffusers' forward prepares them: adaLN-single time embedding, projected text, text mask."""
        t, b = self.transformer, cond["context"].shape[0]
        time, embedded = t.adaln_single(timestep.to(self.device), self._size_conditioning(b, shape[-2], shape[-1]),
                                        batch_size=b, hidden_dtype=self.dtype)  # [B, 6·D], [B, D]
        context = t.caption_projection(cond["context"].to(self.device, self.dtype)).view(b, -1, t.inner_dim)
        mask = cond.get("context_mask")
        if mask is not None:  # [B, L] → additive bias [B, 1, L]
            mask = ((1 - mask.to(self.device).to(self.dtype)) * -10000.0).unsqueeze(1)
        return {"timestep": time, "embedded": embedded, "context": context, "mask": mask}

    def embed(self, x, tokens, inputs, positions):
        return patch_embed.embed_rows(self.transformer.pos_embed, x, tokens, positions)  # [B, n, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        return {"attention_mask": None, "encoder_hidden_states": inputs["context"],
                "encoder_attention_mask": inputs["mask"], "timestep": inputs["timestep"],
                "cross_attention_kwargs": None, "class_labels": None}

    def run_block(self, block, image, text, kwargs):
        return block(image, **kwargs), text

    def head(self, image, inputs, tokens):
        t = self.transformer
        shift, scale = (t.scale_shift_table[None] + inputs["embedded"][:, None]).chunk(2, dim=1)  # [B, 1, D] each
        return t.proj_out(t.norm_out(image) * (1 + scale) + shift)  # [B, n, p·p·2C]

    def unpatchify(self, tokens, shape):
        """As diffusers' forward ends, for a band of rows; ε only (the learned variance dropped)."""
        p, out = self.transformer.config.patch_size, self.transformer.out_channels
        rows, columns = shape[-2] // p, shape[-1] // p
        patches = tokens.reshape(-1, rows, columns, p, p, out)  # [B, rows, columns, p, p, 2C]
        latent = torch.einsum("nhwpqc->nchpwq", patches).reshape(-1, out, rows * p, columns * p)
        return latent[:, :shape[1]]
