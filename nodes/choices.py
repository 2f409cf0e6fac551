"""What flows between the pack's nodes: the model and the parallel layout chosen, as plain values.

The loader loads nothing: the backend loads (and caches) the model when a sampler first asks
for it. These values say which model and which layout; ``fingerprint`` is what makes ComfyUI
run the sampler again when a file behind them changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from xdit_backend import schema

TEST_PREFIX = "[test] "  # built-in test models in the loader's list (random weights, no file)


@dataclass(frozen=True)
class ControlChoice:
    """A control (the xDiT ControlNet and xDiT DiffSynth ControlNet nodes): its file (or built-in name), its strength,
    and what its control latent is made from when a sampler knows the latent's size (nodes/control.py)."""

    path: str
    strength: float
    image: object = field(compare=False, repr=False)  # ComfyUI's IMAGE [B, H, W, 3]
    vae: object = field(compare=False, repr=False)  # ComfyUI's VAE, None for a built-in patch
    mask: object = field(default=None, compare=False, repr=False)  # ComfyUI's MASK, inverted as the patch node does
    mask_channels: int = 0  # the patch's inpainting mask channels after the latent's
    start: float = 0.0  # a ControlNet's percent range (ControlNetApplyAdvanced's start_percent, end_percent)
    end: float = 1.0
    resize: str = "area"  # how the image meets the latent's pixels: the patch's "area" when they differ, a ControlNet's
    # "nearest-exact" always (comfy/controlnet.py get_control)
    mode: int | None = None  # a union ControlNet's control type (SetUnionControlNetType's number); None: auto
    # how the image is mapped before it is encoded (an SD3.5 ControlNet's, by its file's control_type: ComfyUI's
    # load_controlnet_sd35 preprocess_image): "canny" x → 127.5·x + 0.5, "depth" x → 1 − x; None: as it is
    preprocess: str | None = None
    pixels: bool = False  # the control takes the image's pixels, not its VAE latent (an XLabs ControlNet)
    # a Z-Image Fun ControlNet's inpainting image (ComfyUI's IMAGE), encoded after the mask for a 33-channel file
    inpaint_image: object = field(default=None, compare=False, repr=False)
    fun: bool = False  # a Z-Image Fun ControlNet: its control latent made as ZImageControlPatch makes it

    def request_entry(self, ranged: bool = True) -> dict:
        """The request's entry (schema's ``controls``); ``ranged`` False: without the percent range (applied before
        the request: the xDiT Model's calls)."""
        return {"path": self.path, "strength": self.strength,
                **({"start": self.start, "end": self.end} if ranged and (self.start, self.end) != (0.0, 1.0) else {}),
                **({"type": self.mode} if self.mode is not None else {})}


@dataclass(frozen=True)
class ModelChoice:
    ref: str  # a built-in name, or a file's absolute path
    dtype: str = "auto"  # the backend's names: auto, bfloat16, float16, float32
    loras: tuple[tuple[str, float], ...] = ()  # (absolute path, strength), in order
    shift: float | None = None  # flow shift (ComfyUI's ModelSamplingFlux/SD3 nodes); None: the model's
    compile: bool = False  # torch.compile the transformer's blocks (the backend caches the compiled model)
    weight_dtype: str = "default"  # how Linear weights are stored: default (the file's), fp8_e4m3fn, fp8_e5m2
    # the step cache (the xDiT Step Cache node): schema.CACHE_METHODS; threshold None: the method's default
    cache: str = schema.FIELDS["cache"].default
    cache_threshold: float | None = schema.FIELDS["cache_threshold"].default
    cache_start: int = schema.FIELDS["cache_start"].default
    cache_end: int = schema.FIELDS["cache_end"].default
    controls: tuple[ControlChoice, ...] = ()  # model patches, in order
    guidance: tuple[tuple[str, object], ...] = ()  # LTX-2's guidance fields (the xDiT LTX-2 Guidance node)

    def with_lora(self, path: str, strength: float) -> ModelChoice:
        return replace(self, loras=(*self.loras, (path, strength)))

    def with_control(self, control: ControlChoice) -> ModelChoice:
        return replace(self, controls=(*self.controls, control))

    def with_cache(self, method: str, threshold: float | None, start: int, end: int) -> ModelChoice:
        return replace(self, cache=method, cache_threshold=threshold, cache_start=start, cache_end=end)

    def with_guidance(self, **fields) -> ModelChoice:
        return replace(self, guidance=tuple(sorted(fields.items())))

    def request_fields(self) -> dict:
        return schema.fields(model=self.ref, dtype=self.dtype, weight_dtype=self.weight_dtype, compile=self.compile,
                             shift=self.shift,
                             loras=[{"path": path, "strength": strength} for path, strength in self.loras],
                             cache=self.cache, cache_threshold=self.cache_threshold, cache_start=self.cache_start,
                             cache_end=self.cache_end,
                             controls=[c.request_entry() for c in self.controls] or None, **dict(self.guidance))

    def fingerprint(self) -> str:
        """The choice and each file's modification time: a replaced model or LoRA file re-runs what
        uses it. A string: ComfyUI stores it in the prompt, which SaveLatent writes out as JSON."""
        files = [self.ref, *(path for path, _ in self.loras)]
        return repr((self.ref, self.dtype, self.weight_dtype, self.loras, self.shift, self.compile, self.cache,
                     self.cache_threshold, self.cache_start, self.cache_end, self.guidance,
                     [_mtime(path) for path in files]))


def _mtime(path: str) -> int:
    try:
        return Path(path).stat().st_mtime_ns
    except OSError:
        return 0  # a built-in name, or a file that has gone (the backend will say so)


@dataclass(frozen=True)
class ParallelChoice:
    degrees: dict | None = field(default=None, hash=False)  # None: the backend picks (auto)
    gpus: tuple[int, ...] | None = None  # None: every GPU (the backend's default)
    # with auto on: the degree widgets set anyway ("ulysses=2, ring=2"), which auto does not use (the sampler says so)
    unused_with_auto: str = field(default="", compare=False)

    def request_value(self):
        return "auto" if self.degrees is None else dict(self.degrees)
