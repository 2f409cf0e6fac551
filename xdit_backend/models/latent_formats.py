"""ComfyUI's latent formats: how a VAE latent is scaled into the space the model samples in.

``process_in`` maps raw VAE space (what ComfyUI's LATENT carries) into model space, and
``process_out`` maps back. Constants are ComfyUI's (comfy/latent_formats.py), so a latent from
ComfyUI's VAE Encode goes in, and ours goes to ComfyUI's VAE Decode, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentFormat:
    channels: int
    scale: float
    shift: float = 0.0
    mean: tuple[float, ...] | None = None  # per-channel statistics (Wan's video VAEs)
    std: tuple[float, ...] | None = None
    video: bool = False  # [B, C, T, H, W] rather than [B, C, H, W]

    def _stats(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.channels) + (1,) * (latent.dim() - 2)  # broadcast over batch and space
        return (torch.tensor(self.mean, dtype=latent.dtype, device=latent.device).view(shape),
                torch.tensor(self.std, dtype=latent.dtype, device=latent.device).view(shape))

    def process_in(self, latent: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            mean, std = self._stats(latent)
            return (latent - mean) * self.scale / std
        return (latent - self.shift) * self.scale

    def process_out(self, latent: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:
            mean, std = self._stats(latent)
            return latent * std / self.scale + mean
        return latent / self.scale + self.shift


FLUX = LatentFormat(channels=16, scale=0.3611, shift=0.1159)
SD3 = LatentFormat(channels=16, scale=1.5305, shift=0.0609)
SD15 = LatentFormat(channels=4, scale=0.18215)  # PixArt-α's VAE
SDXL = LatentFormat(channels=4, scale=0.13025)  # PixArt-Σ's VAE
WAN21 = LatentFormat(
    channels=16, scale=1.0, video=True,
    mean=(-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
          0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921),
    std=(2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
         3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160),
)
WAN22 = LatentFormat(  # Wan 2.2 TI2V-5B's 48-channel VAE
    channels=48, scale=1.0, video=True,
    mean=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
          -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
          -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
          -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
          -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
          0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
    std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
         0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
         0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
         0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
         0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
         0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744),
)
# Comfy-Org/ComfyUI comfy/latent_formats.py HunyuanVideo15 (32 channels, 16× spatial, 4× temporal)
HUNYUAN_VIDEO15 = LatentFormat(channels=32, scale=1.03682, video=True)
# LTX-2's video latent (latent_formats.LTXAV, LTXV's): the VAEs normalise their own latents, so scale 1 and no shift;
# the audio part has no format of its own (the same identity: ComfyUI's sampler packs both)
LTXV = LatentFormat(channels=128, scale=1.0, video=True)
# MiniMax-H3's video latent (latent_formats.MiniMaxH3Video): its VAE normalises, scale 1; the audio part's factor is
# the model sampling's (models/minimax_h3.py part_scales)
MINIMAX_H3 = LatentFormat(channels=24, scale=1.0, video=True)
# Flux.2's VAE latent as ComfyUI carries it: 32 channels × 2×2 patches, pre-patchified to 128 channels
# at 1/16 of the pixels; process_in and process_out are the identity (Comfy-Org/ComfyUI
# comfy/latent_formats.py, class Flux2: latent_channels 128, spacial_downscale_ratio 16).
FLUX2 = LatentFormat(channels=128, scale=1.0)
# CogVideoX: the raw VAE latent times the VAE's scaling factor (Comfy-Org/ComfyUI comfy/latent_formats.py
# CogVideoX and CogVideoX1_5; THUDM/CogVideo sat/configs cogvideox_2b.yaml, cogvideox_5b.yaml: scale_factor)
COGVIDEOX_2B = LatentFormat(channels=16, scale=1.15258426, video=True)
COGVIDEOX_5B = LatentFormat(channels=16, scale=0.7, video=True)  # 5B and 1.5-5B
