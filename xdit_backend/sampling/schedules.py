"""Sigma schedules, computed with ComfyUI's formulas and float32 arithmetic so they match bit for bit."""

from __future__ import annotations

import math

import torch

COMFY_TIMESTEPS = 10000  # ComfyUI tabulates its model sampling over this many timesteps


def flux_sigma_table(shift: float, timesteps: int = COMFY_TIMESTEPS) -> torch.Tensor:
    """ComfyUI's ModelSamplingFlux table: exp(μ) / (exp(μ) + (1/t − 1)), t = 1/T … 1, μ = shift."""
    t = torch.arange(1, timesteps + 1, 1) / timesteps
    return math.exp(shift) / (math.exp(shift) + (1 / t - 1) ** 1.0)


def simple_schedule(table: torch.Tensor, steps: int) -> torch.Tensor:
    """ComfyUI's "simple" scheduler: ``steps`` evenly strided entries from the top of the table, then 0."""
    stride = len(table) / steps
    sigmas = [float(table[-(1 + int(i * stride))]) for i in range(steps)]
    return torch.FloatTensor([*sigmas, 0.0])


def flux_sigmas(steps: int, shift: float) -> torch.Tensor:
    """[steps + 1] sigmas of KSampler's "simple" schedule for a Flux model with this shift."""
    return simple_schedule(flux_sigma_table(shift), steps)
