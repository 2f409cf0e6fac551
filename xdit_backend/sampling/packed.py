"""A latent of several parts sampled as one: the video and audio of LTX-2 or MiniMax-H3.

ComfyUI carries such a latent as a NestedTensor (video, audio) and, for its samplers, flattens it
(comfy/samplers.py ``CFGGuider.sample`` → comfy/utils.py ``pack_latents``): each part [B, ...] becomes
[B, n_i], the parts side by side in order; every sampler runs on that vector, and the model gets the parts
back (``unpack_latents``). The initial noise is drawn part by part from one generator seeded once, video
first (comfy/sample.py ``prepare_noise``). Every sampler's arithmetic is elementwise per row, so the packed
vector gives each part exactly what sampling it alone would, and a rank's rows (dp) are rows of the vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LatentParts:
    """The parts' shapes without their batch (video [C, F, h, w], audio [C, T, M]), and their latent formats."""

    shapes: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ("samples", "audio_samples")  # each part's name in a result (the wire's tensors)
    # each part's factor between raw latent space and the sampler's (MiniMax-H3 carries its audio at k times its
    # value: ComfyUI's process_latent_in multiplies it, process_latent_out divides)
    scales: tuple[float, ...] = (1.0, 1.0)

    @property
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    def pack(self, parts) -> torch.Tensor:
        """[B, *shape_i] each → [B, Σ n_i]."""
        return torch.cat([part.reshape(part.shape[0], -1) for part in parts], dim=1)

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """[B, Σ n_i] → [B, *shape_i] each (views)."""
        return [part.view(flat.shape[0], *shape) for part, shape in zip(flat.split(self.sizes, dim=1), self.shapes)]

    def noise(self, batch: int, seed: int) -> torch.Tensor:
        """ComfyUI's initial noise for the parts: one CPU generator seeded once, each part drawn in order, float32."""
        generator = torch.Generator().manual_seed(seed)
        return self.pack([torch.randn((batch, *shape), generator=generator, dtype=torch.float32)
                          for shape in self.shapes])

    def scaled(self, flat: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """[B, Σ n_i] with each part times its scale (divided, ``inverse``)."""
        if all(scale == 1.0 for scale in self.scales):
            return flat
        return self.pack([part / scale if inverse else part * scale
                          for part, scale in zip(self.unpack(flat), self.scales)])

    def named(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A result's tensors by name: each part of ``flat``, contiguous."""
        return {name: part.contiguous() for name, part in zip(self.names, self.unpack(flat))}
