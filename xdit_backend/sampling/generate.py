"""One generation: noise, latent scaling, classifier-free guidance and the flow-matching Euler loop.

The math is ComfyUI's (comfy/samplers.py, comfy/model_sampling.py CONST, k_diffusion sample_euler),
so the same seed and inputs give KSampler's latent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .schedules import flux_sigmas


class GenerationStopped(Exception):
    """The step callback asked to stop (a cancel, a client that went away)."""


@dataclass
class Generation:
    """Everything one generation needs, on the CPU; conditioning dicts hold ``context`` and ``pooled``."""

    latent: torch.Tensor  # [B, C, h, w], raw VAE space (zeros: an empty latent)
    seed: int
    steps: int
    cfg: float
    guidance: float
    shift: float
    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None

    @property
    def uses_cfg(self) -> bool:
        return self.cfg != 1.0 and self.negative is not None


def comfy_noise(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The noise ComfyUI draws: ``torch.manual_seed(seed); torch.randn(shape)`` on the CPU, without
    touching the global generator."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def generate(denoiser, gen: Generation, after_step: Callable[[int, int], bool] = lambda i, n: True) -> torch.Tensor:
    """Run the Euler loop; ``after_step(done, total)`` returning False raises GenerationStopped.

    ``denoiser`` (parallel/denoiser.py) gives the guided x0 and says which batch rows this rank
    generates. Returns the final latent of the whole batch in raw VAE space, float32, on the CPU.
    """
    fmt, device = denoiser.latent_format, denoiser.device
    full = gen.latent.float()
    rows = denoiser.rows(full.shape[0])
    noise = comfy_noise(tuple(full.shape), gen.seed)[rows].to(device)  # drawn whole, as ComfyUI draws it
    latent = (fmt.process_in(full) if torch.count_nonzero(full) > 0 else full)[rows].to(device)  # empty: unshifted
    positive = {key: t[rows] for key, t in gen.positive.items()}
    negative = {key: t[rows] for key, t in gen.negative.items()} if gen.uses_cfg else None
    sigmas = flux_sigmas(gen.steps, gen.shift).to(device)
    x = sigmas[0] * noise + (1 - sigmas[0]) * latent  # CONST noise scaling
    batch = torch.ones(x.shape[0], device=device)
    with denoiser.attached():
        for i in range(gen.steps):
            x0 = denoiser.x0(x, sigmas[i] * batch, positive, negative, gen.cfg, gen.guidance)
            x = x + (x - x0) / sigmas[i] * (sigmas[i + 1] - sigmas[i])  # Euler: d = (x − x0)/σ
            if not after_step(i + 1, gen.steps):
                raise GenerationStopped()
    x = x / (1.0 - sigmas[-1])  # CONST inverse noise scaling (σ_last = 0: identity)
    return denoiser.gather_rows(fmt.process_out(x)).cpu()
