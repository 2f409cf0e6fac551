"""A ``sample`` request, checked field by field before any work is scheduled for it.

Its fields are schema.SAMPLE's: the attributes below are made from that declaration, ``parse``
reads them from a message and ``to_fields`` writes them back, which is what rank 0 broadcasts
and every other rank parses (so a field cannot reach rank 0 alone).
"""

from __future__ import annotations

from dataclasses import make_dataclass

import torch

from . import protocol, schema
from .config import ConfigError, ParallelConfig
from .errors import UserError
from .models import lora
from .sampling import samplers, schedulers
from .sampling.generate import Generation, cut

CONDITIONING_KEYS = ("context", "pooled", "context_mask", "context_byt5", "context_byt5_mask")  # which a model takes: its spec's conditioning_shapes
TENSOR_NAMES = ("latent", "sigmas", *CONDITIONING_KEYS, *(f"negative_{k}" for k in CONDITIONING_KEYS))
CHOICES = {"samplers": samplers.SAMPLERS, "schedulers": schedulers.SCHEDULERS}  # schema's choice registries


class RequestError(UserError):
    """A request the backend will not run; the message names the field, the value and the rule."""


# The attributes, in schema order: each field under its attribute name (return_with_leftover_noise
# is ``leftover_noise``), then the message's tensors by name.
_Fields = make_dataclass("_Fields", [*((f.attribute, f.type) for f in schema.SAMPLE),
                                     ("tensors", "dict[str, torch.Tensor]")], frozen=True)


class SampleRequest(_Fields):
    """A checked ``sample`` request. ``parallel`` None: pick a layout for the backend's world size
    (auto); ``loras``: lora.LoraSpec, in order; ``end_step`` None: to the end of the schedule."""

    def latent_shape(self, spec) -> tuple[int, ...]:
        return spec.latent_shape(self.batch, self.width, self.height, self.frames)

    @classmethod
    def parse(cls, message: protocol.Message) -> SampleRequest:
        values = {field.attribute: _read(field, message.fields) for field in schema.SAMPLE}
        request = cls(**values, tensors=dict(message.tensors))
        request._check_ranges()
        request._check_tensors()
        return request

    def to_fields(self) -> dict:
        """The wire fields that ``parse`` reads back into this request: what rank 0 broadcasts."""
        fields = {field.name: _write(field, getattr(self, field.attribute)) for field in schema.SAMPLE}
        return {name: value for name, value in fields.items() if value is not None}

    def _check_ranges(self) -> None:
        if self.end_step is not None and self.end_step <= self.start_step:
            raise RequestError(f"end_step {self.end_step} must be after start_step {self.start_step}",
                               "leave end_step out to run to the end of the schedule")
        for field in schema.SAMPLE:
            value = getattr(self, field.attribute)
            if field.kind == "float" and value is not None and not field.low <= value <= field.high:
                raise RequestError(f"{field.name} {value} is out of range: "
                                   f"it must lie in {field.low:g}..{field.high:g}")

    def _check_tensors(self) -> None:
        unknown = sorted(set(self.tensors) - set(TENSOR_NAMES))
        if unknown:
            raise RequestError(f"unknown tensors {unknown}", f"a sample request may carry: {', '.join(TENSOR_NAMES)}")
        for name, tensor in self.tensors.items():
            if not tensor.is_floating_point():
                raise RequestError(f"tensor {name!r} has dtype {tensor.dtype}; send float32, float16 or bfloat16")
            if not torch.isfinite(tensor).all():
                raise RequestError(f"tensor {name!r} holds NaN or infinite values")
        given = {name for name in self.tensors if name != "latent"}
        if given and "context" not in given:
            raise RequestError("conditioning was sent without 'context'", "send the model's conditioning together")

    def check_model(self, spec) -> None:
        """The checks that depend on the model: its sizes, its latent's shape, its step range."""
        try:
            spec.check_size(self.width, self.height, self.frames)
        except UserError as exc:
            raise RequestError(exc.message, exc.hint) from None
        custom = self.tensors.get("sigmas")
        if custom is not None and (custom.dim() != 1 or len(custom) < 2 or bool((custom[1:] > custom[:-1]).any())
                                   or float(custom.min()) < 0):
            raise RequestError(f"sigmas {custom.tolist()[:8]}… must be a non-increasing 1-D list of at least two "
                               "noise levels ≥ 0", "connect a scheduler node's SIGMAS output")
        if custom is not None and len(custom) - 1 != self.steps:
            raise RequestError(f"steps {self.steps} does not match the {len(custom)} sigmas given "
                               f"({len(custom) - 1} steps)", f"send steps {len(custom) - 1} with them")
        latent = self.tensors.get("latent")
        if latent is not None and tuple(latent.shape) != self.latent_shape(spec):
            frames = f" × {self.frames} frames" if spec.video else ""
            raise RequestError(
                f"latent has shape {list(latent.shape)}, but a {spec.family} latent for batch {self.batch} at "
                f"{self.width}×{self.height}{frames} has shape {list(self.latent_shape(spec))}")
        if self.guidance is not None and spec.default_guidance is None:
            raise RequestError(f"guidance {self.guidance}: model {self.model} has no guidance embedding "
                               "(only Flux.1-dev-style models take one)", "leave guidance out; use cfg")
        if self.shift is not None and not spec.takes_shift:
            raise RequestError(f"shift {self.shift}: model {self.model} samples with discrete noise levels, "
                               "which have no flow shift", "leave shift out")
        if self.end_step is not None and self.end_step > self.steps:
            raise RequestError(f"end_step {self.end_step} is past the last of {self.steps} steps",
                               f"use end_step ≤ {self.steps}, or leave it out")

    def conditioning(self, spec) -> tuple[dict, dict | None]:
        """Positive and (optional) negative conditioning, checked against the model's shapes.

        An optional tensor (PixArt's context_mask) given on one side only is all ones on the other,
        so both sides carry the same keys."""
        sides = []
        for prefix in ("", "negative_"):
            if prefix + "context" not in self.tensors:
                sides.append(None)
                continue
            context = self.tensors[prefix + "context"]
            text_tokens = context.shape[1] if context.dim() == 3 else -1
            shapes = spec.conditioning_shapes(self.batch, text_tokens)
            side = {}
            for key, shape in shapes.items():
                tensor = self.tensors.get(prefix + key)
                if tensor is None or tensor.dim() != len(shape) or any(  # a None size: any length
                        size is not None and size != got for size, got in zip(shape, tensor.shape)):
                    got = "nothing" if tensor is None else f"shape {list(tensor.shape)}"
                    raise RequestError(
                        f"{prefix}{key}: model {self.model} needs shape {list(shape)}, got {got}",
                        "encode the prompt with the text encoders that belong to this model",
                    )
                side[key] = tensor
            for key in CONDITIONING_KEYS:
                if prefix + key in self.tensors and key not in shapes and key not in spec.optional_conditioning:
                    raise RequestError(f"{prefix}{key}: a {spec.family} model takes no {key!r}",
                                       f"send {', '.join(shapes)}")
            for key in spec.optional_conditioning:  # a mask: one per text token
                if prefix + key in self.tensors:
                    side[key] = self.tensors[prefix + key]
                    if tuple(side[key].shape) != (self.batch, text_tokens):
                        raise RequestError(f"{prefix}{key} has shape {list(side[key].shape)}; it needs "
                                           f"{[self.batch, text_tokens]}, one value per text token")
            sides.append(side)
        positive, negative = sides
        if positive is not None and negative is not None:
            for key in spec.optional_conditioning:
                for side, other in ((positive, negative), (negative, positive)):
                    if key in side and key not in other:
                        other[key] = torch.ones(other["context"].shape[:2])
        return positive, negative

    def generation(self, spec, positive: dict, negative: dict | None) -> Generation:
        sampling = spec.model_sampling(self.shift)
        sigmas = self.tensors.get("sigmas")
        if sigmas is None:
            sigmas = schedulers.sigmas(self.scheduler, sampling, self.steps, self.denoise, sampler=self.sampler)
        return Generation(
            latent=self.tensors.get("latent", torch.zeros(self.latent_shape(spec))),
            seed=self.seed,
            sigmas=cut(sigmas.float(), self.start_step, self.end_step, self.leftover_noise),
            sampling=sampling,
            sampler=self.sampler,
            cfg=self.cfg,
            guidance=self.guidance if self.guidance is not None else spec.default_guidance,
            positive=positive,
            negative=negative,
            add_noise=self.add_noise,
        )


