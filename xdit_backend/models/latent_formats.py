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
# Qwen-Image 2.1's 64-channel VAE at 1/16 of the pixels: (latent − mean) / std per channel (Comfy-Org/ComfyUI
# comfy/latent_formats.py 75399d78, class QwenImage21)
QWEN_IMAGE21 = LatentFormat(
    channels=64, scale=1.0,
    mean=(0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.6510, 0.2732,
          0.7562, -0.6163, -1.0277, 3.8363, 2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464,
          -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555,
          0.0746, -3.0751, -0.1076, 1.7376, -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729,
          -2.0595, 1.0960, -1.3260, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632,
          0.5547, -1.7121, -0.1562, 0.0304),
    std=(3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910, 3.0785, 3.6500, 3.9308, 3.0904, 2.8778,
         3.7675, 3.7320, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513,
         3.9323, 3.4719, 3.7498, 4.2830, 3.5694, 4.2467, 3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063,
         5.1125, 3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.0550,
         5.5614, 4.2963, 4.4080, 3.4959, 3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161),
)
