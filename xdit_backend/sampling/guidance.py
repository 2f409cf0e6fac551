"""LTX-2's guidance beyond CFG, as ComfyUI's LTXV nodes add it (Comfy-Org/ComfyUI comfy_extras/nodes_lt.py 8258cfe4):

- LTXVDualCFGGuider: the audio part guided at its own scale, u + (c − u)·audio_cfg, the video at cfg (the uncond pass
  runs whenever the two differ, even at cfg 1);
- LTXVSpatioTemporalGuidance (STG): one more pass of the positive prompt with the self-attention of the listed blocks
  a value passthrough, and x0 + (cond − perturbed)·scale, where σ_end ≤ σ ≤ σ_start;
- LTXVModalityGuidance: one more pass of the positive prompt with the audio↔video cross-attention cut, and
  x0 + (cond − isolated)·(scale − 1), in its own σ range.

Each step then takes up to four passes (cond, uncond, perturbed, isolated); the Denoiser spreads them over the CFG
ranks and this module combines them, in x0 space as ComfyUI's post-CFG functions do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PERTURBED, ISOLATED = "perturbed", "isolated"  # the extra passes' kinds (the model's guidance_pass)


@dataclass(frozen=True)
class Passes:
    audio_cfg: float | None = None  # LTXVDualCFGGuider's audio_cfg (its video_cfg is the request's cfg)
    stg_scale: float = 0.0
    stg_blocks: frozenset[int] = frozenset({29})
    stg_sigmas: tuple[float, float] = (1.0, 0.0)  # (σ_start, σ_end): percent_to_sigma of the node's start and end
    modality_scale: float = 1.0
    modality_sigmas: tuple[float, float] = (1.0, 0.0)

    def dual(self, cfg: float) -> bool:
        """The audio guided at a scale of its own (Guider_LTXAVDualCFG: equal scales are plain CFG)."""
        return self.audio_cfg is not None and not math.isclose(cfg, self.audio_cfg)

    def extra(self, sigma: float) -> list[str]:
        """The extra passes at σ, in the order the combine adds them."""
        kinds = []
        if self.stg_scale != 0 and self.stg_blocks and self.stg_sigmas[1] <= sigma <= self.stg_sigmas[0]:
            kinds.append(PERTURBED)
        if not math.isclose(self.modality_scale, 1.0) and self.modality_sigmas[1] <= sigma <= self.modality_sigmas[0]:
            kinds.append(ISOLATED)
        return kinds

    def combine(self, x0: dict[str, torch.Tensor], cfg: float, parts=None) -> torch.Tensor:
        """The guided x0 from each pass's x0 ("cond", "uncond" where it ran, and the extra ones) [B, ...]; ``parts``:
        the latent's parts (sampling/packed.py) where the audio is guided at its own scale."""
        cond, uncond = x0["cond"], x0.get("uncond")
        out = cond
        if uncond is not None:
            out = uncond + (cond - uncond) * cfg
            if self.dual(cfg) and parts is not None:
                video, audio = parts.sizes
                out = torch.cat([out[:, :video], (uncond + (cond - uncond) * self.audio_cfg)[:, video:]], dim=1)
        if PERTURBED in x0:
            out = out + (cond - x0[PERTURBED]) * self.stg_scale
        if ISOLATED in x0:
            out = out + (cond - x0[ISOLATED]) * (self.modality_scale - 1.0)
        return out


def blocks(text: str) -> frozenset[int]:
    """ComfyUI's STG block list: the numbers in a string ("29", "28, 29")."""
    import re

    return frozenset(int(b) for b in re.findall(r"\d+", text))
