"""What every model family shares: the request geometry a spec derives, and the loaded-model wrapper.

A family module (flux.py, sd3.py, pixart.py, wan.py) declares, as data on its spec: the
conditioning it takes, its latent format, its model sampling, its attention kind, how sequence
parallelism splits its tokens and positions, and the parallel methods it supports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError


class FamilySpec:
    """Geometry shared by the families; a family's frozen dataclass spec sets the class attributes."""

    family = ""
    vae_factor = 8  # pixels per latent cell (Wan 2.2-5B's VAE: 16)
    patch = (1, 2, 2)  # latent cells per token: (frames, rows, columns)
    video = False  # 5-D latents [B, C, T, h, w]
    time_factor = 4  # video frames per latent frame after the first (Wan's VAEs)
    default_guidance: float | None = None  # a guidance embedding (Flux-dev); None: the family has none
    optional_conditioning: tuple[str, ...] = ()

    @property
    def pixel_multiple(self) -> int:
        return self.vae_factor * self.patch[1]

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.time_factor + 1 if self.video else 1

    def check_size(self, width: int, height: int, frames: int) -> None:
        """Sizes the VAE and the patches can tile; errors give the nearest sizes that work."""
        m = self.pixel_multiple
        for name, side in (("width", width), ("height", height)):
            if side % m:
                raise UserError(f"{name} {side} is not a multiple of {m} for {self.family} "
                                f"({self.vae_factor} per latent cell × {self.patch[1]} per patch)",
                                f"use {name} {side // m * m or m} or {(side // m + 1) * m}")
        if not self.video and frames != 1:
            raise UserError(f"frames {frames}: {self.family} makes images, not videos", "leave frames at 1")
        if self.video and (frames - 1) % self.time_factor:
            low = (frames - 1) // self.time_factor * self.time_factor + 1
            raise UserError(f"frames {frames} is not 1 + a multiple of {self.time_factor} (the video VAE's stride)",
                            f"use frames {low} or {low + self.time_factor}")

    def latent_shape(self, batch: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        h, w = height // self.vae_factor, width // self.vae_factor
        if self.video:
            return (batch, self.latent_format.channels, self.latent_frames(frames), h, w)
        return (batch, self.latent_format.channels, h, w)

    def token_grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int]:
        """(tokens the transformer sees, rows of tokens): sequence parallelism splits the first,
        PipeFusion's patches are bands of the second."""
        rows = height // self.vae_factor // self.patch[1]
        columns = width // self.vae_factor // self.patch[2]
        return self.latent_frames(frames) // self.patch[0] * rows * columns, rows

    def model_sampling(self, shift: float | None):
        raise NotImplementedError


class DiffusionModel:
    """A loaded transformer (whole, or one PipeFusion stage of it) and its family's spec.

    ``predict_x0`` is ComfyUI's model call: scale the input, run the transformer at the model
    sampling's timestep, and turn its output into a denoised estimate. A family implements
    ``output`` (the transformer's raw prediction in latent shape).
    """

    def __init__(self, transformer, name: str, spec, lora_reports: list | None = None):
        self.transformer = transformer.eval().requires_grad_(False)
        self.name = name
        self.spec = spec
        self.lora_reports = lora_reports or []  # per LoRA file: merged modules, unmatched keys

    @property
    def latent_format(self):
        return self.spec.latent_format

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    def predict_x0(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict, gen, slices=None) -> torch.Tensor:
        """x0 for ``x`` (model space) at noise levels ``sigma`` [B]; ``slices``: this rank's tokens (Flux)."""
        sampling = gen.sampling
        out = self.output(sampling.calculate_input(sigma, x).to(self.dtype), sampling.timestep(sigma),
                          cond, gen.guidance, slices)
        return sampling.calculate_denoised(sigma, out.float(), x)

    def output(self, x, timestep, cond, guidance, slices) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class SequencePlan:
    """Where sequence parallelism splits a family's tokens and gathers them back, by module name:
    attached from outside with forward hooks and attention processors, removed after the request.

    split_outputs: (module, dim): the module's output (each tensor of a tuple output) is cut to
                   this rank's token slice along ``dim`` (the patch embedding; RoPE tables).
    split_inputs:  (module, dim): the module's first positional input is cut the same way.
    gather_output: the module whose output [B, N/P, C] is gathered into [B, N, C] (before unpatchify).
    attention:     (attribute name, kind): attention modules that get a sequence-parallel processor;
                   "joint" (diffusers Attention: self-attention, plus replicated text when given),
                   "wan" (WanAttention with 3-D RoPE). Cross-attention to the text is left alone: its
                   queries are this rank's tokens and its keys the whole text, so it is already exact.
    """

    split_outputs: tuple[tuple[str, int], ...] = ()
    split_inputs: tuple[tuple[str, int], ...] = ()
    gather_output: str = "proj_out"
    attention: tuple[tuple[str, str], ...] = ()
