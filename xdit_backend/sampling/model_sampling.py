"""ComfyUI's model sampling: the noise-level table, the timestep the model sees, and how the
model's output becomes a denoised estimate (comfy/model_sampling.py; float32 as ComfyUI computes).

- ``FlowSampling``: rectified flow (CONST). Flux uses ModelSamplingFlux (an exponential shift over
  10000 steps, timestep = σ); SD3 and Wan use ModelSamplingDiscreteFlow (timestep = 1000·σ).
- ``EpsSampling``: ModelSamplingDiscrete with EPS prediction over discrete betas (PixArt).
- ``VSampling``: the same with V-prediction (HunyuanDiT).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from .schedules import flux_sigma_table, simple_schedule


def _view(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """σ [B] (or a scalar) broadcast over a latent's other dims."""
    return sigma.view(-1, *(1,) * (like.dim() - 1)) if sigma.dim() else sigma


def _time_snr_shift(shift: float, t):
    """ModelSamplingDiscreteFlow's shift of a time t in [0, 1] (tensor or float)."""
    return t if shift == 1.0 else shift * t / (1 + (shift - 1) * t)


def _flux_time_shift(mu: float, t):
    """ModelSamplingFlux's shift: exp(μ) / (exp(μ) + (1/t − 1)) (tensor or float)."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)


class _Tabulated:
    """What both kinds share: a table of σ, computed once per setting (it is read at every step),
    its "simple" schedule, and its ends."""

    def table(self) -> torch.Tensor:
        """[T] float32 σ, ascending; shared, never to be modified in place."""
        return _table(self)

    def sigmas(self, steps: int) -> torch.Tensor:
        return simple_schedule(self.table(), steps)

    @property
    def sigma_min(self) -> torch.Tensor:
        return self.table()[0]

    @property
    def sigma_max(self) -> torch.Tensor:
        return self.table()[-1]


@functools.lru_cache(maxsize=64)
def _table(sampling) -> torch.Tensor:
    return sampling.compute_table()


@dataclass(frozen=True)
class FlowSampling(_Tabulated):
    shift: float
    flux: bool = False  # ModelSamplingFlux rather than ModelSamplingDiscreteFlow
    multiplier: float = 1000.0

    def compute_table(self) -> torch.Tensor:
        if self.flux:
            return flux_sigma_table(self.shift)
        t = (torch.arange(1, 1001, 1) / 1000) * self.multiplier / self.multiplier
        return t if self.shift == 1.0 else self.shift * t / (1 + (self.shift - 1) * t)  # time_snr_shift

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        return sigma if self.flux else sigma * self.multiplier

    def calculate_input(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x

    def calculate_denoised(self, sigma, output, x) -> torch.Tensor:
        return x - output * _view(sigma, output)  # x0 = x − σ·v

    def noise_scaling(self, sigma, noise, latent) -> torch.Tensor:
        return sigma * noise + (1.0 - sigma) * latent

    def inpaint_scaling(self, sigma, noise, latent) -> torch.Tensor:
        """The kept region of an inpainting at σ (ComfyUI's ``scale_latent_inpaint``: noise_scaling)."""
        return self.noise_scaling(sigma, noise, latent)

    def inverse_noise_scaling(self, sigma, latent) -> torch.Tensor:
        return latent / (1.0 - sigma)

    # -- what the schedulers need (ComfyUI's sigma_min/sigma_max/sigma/percent_to_sigma) --

    def sigma(self, timestep):
        """σ at a model timestep (tensor or float): the inverse of ``timestep``."""
        if self.flux:
            return _flux_time_shift(self.shift, timestep)
        return _time_snr_shift(self.shift, timestep / self.multiplier)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        t = 1.0 - percent
        return _flux_time_shift(self.shift, t) if self.flux else _time_snr_shift(self.shift, t)


@dataclass(frozen=True)
class EpsSampling(_Tabulated):
    linear_start: float = 0.0001
    linear_end: float = 0.02
    timesteps: int = 1000
    # comfy/ldm/modules/diffusionmodules/util.py make_beta_schedule: "sqrt_linear" (PixArt) is
    # linspace(start, end); "linear" (ComfyUI's default: HunyuanDiT) is linspace(√start, √end)²
    beta_schedule: str = "sqrt_linear"

    def _sigmas64(self) -> torch.Tensor:
        if self.beta_schedule == "linear":
            betas = torch.linspace(self.linear_start ** 0.5, self.linear_end ** 0.5, self.timesteps,
                                   dtype=torch.float64) ** 2
        else:
            betas = torch.linspace(self.linear_start, self.linear_end, self.timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5

    def compute_table(self) -> torch.Tensor:
        return self._sigmas64().float()

    @functools.cached_property
    def _log_sigmas(self) -> torch.Tensor:
        """log σ as ComfyUI keeps it (the log taken in float64), computed once."""
        return self._sigmas64().log().float()

    @functools.cached_property
    def _log_sigmas_by_device(self) -> dict[torch.device, torch.Tensor]:
        return {}

    def _log_sigmas_on(self, device: torch.device) -> torch.Tensor:
        """``_log_sigmas`` on ``device``, copied there once: ``timestep`` reads it at every model call."""
        if device not in self._log_sigmas_by_device:
            self._log_sigmas_by_device[device] = self._log_sigmas.to(device)
        return self._log_sigmas_by_device[device]

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The nearest discrete timestep in log σ (ComfyUI's ``timestep``), as a float."""
        log_sigmas = self._log_sigmas_on(sigma.device)
        return (sigma.log() - log_sigmas[:, None]).abs().argmin(dim=0).view(sigma.shape).float()

    def calculate_input(self, sigma: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x / (_view(sigma, x) ** 2 + 1.0) ** 0.5

    def calculate_denoised(self, sigma, output, x) -> torch.Tensor:
        return x - output * _view(sigma, output)  # x0 = x − σ·ε

    def noise_scaling(self, sigma, noise, latent) -> torch.Tensor:
        """From σ_max (a full generation) ComfyUI scales by √(1 + σ²), else by σ."""
        sigma_max = float(self.sigma_max)
        at_max = math.isclose(sigma_max, float(sigma), rel_tol=1e-05) or float(sigma) > sigma_max
        return noise * ((1.0 + sigma ** 2.0) ** 0.5 if at_max else sigma) + latent

    def inpaint_scaling(self, sigma, noise, latent) -> torch.Tensor:
        """The kept region of an inpainting at σ (ComfyUI's ``scale_latent_inpaint``: noise_scaling without the σ_max
        rule, max_denoise False)."""
        return noise * sigma + latent

    def inverse_noise_scaling(self, sigma, latent) -> torch.Tensor:
        return latent

    # -- what the schedulers need (ComfyUI's sigma_min/sigma_max/sigma/percent_to_sigma) --

    def sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        """σ at a (fractional) timestep: linear interpolation of log σ between the two nearest entries."""
        log_sigmas = self._log_sigmas
        t = timestep.float().to(log_sigmas.device).clamp(min=0, max=len(log_sigmas) - 1)
        w = t.frac()
        log_sigma = (1 - w) * log_sigmas[t.floor().long()] + w * log_sigmas[t.ceil().long()]
        return log_sigma.exp().to(timestep.device)

    def percent_to_sigma(self, percent: float) -> float:
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        return self.sigma(torch.tensor((1.0 - percent) * 999.0)).item()  # 999 whatever the table size, as ComfyUI


@dataclass(frozen=True)
class VSampling(EpsSampling):
    """ModelSamplingDiscrete with V-prediction (comfy/model_sampling.py V_PREDICTION, σ_data = 1)."""

    def calculate_denoised(self, sigma, output, x) -> torch.Tensor:
        sigma = _view(sigma, output)
        return x / (sigma ** 2 + 1.0) - output * sigma / (sigma ** 2 + 1.0) ** 0.5
