"""A ``sample`` request, checked field by field before any work is scheduled for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import protocol
from .config import ConfigError, ParallelConfig
from .errors import UserError
from .models import lora
from .sampling.generate import Generation

MAX_SIDE = 16384
MAX_STEPS = 10000
MAX_BATCH = 64
SEED_RANGE = (0, 2**64 - 1)  # ComfyUI's seed widget range
CONDITIONING_KEYS = ("context", "pooled")
TENSOR_NAMES = ("latent", *CONDITIONING_KEYS, *(f"negative_{k}" for k in CONDITIONING_KEYS))


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
    tensors: dict[str, torch.Tensor]

    @property
    def image_tokens(self) -> int:
        """Tokens the transformer sees: the latent (1/8 of the image) in 2×2 patches."""
        return (self.width // 16) * (self.height // 16)

    @property
    def latent_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, 16, self.height // 8, self.width // 8)

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
            tensors=dict(message.tensors),
        )
        request._check_geometry()
        request._check_tensors()
        return request

    def _check_geometry(self) -> None:
        for name, side in (("width", self.width), ("height", self.height)):
            if side % 16:
                raise RequestError(
                    f"{name} {side} is not a multiple of 16 (8 for the VAE × 2 for the 2×2 patches)",
                    f"use {name} {side // 16 * 16 or 16} or {(side // 16 + 1) * 16}",
                )
        for name, value, low, high in (("cfg", self.cfg, 0.0, 100.0), ("guidance", self.guidance, 0.0, 100.0),
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
        latent = self.tensors.get("latent")
        if latent is not None and tuple(latent.shape) != self.latent_shape:
            raise RequestError(
                f"latent has shape {list(latent.shape)}, but batch {self.batch} at {self.width}×{self.height} "
                f"needs {list(self.latent_shape)}"
            )
        given = {name for name in self.tensors if name != "latent"}
        if given and "context" not in given:
            raise RequestError("conditioning was sent without 'context'", "send context and pooled together")

    def conditioning(self, spec) -> tuple[dict, dict | None]:
        """Positive and (optional) negative conditioning, checked against the model's shapes."""
        sides = []
        for prefix in ("", "negative_"):
            if prefix + "context" not in self.tensors:
                sides.append(None)
                continue
            side = {key: self.tensors.get(prefix + key) for key in CONDITIONING_KEYS}
            text_tokens = side["context"].shape[1] if side["context"].dim() == 3 else -1
            for key, shape in spec.conditioning_shapes(self.batch, text_tokens).items():
                tensor = side[key]
                if tensor is None or tuple(tensor.shape) != shape:
                    got = "nothing" if tensor is None else f"shape {list(tensor.shape)}"
                    raise RequestError(
                        f"{prefix}{key}: model {self.model} needs shape {list(shape)}, got {got}",
                        "encode the prompt with the text encoders that belong to this model",
                    )
            sides.append(side)
        return sides[0], sides[1]

    def generation(self, spec, positive: dict, negative: dict | None) -> Generation:
        return Generation(
            latent=self.tensors.get("latent", torch.zeros(self.latent_shape)),
            seed=self.seed,
            steps=self.steps,
            cfg=self.cfg,
            guidance=self.guidance if self.guidance is not None else spec.default_guidance,
            shift=self.shift if self.shift is not None else spec.default_shift,
            positive=positive,
            negative=negative,
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


def _int_in(fields: dict, name: str, default: int, low: int, high: int) -> int:
    value = fields.get(name, default)
    if not low <= value <= high:
        raise RequestError(f"{name} {value} is out of range: it must lie in {low}..{high}")
    return value
