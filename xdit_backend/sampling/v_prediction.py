"""CogVideoX's model sampling as ComfyUI computes it: discrete v-prediction ("V_PREDICTION_DDPM")
over a zero-terminal-SNR schedule.

Comfy-Org/ComfyUI comfy/supported_models.py ``CogVideoX_T2V``: ModelSamplingDiscrete with "linear"
betas (linspace of the square roots, squared: diffusers' "scaled_linear") 0.00085 … 0.012 and
``zsnr``: σ rescaled so the last step is (almost) pure noise, its ᾱ pinned at
4.8973451890853435e-08 rather than 0 (σ_max ≈ 4.5·10³, finite). comfy/model_base.py ``CogVideoX``
uses ``ModelType.V_PREDICTION_DDPM`` (comfy/model_sampling.py): the model is given x as it is (no
1/√(σ² + 1) input scaling) and its output v gives x0 = x / √(σ² + 1) − v·σ / √(σ² + 1); the noise
scaling is EPS's. ComfyUI applies no SNR shift, for 2B either (THUDM trained 2B with a shift of 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model_sampling import EpsSampling, _view

LAST_ALPHA_BAR = 4.8973451890853435e-08  # ComfyUI's rescale_zero_terminal_snr_sigmas: keeps σ_max finite


@dataclass(frozen=True)
class ZeroSNRVSampling(EpsSampling):
    def _sigmas64(self) -> torch.Tensor:
        betas = torch.linspace(self.linear_start ** 0.5, self.linear_end ** 0.5, self.timesteps,
                               dtype=torch.float64) ** 2  # ComfyUI's "linear", diffusers' "scaled_linear"
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        return _rescale_zero_terminal_snr(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5)

    def calculate_input(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x  # V_PREDICTION_DDPM: the model is given x unscaled

    def calculate_denoised(self, sigma, output, x) -> torch.Tensor:
        sigma = _view(sigma, output)
        return x / (sigma ** 2 + 1.0) ** 0.5 - output * sigma / (sigma ** 2 + 1.0) ** 0.5  # x0 from v


def _rescale_zero_terminal_snr(sigmas: torch.Tensor) -> torch.Tensor:
    """Shift √ᾱ so its last entry is 0 and scale it so its first is unchanged (Lin et al. 2023,
    algorithm 1), then pin the last ᾱ as ComfyUI does; σ [T] float64 in and out."""
    root = (1 / (sigmas * sigmas + 1)).sqrt()  # √ᾱ [T]
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    alphas_bar = root ** 2
    alphas_bar[-1] = LAST_ALPHA_BAR
    return ((1 - alphas_bar) / alphas_bar) ** 0.5
