"""Sampling with a noise mask (SetLatentNoiseMask, VAE Encode for Inpainting's mask, InpaintModelConditioning's),
as ComfyUI's KSampler does it: comfy/samplers.py ``KSamplerX0Inpaint`` and comfy/sampler_helpers.py
``prepare_mask`` (comfy/utils.py ``reshape_mask``).

Before each model call the kept region of x is replaced by the input latent noised to the call's σ (ComfyUI's
``scale_latent_inpaint``: ``noise_scaling`` without the σ_max rule), and after it the kept region of the denoised
estimate is the input latent: x ← x·m + scaled·(1 − m), x0 ← x0·m + latent·(1 − m), m the mask (1: to be made).
Every tensor here is elementwise in the latent's cells, so a rank's rows (dp) and a PipeFusion patch's band take
their slice of it (``band``). Wan 2.2 TI2V-5B's ComfyUI model (WAN22) keeps the region clean instead (its
``scale_latent_inpaint`` returns the latent) and takes a timestep per frame from the mask (models/wan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def prepare_mask(mask: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A noise mask ([B or 1, (1,) H, W] at any size; a video's [B or 1, 1, T', H, W]) → ``shape``, as ComfyUI's
    ``reshape_mask``: resized (bilinear, trilinear for video) to the latent, its channels repeated, its batch
    repeated."""
    mask = mask.float()
    if len(shape) == 4:
        mask = F.interpolate(mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1]), size=shape[2:], mode="bilinear")
    else:
        if mask.dim() < 5:
            mask = mask.reshape(1, 1, -1, mask.shape[-2], mask.shape[-1])
        mask = F.interpolate(mask, size=shape[2:], mode="trilinear")
    if mask.shape[1] < shape[1]:
        mask = mask.repeat(1, shape[1], *(1,) * (len(shape) - 2))[:, :shape[1]]
    if mask.shape[0] < shape[0]:  # comfy.utils.repeat_to_batch_size
        mask = mask.repeat(-(-shape[0] // mask.shape[0]), *(1,) * (len(shape) - 1))
    return mask[:shape[0]]


@dataclass
class Inpaint:
    """This rank's rows of a masked generation, on its device: the mask (1: to be made), the input latent in model
    space, and the generation's starting noise, each [rows, C, (T,) h, w]."""

    mask: torch.Tensor
    latent: torch.Tensor
    noise: torch.Tensor
    clean: bool = False  # the kept region is the latent itself, not noised to σ (ComfyUI's WAN22: TI2V-5B)

    def model_input(self, x: torch.Tensor, sigma: torch.Tensor, sampling) -> torch.Tensor:
        """x [B, ...] at σ [B] (or one σ) with its kept region the input latent noised to σ (or clean)."""
        sigma = sigma.reshape(-1, *(1,) * (x.dim() - 1)) if torch.is_tensor(sigma) else sigma
        kept = self.latent if self.clean else sampling.inpaint_scaling(sigma, self.noise, self.latent)
        return x * self.mask + kept * (1.0 - self.mask)

    def output(self, x0: torch.Tensor) -> torch.Tensor:
        """The denoised estimate with its kept region the input latent."""
        return x0 * self.mask + self.latent * (1.0 - self.mask)

    def band(self, a: int, b: int) -> Inpaint:
        """Latent rows [a, b) of dim −2 (a PipeFusion patch)."""
        return Inpaint(self.mask[..., a:b, :], self.latent[..., a:b, :], self.noise[..., a:b, :], self.clean)
