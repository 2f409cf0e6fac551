"""One generation: noise, latent scaling, classifier-free guidance and the Euler loop.

The math is ComfyUI's (comfy/samplers.py KSAMPLER, comfy/model_sampling.py, k_diffusion
sample_euler), so the same seed and inputs give KSampler's latent. A generation may cover a
range of the schedule's steps, as KSamplerAdvanced does (Wan 2.2's two experts run as two).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


class GenerationStopped(Exception):
    """The step callback asked to stop (a cancel, a client that went away)."""


@dataclass
class Generation:
    """Everything one generation needs, on the CPU; conditioning dicts hold the family's tensors."""

    latent: torch.Tensor  # [B, C, h, w] or [B, C, T, h, w], raw VAE space (zeros: an empty latent)
    seed: int
    sigmas: torch.Tensor  # [steps + 1] the noise levels this generation walks, from ``schedule``
    sampling: object  # model_sampling.FlowSampling or EpsSampling
    cfg: float
    guidance: float | None
    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    add_noise: bool = True

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def uses_cfg(self) -> bool:
        return self.cfg != 1.0 and self.negative is not None


def schedule(sampling, steps: int, start: int = 0, end: int | None = None, leftover_noise: bool = False):
    """The sigmas of steps ``start``..``end`` of a ``steps``-step schedule, cut as KSamplerAdvanced
    cuts them: ending early reaches σ = 0 unless the leftover noise is to be returned."""
    sigmas = sampling.sigmas(steps)
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
    if gen.steps == 0:  # KSamplerAdvanced with start_at_step past the end returns its input
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
    batch = torch.ones(x.shape[0], device=device)
    with denoiser.attached():
        for i in range(gen.steps):
            x0 = denoiser.x0(x, sigmas[i] * batch, positive, negative, gen)
            x = x + (x - x0) / sigmas[i] * (sigmas[i + 1] - sigmas[i])  # Euler: d = (x − x0)/σ
            if not after_step(i + 1, gen.steps):
                raise GenerationStopped()
    x = ms.inverse_noise_scaling(sigmas[-1], x)
    return denoiser.gather_rows(fmt.process_out(x)).cpu()
