"""Wan 2.1 / 2.2 (text to video): diffusers ``WanTransformer3DModel`` fed as ComfyUI feeds Wan.

Video latents [B, C, T, h, w] in (1, 2, 2) patches; self-attention over frames × rows × columns
tokens with 3-D RoPE, cross-attention to the UMT5 text. Sequence parallelism cuts the tokens
before the first block and the RoPE table alongside them, and gathers after ``proj_out``;
cross-attention needs nothing (its keys are the whole text). Model sampling: discrete flow,
shift 8. Wan 2.2-A14B is two such models (high- and low-noise experts), run as two requests
over step ranges; Wan 2.2-TI2V-5B has a 48-channel latent from a 16× VAE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import Cut, DiffusionModel, FamilySpec, SequencePlan

WAN_DEFAULT_SHIFT = 8.0  # ComfyUI's WAN21_T2V sampling_settings (WAN22_T2V inherits it)


@dataclass(frozen=True)
class WanSpec(FamilySpec):
    context_dim: int  # UMT5 (4096)
    heads: int
    blocks: int
    channels: int  # 16 (Wan 2.1, Wan 2.2-A14B) or 48 (Wan 2.2-TI2V-5B)

    family = "wan"
    video = True
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    sequence_plan = SequencePlan(cuts=(Cut("rope", None, 1),  # (cos, sin) [1, N, 1, D] each
                                       Cut("blocks.0", 0, 1)),  # the patch tokens [B, N, D]
                                 attention=(("attn1", "wan"),))

    @property
    def latent_format(self):
        return latent_formats.WAN22 if self.channels == 48 else latent_formats.WAN21

    @property
    def vae_factor(self) -> int:
        return 16 if self.channels == 48 else 8

    @classmethod
    def from_config(cls, config: dict) -> WanSpec:
        return cls(config["text_dim"], config["num_attention_heads"], config["num_layers"], config["in_channels"])

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(WAN_DEFAULT_SHIFT if shift is None else shift)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}


class WanModel(DiffusionModel):
    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, C, T, h, w] at timestep 1000·σ [B]."""
        return self.transformer(
            hidden_states=x,
            timestep=timestep.to(self.device, self.dtype),
            encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
            return_dict=False,
        )[0]
