"""An ``evaluate`` request: one model call of a sampler that runs in ComfyUI's process (the xDiT MODEL).

It carries what ComfyUI's own diffusion model would receive (comfy/model_base.py ``_apply_model``):
``x`` [N, C, (T,) h, w], the model input (``calculate_input`` applied, N the batch rows ComfyUI assembled:
cond, uncond, area chunks), ``timestep`` [N] (``model_sampling.timestep(σ)``), an optional ``guidance`` [N]
(Flux's embedded guidance), and the family's conditioning by request key (context, pooled, …), each named by
its content hash (``inputs``) and sent inline the first time. The reply is the model's raw output, x's shape.
The model choice and the layout are a sample request's fields (schema.EVALUATE).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import schema
from ..distributed.config import ParallelConfig
from ..models import lora
from ..models.base import shape_fits, shape_text
from ..wire import protocol
from ..wire.content_hash import is_content_hash
from .request import CONTROL, REFERENCE, RequestError, SampleRequest, _read, _write, check_controls

CALL_TENSORS = ("x", "timestep", "guidance")
INPUT_KEY = re.compile(r"[a-z][a-z0-9_]{0,31}")
MAX_INPUTS = 16


@dataclass(frozen=True)
class EvaluateRequest:
    """A checked ``evaluate`` request: schema.EVALUATE's fields under their attribute names, then its tensors."""

    model: str
    parallel: ParallelConfig | None  # None: pick a layout for the backend's world size (auto)
    profile: bool
    dtype: str
    weight_dtype: str
    loras: tuple[lora.LoraSpec, ...]
    compile: bool
    cache: str
    cache_threshold: float | None
    cache_start: int
    cache_end: int
    inputs: dict[str, str]  # request key → content hash
    controls: tuple  # model_patch.PatchSpec each, its latent the input control_<i>
    generation: str  # the sampling run (its step cache), as the client names it
    step: int  # the schedule position of the call's noise level
    steps: int
    slot: int  # among the calls of its step (0: the one the step cache decides at)
    cond_start: int  # rows [cond_start, cond_start + cond_rows) of x are the cond side (the step cache decides
    cond_rows: int  # from them; ComfyUI batches uncond first)
    tensors: dict[str, torch.Tensor]  # x, timestep, guidance, and the inputs sent inline by hash

    def cache_options(self):
        return SampleRequest.cache_options(self)

    @property
    def x(self) -> torch.Tensor:
        return self.tensors["x"]

    @property
    def rows(self) -> int:
        return self.x.shape[0]

    @property
    def inline(self) -> dict[str, torch.Tensor]:
        return {name: t for name, t in self.tensors.items() if name not in CALL_TENSORS}

    @classmethod
    def parse(cls, message: protocol.Message) -> EvaluateRequest:
        values = {field.attribute: (_inputs(message.fields.get("inputs", {})) if field.kind == "inputs"
                                    else _read(field, message.fields)) for field in schema.EVALUATE}
        request = cls(**values, tensors=dict(message.tensors))
        request._check_tensors()
        return request

    def to_fields(self) -> dict:
        fields = {field.name: dict(self.inputs) if field.kind == "inputs"
                  else _write(field, getattr(self, field.attribute)) for field in schema.EVALUATE}
        return {name: value for name, value in fields.items() if value is not None}

    def _check_tensors(self) -> None:
        x, timestep = self.tensors.get("x"), self.tensors.get("timestep")
        if x is None or timestep is None:
            raise RequestError("an evaluate request carries the tensors x and timestep",
                               "send x [N, C, (T,) h, w] and timestep [N]")
        unknown = sorted(n for n in self.tensors if n not in CALL_TENSORS and not is_content_hash(n))
        if unknown:
            raise RequestError(f"unknown tensors {unknown}", "an evaluate request carries x, timestep, guidance and "
                               "its inputs named by their content hash")
        unused = sorted(n for n in self.inline if n not in self.inputs.values())
        if unused:
            raise RequestError(f"inline tensors {unused} are not among the request's inputs",
                               "send only the inputs the request names")
        if x.dim() not in (4, 5) or not 1 <= x.shape[0] <= schema.MAX_EVALUATE_ROWS:
            raise RequestError(f"x has shape {list(x.shape)}; it must be [N, C, h, w] or [N, C, T, h, w] with "
                               f"1 ≤ N ≤ {schema.MAX_EVALUATE_ROWS}")
        for name, tensor in self.tensors.items():
            if not tensor.is_floating_point():
                raise RequestError(f"tensor {name!r} has dtype {tensor.dtype}; send float32, float16 or bfloat16")
            if not torch.isfinite(tensor).all():
                raise RequestError(f"tensor {name!r} holds NaN or infinite values")
        per_frame = (x.shape[0], x.shape[2]) if x.dim() == 5 else None  # Wan 2.2 TI2V under a mask: check_model
        for name in ("timestep", "guidance"):
            tensor = self.tensors.get(name)
            if tensor is not None and tuple(tensor.shape) != (x.shape[0],) and not (
                    name == "timestep" and tuple(tensor.shape) == per_frame):
                raise RequestError(f"{name} has shape {list(tensor.shape)}; it must be [{x.shape[0]}], one per row "
                                   "of x" + (f" (a timestep may be [{x.shape[0]}, {x.shape[2]}], one per row and frame)"
                                             if name == "timestep" and per_frame else ""))

    def check_model(self, spec, inputs: dict[str, torch.Tensor]) -> None:
        """The checks that need the model: x's layout and size, and the inputs (``inputs``: key → tensor) against
        the family's conditioning, one row each per row of x."""
        x = self.x
        channels, dims = spec.latent_format.channels, 5 if spec.video else 4
        takes = {channels, channels + spec.concat_channels}  # the latent, or the model input ComfyUI concatenated
        largest = schema.MAX_SIDE // spec.vae_factor
        if x.dim() != dims or x.shape[1] not in takes or max(x.shape[-2:]) > largest or min(x.shape[-2:]) < 1:
            kind = "[N, C, T, h, w]" if spec.video else "[N, C, h, w]"
            given = " or ".join(map(str, sorted(takes)))
            raise RequestError(f"x has shape {list(x.shape)}; a {spec.family} model takes {kind} with C = {given} "
                               f"and h, w at most {largest} (an image of {schema.MAX_SIDE} pixels a side)")
        if self.tensors["timestep"].dim() == 2 and not spec.masked_timesteps_per_frame:
            raise RequestError(f"timestep has shape {list(self.tensors['timestep'].shape)}: one per frame, which only "
                               "Wan 2.2 TI2V-5B takes (under a noise mask)", f"send timestep [{self.rows}]")
        if "context" not in inputs:
            raise RequestError("the inputs have no 'context'", "send the text conditioning as input 'context'")
        context = inputs["context"]
        shapes = spec.conditioning_shapes(self.rows, context.shape[1] if context.dim() == 3 else -1)
        for key, tensor in inputs.items():
            if REFERENCE.fullmatch(key) and spec.takes_references:
                self._check_reference(spec, key, tensor)
                continue
            if CONTROL.fullmatch(key) and int(CONTROL.fullmatch(key)[1]) < len(self.controls):
                continue  # a control's latent: check_controls
            if key not in shapes:
                raise RequestError(f"input {key!r}: a {spec.family} model takes no {key!r}",
                                   f"send {', '.join(shapes)}")
            if not shape_fits(tuple(tensor.shape), shapes[key]):
                raise RequestError(f"input {key} has shape {list(tensor.shape)}; with {self.rows} rows of x a "
                                   f"{spec.family} model needs {shape_text(shapes[key])}",
                                   "send one row of conditioning per row of x")
        absent = [key for key in shapes if key not in inputs and key not in spec.optional_conditioning]
        if absent:
            raise RequestError(f"the inputs have no {', '.join(map(repr, absent))}, which a {spec.family} model needs",
                               "encode the prompt with the text encoders that belong to this model")
        check_controls(self.controls, lambda index: control_latent(inputs, index), spec, self.model, self.cache,
                       self.parallel, any(REFERENCE.fullmatch(key) for key in inputs), tuple(x.shape[-2:]))
        if self.controls and self.parallel is not None and self.parallel.pipefusion > 1:
            raise RequestError(f"controls with pipefusion={self.parallel.pipefusion} on the xDiT Model: its calls run "
                               "controls on the whole latent, which a PipeFusion stage does not hold",
                               "use ulysses, ring, cfg or dp with a control")

    def _check_reference(self, spec, key: str, tensor: torch.Tensor) -> None:
        """A reference latent [N, C, h, w] in raw latent space, h and w multiples of the patch, at most the largest
        image a request may ask for."""
        rows, columns, largest = spec.patch[1], spec.patch[2], schema.MAX_SIDE // spec.vae_factor
        shape = tuple(tensor.shape)
        if (len(shape) != 4 or shape[:2] != (self.rows, spec.latent_format.channels) or not shape[2] or not shape[3]
                or shape[2] % rows or shape[3] % columns or max(shape[2:]) > largest):
            raise RequestError(f"input {key} has shape {list(shape)}; a {spec.family} reference latent is "
                               f"[{self.rows}, {spec.latent_format.channels}, h, w], h a multiple of {rows} and w of "
                               f"{columns}, at most {largest} a side", "encode the reference with this model's VAE")

    def tokens(self, spec, inputs: dict | None = None) -> int:
        """Image tokens of x (padded to the patch, as ComfyUI's models pad it), and of the reference latents among
        ``inputs`` (they join the image's sequence)."""
        frames, rows, columns = spec.patch
        x = self.x
        time = -(-x.shape[2] // frames) if x.dim() == 5 else 1
        references = sum(t.shape[-2] // rows * (t.shape[-1] // columns) for key, t in (inputs or {}).items()
                         if REFERENCE.fullmatch(key))
        return time * -(-x.shape[-2] // rows) * -(-x.shape[-1] // columns) + references


def control_latent(inputs: dict[str, torch.Tensor], index: int) -> torch.Tensor | None:
    """The i-th control's latent among a call's inputs [1, C, h, w], or None."""
    return inputs.get(f"control_{index}")


def _inputs(value) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_INPUTS:
        raise RequestError(f"inputs must be an object of at most {MAX_INPUTS} entries, key → content hash")
    for key, name in value.items():
        if not INPUT_KEY.fullmatch(key) or not is_content_hash(name):
            raise RequestError(f"input {key!r}: {name!r} is not a content hash (wire/content_hash.py)",
                               "name each input by content_hash of its tensor")
    return dict(value)
