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
from .inpaint import Inpaint, prepare_mask
from .guidance import Passes
from .packed import LatentParts
from .stop import GenerationStopped  # noqa: F401  (callers import it from here)


@dataclass
class Generation:
    """Everything one generation needs, on the CPU; conditioning dicts hold the family's tensors."""

    latent: torch.Tensor  # [B, C, h, w] or [B, C, T, h, w], raw VAE space (zeros: an empty latent); packed: [B, K]
    seed: int
    sigmas: torch.Tensor  # [steps + 1] the noise levels this generation walks (schedulers.py, then ``cut``)
    sampling: object  # spec.model_sampling(shift): model_sampling.Flow/Eps/VSampling, v_prediction.ZeroSNRVSampling
    cfg: float
    guidance: float | None
    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None
    add_noise: bool = True
    sampler: str = "euler"  # samplers.SAMPLERS
    cpu_noise: bool = False  # ancestral noise from the CPU generator (the ranks' GPUs differ: noise.StepNoise)
    cache: object = None  # parallel/step_cache.CacheOptions, or None: every step computes every block
    noise_mask: torch.Tensor | None = None  # inpainting: 1 where to make, 0 where to keep the latent (inpaint.py)
    # under a noise mask: the model reads the mask (``denoise_mask`` on each side, ComfyUI's extra cond: WAN22's
    # timesteps per frame; Fill's and Wan I2V's concatenated mask where the conditioning has none), and the kept
    # region stays clean rather than noised (WAN22): FamilySpec.model_reads_noise_mask, masked_timesteps_per_frame
    model_reads_mask: bool = False
    kept_clean: bool = False
    # a latent of several parts (LTX-2's or MiniMax-H3's video and audio), ``latent`` their packed [B, Σ n_i] (packed.py); the noise
    # mask is the first part's (the video's), the others are made whole
    parts: LatentParts | None = None
    passes: Passes | None = None  # LTX-2's guidance beyond CFG (guidance.py): passes more than cond and uncond

    @property
    def steps(self) -> int:
        return len(self.sigmas) - 1

    @property
    def uses_cfg(self) -> bool:
        """The uncond pass runs: cfg ≠ 1, or the audio at a scale of its own (LTXVDualCFGGuider), with a negative."""
        dual = self.passes is not None and self.passes.dual(self.cfg)
        return (self.cfg != 1.0 or dual) and self.negative is not None


def side_differences(positive: dict[str, torch.Tensor], negative: dict[str, torch.Tensor]) -> list[str]:
    """What keeps the two sides of the guidance from running as one [2B, ...] call: a key on one side
    only (a glyph text), or shapes that differ past the batch (prompts of different lengths: Qwen2.5-VL's
    and Qwen3's are not padded). Empty when they batch. Sides that do not batch run one after the
    other, as ComfyUI runs conds that cannot concat (comfy/conds.py can_concat); either way exactly."""
    def shape(side: dict, key: str) -> str:
        return str(list(side[key].shape)) if key in side else "none"

    keys = sorted(positive.keys() | negative.keys())
    return [f"{key} {shape(positive, key)} vs {shape(negative, key)}" for key in keys
            if key not in positive or key not in negative or positive[key].shape[1:] != negative[key].shape[1:]]


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


@dataclass
class Start:
    """Where this rank's sampler loop starts: on its device, the noised latent of its batch rows in
    model space and its rows of the conditioning (copied there once, not at every model call); on
    the host, the σ it walks (the samplers' arithmetic and branches read them there); and its rows
    of the per-step noise."""

    x: torch.Tensor  # [rows, C, (T,) h, w]
    sigmas: torch.Tensor  # [steps + 1], CPU
    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None  # None without guidance (gen.uses_cfg)
    noise: samplers.StepNoise
    inpaint: Inpaint | None = None  # with a noise mask: its rows of the mask, latent and starting noise


