"""The noise the ancestral and SDE samplers add at each step, drawn as ComfyUI draws it.

ComfyUI draws each step's noise for the WHOLE latent batch. A rank that holds some batch rows
(dp) takes its rows of that draw (``StepNoise.rows``); a PipeFusion patch, which holds a band of
latent rows, takes its band of it (``SharedDraws``): one whole draw per step, shared by the
patches, so every token gets exactly the noise it gets in the serial run.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .host_copy import to_device

NoiseFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (σ, σ_next) -> noise [rows, C, ...]


@dataclass(frozen=True)
class StepNoise:
    """The noise the ancestral and SDE samplers add, drawn for the WHOLE batch as ComfyUI draws it
    and cut to this rank's ``rows``, so every rank adds exactly its rows of ComfyUI's draw.

    ``default()`` is ComfyUI's default_noise_sampler: a generator seeded with the sample's seed, one
    ``randn(whole shape)`` per call, on the latent's device, as ComfyUI draws it, so an ancestral
    sampler on a GPU adds the noise KSampler adds on that GPU. With ``cpu_generator`` the draws are
    the CPU generator's instead, copied to ``device`` without a host sync (host_copy.py): a CUDA
    generator's numbers for one seed depend on the GPU model (its launch grid follows the SM count),
    so when the backend's ranks hold different GPU models (``Runtime.mixed_gpus``) they would add
    different noise to what must be one latent; the CPU's numbers are the same everywhere.
    ``brownian()`` is BrownianTreeNoiseSampler as dpmpp_2m_sde builds it: on the CPU (ComfyUI's
    cpu=True). Each call of these returns a fresh sampler, as each ComfyUI sampler call builds its own.
    """

    shape: tuple[int, ...]  # the whole batch's latent shape [B, C, ...]
    seed: int
    rows: slice = field(default_factory=lambda: slice(None))  # this rank's batch rows
    device: str | torch.device = "cpu"  # where the draws go (the latent's device)
    dtype: torch.dtype = torch.float32
    cpu_generator: bool = False  # draw with the CPU generator (ranks on different GPU models), not the device's

    def default(self) -> NoiseFn:
        where = torch.device("cpu") if self.cpu_generator else torch.device(self.device)
        generator = torch.Generator(device=where).manual_seed(self.seed)

        def draw(sigma, sigma_next):
            whole = torch.randn(self.shape, dtype=self.dtype, generator=generator, device=where)  # [B, C, ...]
            return to_device(whole[self.rows], self.device)

        return draw

    def brownian(self, sigma_min: torch.Tensor, sigma_max: torch.Tensor) -> NoiseFn:
        """Brownian-tree noise over [σ_min, σ_max]: W(σ_next) − W(σ) scaled to unit variance."""
        import torchsde

        def ordered(a, b):  # (low, high, +1) or (high, low, −1), as ComfyUI orders an interval
            return (a, b, 1) if a < b else (b, a, -1)

        lo, hi, tree_sign = ordered(torch.as_tensor(sigma_min), torch.as_tensor(sigma_max))
        w0 = torch.zeros(self.shape, dtype=self.dtype)
        tree = torchsde.BrownianTree(lo.detach().cpu(), w0, hi.detach().cpu(), entropy=self.seed)

        def draw(sigma, sigma_next):
            a, b, sign = ordered(torch.as_tensor(sigma), torch.as_tensor(sigma_next))
            with warnings.catch_warnings():  # torchsde warns when float32 ends miss its float64 ones by an ulp
                warnings.simplefilter("ignore", UserWarning)
                w = tree(a.detach().cpu().float(), b.detach().cpu().float())  # [whole shape] W(b) − W(a)
            w = to_device(w[self.rows].to(a.dtype), self.device) * (tree_sign * sign)  # −1: walking down in σ
            return w / (sigma_next - sigma).abs().sqrt()

        return draw


class SharedDraws:
    """One ``StepNoise`` shared by the patches of a latent (bands of latent rows, dim −2): the k-th
    draw of each kind is made once, when the first patch asks for it, and each patch gets its band of
    it; the draw is dropped once every patch has had it."""

    def __init__(self, noise: StepNoise, patches: int):
        self.noise, self.patches = noise, patches
        self._kinds: dict[str, tuple[NoiseFn, dict[int, list]]] = {}  # kind → (whole draw, {k: [noise, left]})

    def band(self, rows: slice) -> PatchNoise:
        """The noise source a patch's sampler uses (StepNoise's interface)."""
        return PatchNoise(self, rows)

    def draws(self, kind: str, make: Callable[[], NoiseFn], rows: slice) -> NoiseFn:
        if kind not in self._kinds:
            self._kinds[kind] = (make(), {})
        whole, made = self._kinds[kind]
        count = itertools.count()

        def draw(sigma, sigma_next):
            k = next(count)
            if k not in made:
                made[k] = [whole(sigma, sigma_next), self.patches]  # [rows, C, ..., h, w]
            entry = made[k]
            entry[1] -= 1
            if entry[1] == 0:
                del made[k]
            return entry[0][..., rows, :]  # [rows, C, ..., band, w]

        return draw


@dataclass(frozen=True)
class PatchNoise:
    """StepNoise's interface for one patch: its band of the shared whole draws."""

    shared: SharedDraws
    rows: slice  # latent rows (dim −2) of the patch

    def default(self) -> NoiseFn:
        return self.shared.draws("default", self.shared.noise.default, self.rows)

    def brownian(self, sigma_min: torch.Tensor, sigma_max: torch.Tensor) -> NoiseFn:
        return self.shared.draws("brownian", lambda: self.shared.noise.brownian(sigma_min, sigma_max), self.rows)
