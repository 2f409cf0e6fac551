"""The serial reference: a request's world-1 latent, computed in this process with no backend.

What every parity check compares a layout with (tests, ``demo``, ``bench``, ``selftest``). It runs the
code path a world-1 backend runs: the conditioning the leader fixes (SampleRequest.sides), the whole
model on one device, ComfyUI's sampling loop.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..models import model_patch, registry
from ..parallel.denoiser import Denoiser
from ..sampling.generate import generate
from ..wire.protocol import Message
from .request import SampleRequest


def serial_latent(fields: dict, tensors: dict | None = None, model=None,
                  after_step: Callable[[int, int], bool] = lambda done, steps: True,
                  cpu_noise: bool = False) -> torch.Tensor:
    """The latent a world-1 backend returns for the request ``fields`` (+ ``tensors``): float32, on the CPU.

    ``model``: an already built model to run (another device or dtype, a file written from the built-in
    ``fields["model"]`` names); by default the named model is built whole on the CPU in float32.
    ``cpu_noise``: ancestral samplers draw their noise from the CPU generator whatever the model's
    device (as ranks on mixed GPUs do), so a GPU run can be compared with a CPU one."""
    request = SampleRequest.parse(Message("sample", fields, tensors or {}))
    model = model if model is not None else registry.build(request.model, torch.device("cpu"))
    request.check_model(model.spec)
    with torch.no_grad():
        generation = replace(request.generation(model.spec, *request.sides(model.spec)), cpu_noise=cpu_noise)
        if not request.controls:
            return generate(Denoiser(model), generation, after_step)
        model.model_patches = [  # the executor's, each network made anew here
            model_patch.applied(entry, model_patch.network(entry, model.device, model.dtype),
                                request.control_latent(index), request.seed + index,
                                request.latent_shape(model.spec)[-2:], model,
                                model.spec.model_sampling(request.shift))
            for index, entry in enumerate(request.controls)]
        try:
            return generate(Denoiser(model), generation, after_step)
        finally:
            model.model_patches = []
