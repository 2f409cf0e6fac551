"""A ``sample`` request, checked field by field before any work is scheduled for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import protocol
from .config import ConfigError, ParallelConfig
from .errors import UserError
from .models import lora
from .sampling import samplers, schedulers
from .sampling.generate import Generation, cut

MAX_SIDE = 16384
MAX_STEPS = 10000
MAX_BATCH = 64
SEED_RANGE = (0, 2**64 - 1)  # ComfyUI's seed widget range
MAX_FRAMES = 1025
CONDITIONING_KEYS = ("context", "pooled", "context_mask")  # which a model takes: its spec's conditioning_shapes
TENSOR_NAMES = ("latent", "sigmas", *CONDITIONING_KEYS, *(f"negative_{k}" for k in CONDITIONING_KEYS))


class RequestError(UserError):
    """A request the backend will not run; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class SampleRequest:
    model: str
    width: int
    height: int
    batch: int
    steps: int
    seed: int
    cfg: float
    guidance: float | None
    shift: float | None
    parallel: ParallelConfig | None  # None: pick a layout for the backend's world size (auto)
    profile: bool
    dtype: str  # "auto" (float32 on the CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16"
    loras: tuple  # lora.LoraSpec, in order
    frames: int
    start_step: int
    end_step: int | None  # None: to the end of the schedule
    add_noise: bool
    leftover_noise: bool
    sampler: str
    scheduler: str
    denoise: float
    compile: bool  # run the model with torch.compile'd blocks (compile.py)
    tensors: dict[str, torch.Tensor]

    def latent_shape(self, spec) -> tuple[int, ...]:
        return spec.latent_shape(self.batch, self.width, self.height, self.frames)

    @classmethod
    def parse(cls, message: protocol.Message) -> SampleRequest:
        f = message.fields
        if "model" not in f:
            raise RequestError("a sample request needs a 'model' (a built-in name such as flux-tiny)")
        request = cls(
            model=f["model"],
            width=_int_in(f, "width", 1024, 16, MAX_SIDE),
            height=_int_in(f, "height", 1024, 16, MAX_SIDE),
            batch=_int_in(f, "batch", 1, 1, MAX_BATCH),
            steps=_int_in(f, "steps", 20, 1, MAX_STEPS),
            seed=_int_in(f, "seed", 0, *SEED_RANGE),
            cfg=float(f.get("cfg", 1.0)),
            guidance=float(f["guidance"]) if "guidance" in f else None,
            shift=float(f["shift"]) if "shift" in f else None,
            parallel=_parallel(f.get("parallel", "auto")),
            profile=f.get("profile", False),
            dtype=_dtype_name(f.get("dtype", "auto")),
            loras=_loras(f.get("loras", [])),
            frames=_int_in(f, "frames", 1, 1, MAX_FRAMES),
            start_step=_int_in(f, "start_step", 0, 0, MAX_STEPS),
            end_step=_int_in(f, "end_step", 0, 0, MAX_STEPS) if "end_step" in f else None,
            add_noise=f.get("add_noise", True),
            leftover_noise=f.get("return_with_leftover_noise", False),
            sampler=_name_in(f, "sampler", "euler", samplers.SAMPLERS),
            scheduler=_name_in(f, "scheduler", "simple", schedulers.SCHEDULERS),
            denoise=float(f.get("denoise", 1.0)),
            compile=f.get("compile", False),
            tensors=dict(message.tensors),
        )
        request._check_ranges()
        request._check_tensors()
        return request

    def _check_ranges(self) -> None:
        if self.end_step is not None and self.end_step <= self.start_step:
            raise RequestError(f"end_step {self.end_step} must be after start_step {self.start_step}",
                               "leave end_step out to run to the end of the schedule")
        for name, value, low, high in (("denoise", self.denoise, 0.0, 1.0), ("cfg", self.cfg, 0.0, 100.0), ("guidance", self.guidance, 0.0, 100.0),
                                       ("shift", self.shift, 1e-3, 100.0)):
            if value is not None and not low <= value <= high:
                raise RequestError(f"{name} {value} is out of range: it must lie in {low:g}..{high:g}")

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
                if tensor is None or tuple(tensor.shape) != shape:
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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(value: str) -> str:
    if value != "auto" and value not in DTYPES:
        raise RequestError(f"dtype {value!r} is not supported", f"use auto, {', '.join(DTYPES)}")
    return value


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype weights are held and computed in: "auto" is float32 on the CPU, bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


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


def _name_in(fields: dict, name: str, default: str, names: tuple[str, ...]) -> str:
    value = fields.get(name, default)
    if value not in names:
        raise RequestError(f"{name} {value!r} is not supported", f"use one of: {', '.join(names)}")
    return value


def _int_in(fields: dict, name: str, default: int, low: int, high: int) -> int:
    value = fields.get(name, default)
    if not low <= value <= high:
        raise RequestError(f"{name} {value} is out of range: it must lie in {low}..{high}")
    return value
