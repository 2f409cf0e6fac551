"""One generation: noise, latent scaling, classifier-free guidance and the sampler loop.

The math is ComfyUI's (comfy/samplers.py KSAMPLER, comfy/model_sampling.py, its k-diffusion
samplers: sampling/samplers.py), so the same seed and inputs give KSampler's latent. A
generation may cover a range of the schedule's steps, as KSamplerAdvanced does (Wan 2.2's two
experts run as two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import samplers
from .stop import GenerationStopped  # noqa: F401  (callers import it from here)


@dataclass
class Generation:
    """Everything one generation needs, on the CPU; conditioning dicts hold the family's tensors."""

    latent: torch.Tensor  # [B, C, h, w] or [B, C, T, h, w], raw VAE space (zeros: an empty latent)
    seed: int
    sigmas: torch.Tensor  # [steps + 1] the noise levels this generation walks (schedulers.py, then ``cut``)
    sampling: object  # model_sampling.FlowSampling or EpsSampling
    cfg: float
    guidance: float | None
    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    add_noise: bool = True
    sampler: str = "euler"  # samplers.SAMPLERS

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def uses_cfg(self) -> bool:
        return self.cfg != 1.0 and self.negative is not None


def cut(sigmas: torch.Tensor, start: int = 0, end: int | None = None, leftover_noise: bool = False):
    """Steps ``start``..``end`` of a schedule, cut as KSamplerAdvanced cuts them: ending early
    reaches σ = 0 unless the leftover noise is to be returned."""
    sigmas = sigmas.clone()
    if end is not None and end < len(sigmas) - 1:
        sigmas = sigmas[: end + 1]
        if not leftover_noise:
            sigmas[-1] = 0.0
    return sigmas[start:] if start < len(sigmas) - 1 else sigmas[-1:]  # past the end: nothing to do


def comfy_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The noise ComfyUI draws: ``torch.manual_seed(seed); torch.randn(shape)`` on the CPU, without
    touching the global generator."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def generate(denoiser, gen: Generation, after_step: Callable[[int, int], bool] = lambda i, n: True) -> torch.Tensor:
    """Run the Euler loop; ``after_step(done, total)`` returning False raises GenerationStopped.

    ``denoiser`` (parallel/denoiser.py) gives the guided x0 and says which batch rows this rank
    generates. Returns the final latent of the whole batch in raw VAE space, float32, on the CPU.
    """
    if gen.steps <= 0:  # start_at_step past the end, or denoise 0: ComfyUI returns the input
        return gen.latent.float()
    fmt, device, ms = denoiser.latent_format, denoiser.device, gen.sampling
    full = gen.latent.float()
    rows = denoiser.rows(full.shape[0])
    noise = comfy_noise(tuple(full.shape), gen.seed) if gen.add_noise else torch.zeros_like(full)
    noise = noise[rows].to(device)  # drawn whole, as ComfyUI draws it
    latent = (fmt.process_in(full) if torch.count_nonzero(full) > 0 else full)[rows].to(device)  # empty: unshifted
    positive = {key: t[rows] for key, t in gen.positive.items()}
    negative = {key: t[rows] for key, t in gen.negative.items()} if gen.uses_cfg else None
    sigmas = gen.sigmas.to(device)
    x = ms.noise_scaling(sigmas[0], noise, latent)
    # the ancestral and SDE samplers' noise: drawn for the whole batch (as ComfyUI draws it) on
    # the latent's device, this rank's rows kept
    step_noise = samplers.StepNoise(tuple(full.shape), gen.seed, rows, device=device)

    def x0(x, sigma):  # sigma [B]
        return denoiser.x0(x, sigma, positive, negative, gen)

    with denoiser.attached():
        x = samplers.sample(gen.sampler, x0, x, sigmas, ms, step_noise, after_step)
    x = ms.inverse_noise_scaling(samplers.final_sigma(gen.sampler, sigmas), x)
    return denoiser.gather_rows(fmt.process_out(x)).cpu()
