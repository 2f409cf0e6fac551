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


def guided_x0(model, x: torch.Tensor, sigma: torch.Tensor, gen: Generation) -> torch.Tensor:
    """Denoised estimate with ComfyUI's CFG: uncond + (cond − uncond)·cfg, both sides in one batch."""
    if not gen.uses_cfg:
        return model.predict_x0(x, sigma, gen.positive, gen.guidance)
    both = {key: torch.cat([gen.positive[key], gen.negative[key]]) for key in gen.positive}
    x0 = model.predict_x0(torch.cat([x, x]), torch.cat([sigma, sigma]), both, gen.guidance)  # [2B, C, h, w]
    cond, uncond = x0.chunk(2)
    return uncond + (cond - uncond) * gen.cfg


def generate(model, gen: Generation, after_step: Callable[[int, int], bool] = lambda i, n: True) -> torch.Tensor:
    """Run the Euler loop; ``after_step(done, total)`` returning False raises GenerationStopped.

    Returns the final latent in raw VAE space, float32, on the CPU.
    """
    fmt = model.latent_format
    latent = gen.latent.float()
    noise = comfy_noise(tuple(latent.shape), gen.seed)
    if torch.count_nonzero(latent) > 0:  # ComfyUI does not shift an empty latent
        latent = fmt.process_in(latent)
    sigmas = flux_sigmas(gen.steps, gen.shift).to(model.device)
    x = (sigmas[0] * noise.to(model.device) + (1 - sigmas[0]) * latent.to(model.device))  # CONST noise scaling
    batch = torch.ones(x.shape[0], device=model.device)
    for i in range(gen.steps):
        x0 = guided_x0(model, x, sigmas[i] * batch, gen)
        x = x + (x - x0) / sigmas[i] * (sigmas[i + 1] - sigmas[i])  # Euler: d = (x − x0)/σ
        if not after_step(i + 1, gen.steps):
            raise GenerationStopped()
    x = x / (1.0 - sigmas[-1])  # CONST inverse noise scaling (σ_last = 0: identity)
    return fmt.process_out(x).cpu()