DTYPES = {name: getattr(torch, name) for name in schema.DTYPE_NAMES if name != "auto"}  # float32 → torch.float32, …


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype weights are held and computed in. "auto": float32 on the CPU; on CUDA bfloat16 where
    the GPU computes in it natively (sm 8.0 and newer), else float16 (a V100 or T4 only emulates
    bfloat16, and its fused attention kernels have none)."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def _read(field: schema.Field, fields: dict):
    """One field's value in the request, from the message's fields (its default when absent)."""
    if field.name not in fields:
        if field.required:
            raise RequestError(field.required)
        if field.default is None:
            return None
    value = fields.get(field.name, field.default)
    if field.kind == "int" and not field.low <= value <= field.high:
        raise RequestError(f"{field.name} {value} is out of range: it must lie in {field.low}..{field.high}")
    if field.kind == "float":
        return float(value)  # its range: _check_ranges
    if field.kind == "choice" and value not in CHOICES[field.choices]:
        raise RequestError(f"{field.name} {value!r} is not supported",
                           f"use one of: {', '.join(CHOICES[field.choices])}")
    if field.kind == "dtype" and value not in field.choices:
        raise RequestError(f"{field.name} {value!r} is not supported", f"use {', '.join(field.choices)}")
    if field.kind == "layout":
        return _parallel(value)
    if field.kind == "loras":
        return _loras(value)
    return value


def _write(field: schema.Field, value):
    """One attribute as its wire value (None: left out)."""
    if field.kind == "layout":
        return "auto" if value is None else value.to_json()
    if field.kind == "loras":
        return [{"path": spec.path, "strength": spec.strength} for spec in value]
    return value


def _loras(entries) -> tuple:
    try:
        return tuple(lora.parse(entries))
    except UserError as exc:
        raise RequestError(exc.message, exc.hint) from None


def _parallel(value) -> ParallelConfig | None:
    if value == "auto":
        return None
    if isinstance(value, str):
        raise RequestError(f"parallel {value!r} is not a layout", 'send "auto" or degrees such as {"ulysses": 2}')
    try:
        return ParallelConfig.from_json(value)
    except ConfigError as exc:
        raise RequestError(exc.message, exc.hint) from None
    except TypeError as exc:
        raise RequestError(f"parallel: {exc}") from None
