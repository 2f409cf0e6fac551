"""KSampler's schedulers: the [steps + 1] noise levels a generation walks, as ComfyUI computes them
(comfy/samplers.py calculate_sigmas and KSampler.set_steps), in the same float32 arithmetic.

``sampling`` is the model's (``spec.model_sampling``): a model_sampling.FlowSampling, EpsSampling or
VSampling, or a v_prediction.ZeroSNRVSampling; the schedulers read its table (``table()``),
``sigma_min``/``sigma_max``, ``timestep(σ)`` and ``sigma(timestep)``, which all of them have.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .schedules import simple_schedule

SCHEDULERS = ("simple", "normal", "karras", "exponential", "sgm_uniform", "beta")

# KSampler computes one step more for these samplers and drops the next-to-last σ.
DISCARD_PENULTIMATE_SIGMA_SAMPLERS = frozenset({"dpm_2", "dpm_2_ancestral", "uni_pc", "uni_pc_bh2"})


def _with_zero(sigmas: list[float] | torch.Tensor) -> torch.Tensor:
    """[n] → [n + 1] float32 ending in σ = 0."""
    return torch.cat([torch.as_tensor(sigmas, dtype=torch.float32), torch.zeros(1)])


def normal(sampling, steps: int, sgm: bool = False) -> torch.Tensor:
    """Timesteps evenly spaced from σ_max's to σ_min's, mapped back to σ ("sgm_uniform": ``steps``
    of ``steps + 1`` points, the last replaced by 0)."""
    start, end = sampling.timestep(sampling.sigma_max), sampling.timestep(sampling.sigma_min)
    if sgm:
        timesteps, ends_at_zero = torch.linspace(start, end, steps + 1)[:-1], False
    else:
        ends_at_zero = math.isclose(float(sampling.sigma(end)), 0, abs_tol=0.00001)
        timesteps = torch.linspace(start, end, steps + 1 if ends_at_zero else steps)
    sigmas = [float(sampling.sigma(t)) for t in timesteps]
    return torch.FloatTensor(sigmas) if ends_at_zero else _with_zero(sigmas)


def karras(sampling, steps: int, rho: float = 7.0) -> torch.Tensor:
    """Karras et al. (2022): σ evenly spaced in σ^(1/ρ) between σ_max and σ_min."""
    lo, hi = float(sampling.sigma_min) ** (1 / rho), float(sampling.sigma_max) ** (1 / rho)
    ramp = torch.linspace(0, 1, steps)
    return _with_zero((hi + ramp * (lo - hi)) ** rho)


def exponential(sampling, steps: int) -> torch.Tensor:
    """σ evenly spaced in log σ from σ_max to σ_min."""
    log_hi, log_lo = math.log(float(sampling.sigma_max)), math.log(float(sampling.sigma_min))
    return _with_zero(torch.linspace(log_hi, log_lo, steps).exp())


def beta(sampling, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    """Table entries at the Beta(α, β) quantiles of 1 … 1/steps (arXiv 2407.12173), repeats dropped.

    The quantiles come from scipy's ``beta.ppf`` on a float64 array, as ComfyUI takes them: rounding
    ppf·(T − 1) to an index needs the very same ppf (ppf(0.5) = 0.5 puts 0.5·999 exactly on 499.5,
    which rounds to 500; one ulp less would give 499)."""
    from scipy.stats import beta as beta_dist  # scipy comes with torchsde

    table = sampling.table()
    last = len(table) - 1
    quantiles = 1 - np.linspace(0, 1, steps, endpoint=False)  # float64 [steps], 1 down to 1/steps
    indices = np.rint(beta_dist.ppf(quantiles, alpha, beta) * last)
    picked = [float(table[int(t)]) for k, t in enumerate(indices) if k == 0 or t != indices[k - 1]]
    return _with_zero(picked)


def calculate_sigmas(sampling, scheduler: str, steps: int) -> torch.Tensor:
    """ComfyUI's ``calculate_sigmas``: one scheduler, ``steps`` steps, no denoise."""
    if scheduler == "simple":
        return simple_schedule(sampling.table(), steps)
    if scheduler in ("normal", "sgm_uniform"):
        return normal(sampling, steps, sgm=scheduler == "sgm_uniform")
    if scheduler == "karras":
        return karras(sampling, steps)
    if scheduler == "exponential":
        return exponential(sampling, steps)
    if scheduler == "beta":
        return beta(sampling, steps)
    raise ValueError(f"unknown scheduler {scheduler!r}; valid: {', '.join(SCHEDULERS)}")


def sigmas(scheduler: str, sampling, steps: int, denoise: float = 1.0, *, sampler: str = "") -> torch.Tensor:
    """The [steps + 1] float32 σ KSampler walks (empty for denoise ≤ 0).

    denoise < 1 (KSampler.set_steps): the last steps + 1 σ of an int(steps / denoise)-step schedule.
    ``sampler``: for uni_pc (and ComfyUI's dpm_2 family) KSampler schedules one step more and drops
    the next-to-last σ; pass the sampler's name to get that schedule.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; valid: {', '.join(SCHEDULERS)}")
    if denoise is not None and denoise <= 0.0:
        return torch.FloatTensor([])
    partial = denoise is not None and denoise <= 0.9999  # KSampler's threshold for a full schedule
    total = int(steps / denoise) if partial else steps
    discard = sampler in DISCARD_PENULTIMATE_SIGMA_SAMPLERS
    out = calculate_sigmas(sampling, scheduler, total + 1 if discard else total)
    if discard:
        out = torch.cat([out[:-2], out[-1:]])
    return out[-(steps + 1):] if partial else out