def start(gen: Generation, latent_format, rows: slice, device) -> Start:
    """ComfyUI's prologue: noise drawn for the whole batch (as ComfyUI draws it) and cut to ``rows``,
    the input latent shifted into model space (an empty latent is not), then noise-scaled at σ₀."""
    full = gen.latent.float()
    if not gen.add_noise:
        noise = torch.zeros_like(full)
    else:
        noise = gen.parts.noise(full.shape[0], gen.seed) if gen.parts else comfy_noise(tuple(full.shape), gen.seed)
    noise = noise[rows].to(device)
    latent = latent_format.process_in(full) if torch.count_nonzero(full) > 0 else full
    latent = (gen.parts.scaled(latent) if gen.parts else latent)[rows].to(device)
    positive = {key: t[rows].to(device) for key, t in gen.positive.items()}
    negative = {key: t[rows].to(device) for key, t in gen.negative.items()} if gen.uses_cfg else None
    x = gen.sampling.noise_scaling(gen.sigmas[0], noise, latent)
    # the ancestral and SDE samplers' noise: drawn for the whole batch (as ComfyUI draws it), this
    # rank's rows kept and sent to its device
    step_noise = samplers.StepNoise(tuple(full.shape), gen.seed, rows, device=device, cpu_generator=gen.cpu_noise)
    inpaint = None
    if gen.noise_mask is not None:
        mask = packed_mask(gen, tuple(full.shape))[rows].to(device)
        inpaint = Inpaint(mask, latent, noise, clean=gen.kept_clean)
        if gen.model_reads_mask:  # ComfyUI's extra cond "denoise_mask": the prepared mask, on both sides
            positive = {**positive, "denoise_mask": mask}
            negative = None if negative is None else {**negative, "denoise_mask": mask}
    return Start(x, gen.sigmas, positive, negative, step_noise, inpaint)


def packed_mask(gen: Generation, shape: tuple[int, ...]) -> torch.Tensor:
    """The noise mask over the whole latent ``shape``: the latent's own, or for parts the first part's mask beside
    ones for the others (ComfyUI's LTXVConcatAVLatent: a part without a mask is made whole)."""
    if gen.parts is None:
        return prepare_mask(gen.noise_mask, shape)
    first, *others = gen.parts.shapes
    return gen.parts.pack([prepare_mask(gen.noise_mask, (shape[0], *first)),
                           *(torch.ones(shape[0], *other) for other in others)])


def finish(gen: Generation, latent_format, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """ComfyUI's epilogue: the sampler's model-space latent back to raw VAE space."""
    x = latent_format.process_out(gen.sampling.inverse_noise_scaling(samplers.final_sigma(gen.sampler, sigmas), x))
    return gen.parts.scaled(x, inverse=True) if gen.parts else x


def generate(denoiser, gen: Generation, after_step: Callable[[int, int], bool] = lambda i, n: True) -> torch.Tensor:
    """Run the sampler loop; ``after_step(done, total)`` returning False raises GenerationStopped.

    ``denoiser`` (parallel/denoiser.py) gives the guided x0 and says which batch rows this rank
    generates. Returns the final latent of the whole batch in raw VAE space, float32, on the CPU.
    """
    if gen.steps <= 0:  # start_at_step past the end, or denoise 0: ComfyUI returns the input
        return gen.latent.float()
    fmt = denoiser.latent_format
    begin = start(gen, fmt, denoiser.rows(gen.latent.shape[0]), denoiser.device)
    conditioning = denoiser.conditioning(begin.positive, begin.negative, gen.passes is not None)  # once

    def x0(x, sigma):  # sigma [B]
        if begin.inpaint is None:
            return denoiser.x0(x, sigma, conditioning, gen)
        x = begin.inpaint.model_input(x, sigma, gen.sampling)
        return begin.inpaint.output(denoiser.x0(x, sigma, conditioning, gen))

    def stepped(done: int, total: int) -> bool:
        denoiser.step_done(done)
        return after_step(done, total)

    with denoiser.attached(gen):
        x = samplers.sample(gen.sampler, x0, begin.x, begin.sigmas, gen.sampling, begin.noise, stepped)
    return denoiser.gather_rows(finish(gen, fmt, x, begin.sigmas)).cpu()
