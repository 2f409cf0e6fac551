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
from . import latent_formats
from .base import Cut, DiffusionModel, FamilySpec, SequencePlan


@dataclass(frozen=True)
class PixArtSpec(FamilySpec):
    context_dim: int  # T5-XXL (4096)
    heads: int
    blocks: int
    channels: int  # latent channels (4)
    size_conditioning: bool  # resolution and aspect-ratio embeddings (PixArt-α at 1024)
    sigma: bool  # PixArt-Σ (SDXL's VAE); PixArt-α uses SD 1.5's

    family = "pixart"
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    optional_conditioning = ("context_mask",)  # [B, L] 1 for a real text token, 0 for padding
    takes_shift = False  # discrete EPS noise levels: no flow shift
    sequence_plan = SequencePlan(cuts=(Cut("pos_embed", None, 1),),  # [B, N, C], positions already added
                                 attention=(("attn1", "joint"),))

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
        added = {"resolution": None, "aspect_ratio": None}
        if self.spec.size_conditioning:  # pixels, as diffusers' pipeline and ComfyUI's c_size give them
            added = {"resolution": torch.tensor([[h * 8.0, w * 8.0]] * b, device=self.device, dtype=self.dtype),
                     "aspect_ratio": torch.tensor([[h / w]] * b, device=self.device, dtype=self.dtype)}
        mask = cond.get("context_mask")
        out = self.transformer(
            hidden_states=x,
            encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
            timestep=timestep.to(self.device),
            added_cond_kwargs=added,
            encoder_attention_mask=None if mask is None else mask.to(self.device),  # [B, L]
            return_dict=False,
        )[0]  # [B, 2·C, h, w]: ε, then the learned variance
        return out[:, :c]
