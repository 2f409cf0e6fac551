"""A ``sample`` request, checked field by field before any work is scheduled for it.

Its fields are schema.SAMPLE's, written out below with their types in the schema's order (the
schema tests hold them to it); the schema alone says how each is read: ``parse`` reads them from a
message by the schema's rows and ``to_fields`` writes them back, which is what rank 0 broadcasts
and every other rank parses (so a field cannot reach rank 0 alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import schema
from ..distributed.config import ConfigError, ParallelConfig
from ..errors import UserError
from ..models import lora, model_patch, registry
from ..models.base import shape_fits, shape_text
from ..parallel.step_cache import CacheOptions
from ..sampling import guidance, samplers, schedulers
from ..sampling.generate import Generation, cut
from ..sampling.packed import LatentParts
from ..wire import protocol

GENERATION_TENSORS = ("latent", "audio_latent", "sigmas", "noise_mask")
# Every other tensor is one side's conditioning, [negative_]<key>: which keys a model takes is its
# spec's (conditioning_shapes, optional_conditioning, takes_references), checked in ``conditioning``.
CONDITIONING_NAME = re.compile(r"(negative_)?([a-z][a-z0-9_]*)")
REFERENCE = re.compile(r"reference_(\d+)")
CONTROL = re.compile(r"control_(\d+)")  # the i-th control's latent (controls)
CHOICES = {"samplers": samplers.SAMPLERS, "schedulers": schedulers.SCHEDULERS}  # schema's choice registries


class RequestError(UserError):
    """A request the backend will not run; the message names the field, the value and the rule."""


@dataclass(frozen=True)
class SampleRequest:
    """A checked ``sample`` request: each schema field under its attribute name, in schema.SAMPLE's
    order, then the message's tensors by name."""

    model: str
    width: int
    height: int
    batch: int
    steps: int
    seed: int
    cfg: float
    guidance: float | None  # None: the model's
    shift: float | None  # None: the model's
    parallel: ParallelConfig | None  # None: pick a layout for the backend's world size (auto)
    profile: bool
    dtype: str
    weight_dtype: str
    loras: tuple[lora.LoraSpec, ...]  # in order
    controls: tuple[model_patch.PatchSpec, ...]  # in order; control_<i> is the i-th's latent
    frames: int
    start_step: int
    end_step: int | None  # None: to the end of the schedule
    add_noise: bool
    leftover_noise: bool  # return_with_leftover_noise on the wire
    sampler: str
    scheduler: str
    denoise: float
    compile: bool
    cache: str
    cache_threshold: float | None  # None: the method's, schema.CACHE_THRESHOLDS
    cache_start: int
    cache_end: int
    audio_cfg: float | None  # None: cfg
    stg_scale: float
    stg_blocks: str
    stg_start: float
    stg_end: float
    modality_scale: float
    modality_start: float
    modality_end: float
    tensors: dict[str, torch.Tensor]

    def latent_shape(self, spec) -> tuple[int, ...]:
        return spec.latent_shape(self.batch, self.width, self.height, self.frames)

    def latent_parts(self, spec) -> LatentParts | None:
        """A family with audio (LTX-2): the video's and the audio's latent shapes, the audio's as sent
        (``audio_latent``) or, sent none, for the video's length at the conditioning's frame rate."""
        if spec.audio_part is None:
            return None
        audio = self.tensors.get("audio_latent")
        if audio is None:
            rate = self.tensors.get("frame_rate")
            frames = spec.audio_frames(self.frames, *(() if rate is None else (float(rate.flatten()[0]),)))
            audio_shape = spec.audio_shape(self.batch, max(frames, 1))[1:]
        else:
            audio_shape = tuple(audio.shape[1:])
        return LatentParts((self.latent_shape(spec)[1:], audio_shape), scales=spec.part_scales(self.shift))

    def result(self, spec, latent: torch.Tensor) -> dict[str, torch.Tensor]:
        """The generation's result tensors by wire name: ``samples``, and ``audio_samples`` for a family with audio."""
        parts = self.latent_parts(spec)
        return {"samples": latent} if parts is None else parts.named(latent)

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
        unknown = sorted(name for name in self.tensors if name not in GENERATION_TENSORS
                         and not CONDITIONING_NAME.fullmatch(name) or self._stray_control(name))
        if unknown:
            raise RequestError(f"unknown tensors {unknown}",
                               "a sample request carries latent, sigmas and the model's conditioning tensors "
                               "(context, pooled, …; negative_context, … for the negative side)")
        for name, tensor in self.tensors.items():
            if not tensor.is_floating_point():
                raise RequestError(f"tensor {name!r} has dtype {tensor.dtype}; send float32, float16 or bfloat16")
            if not torch.isfinite(tensor).all():
                raise RequestError(f"tensor {name!r} holds NaN or infinite values")
        given = {name for name in self.tensors if name not in GENERATION_TENSORS
                 and not REFERENCE.fullmatch(name.removeprefix("negative_")) and not CONTROL.fullmatch(name)}
        if given and "context" not in given:
            raise RequestError("conditioning was sent without 'context'", "send the model's conditioning together")

    def _stray_control(self, name: str) -> bool:
        """A control_<i> tensor with no i-th control to go with it."""
        match = CONTROL.fullmatch(name)
        return bool(match) and int(match.group(1)) >= len(self.controls)

    def control_latent(self, index: int) -> torch.Tensor | None:
        """The i-th control's latent [1, C, h, w] (a video-shaped [1, C, 1, h, w] as ComfyUI's Qwen VAE gives it
        is squeezed), or None when none was sent."""
        latent = self.tensors.get(f"control_{index}")
        if latent is not None and latent.dim() == 5 and latent.shape[2] == 1:
            latent = latent[:, :, 0]
        return latent

    def check_model(self, spec) -> None:
        """The checks that depend on the model: its sizes, its latent's shape, its step range."""
        try:
            spec.check_size(self.width, self.height, self.frames)
        except UserError as exc:
            raise RequestError.of(exc) from None
        if self.cache != "none" and spec.step_cache_refusal:
            raise RequestError(f"the step cache ({self.cache}) on a {spec.family} model: {spec.step_cache_refusal}, "
                               "and on the steps the cache reuses, the blocks' cached output already holds them",
                               "use cache none with this model")
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
        self._check_audio_latent(spec)
        self._check_noise_mask(spec)
        self._check_controls(spec)
        if self.guidance is not None and spec.default_guidance is None:
            raise RequestError(f"guidance {self.guidance}: model {self.model} has no guidance embedding "
                               "(only Flux.1-dev-style models take one)", "leave guidance out; use cfg")
        if self.shift is not None and not spec.takes_shift:
            raise RequestError(f"shift {self.shift}: model {self.model} samples with discrete noise levels, "
                               "which have no flow shift", "leave shift out")
        self._check_passes(spec)
        if self.end_step is not None and self.end_step > self.steps:
            raise RequestError(f"end_step {self.end_step} is past the last of {self.steps} steps",
                               f"use end_step ≤ {self.steps}, or leave it out")

    def _check_controls(self, spec) -> None:
        """The controls against the model (check_controls)."""
        check_controls(self.controls, self.control_latent, spec, self.model, self.cache, self.parallel,
                       any(REFERENCE.fullmatch(name) for name in self.tensors), self.latent_shape(spec)[-2:])

    @property
    def asks_passes(self) -> bool:
        """LTX-2's guidance beyond CFG asked for (sampling/guidance.py)."""
        return self.audio_cfg is not None or self.stg_scale != 0 or self.modality_scale != 1.0

    def _check_passes(self, spec) -> None:
        if self.asks_passes and not spec.guidance_passes:
            raise RequestError(f"audio_cfg, stg_scale or modality_scale: model {self.model} ({spec.family}) has no "
                               "such guidance (LTX-2's: its audio, its blocks' self-attention, its audio↔video "
                               "attention)", "leave them at their defaults")
        if self.stg_scale != 0 and not guidance.blocks(self.stg_blocks) <= set(range(spec.blocks)):
            raise RequestError(f"stg_blocks {self.stg_blocks!r}: model {self.model} has blocks 0 to {spec.blocks - 1}",
                               f"perturb blocks of 0..{spec.blocks - 1} (ComfyUI's default 29 is LTX-2's)")

    def passes(self, sampling) -> guidance.Passes | None:
        """The guidance beyond CFG the request asks for, its σ ranges from the model sampling's percents."""
        if not self.asks_passes:
            return None
        return guidance.Passes(self.audio_cfg, self.stg_scale, guidance.blocks(self.stg_blocks),
                               (sampling.percent_to_sigma(self.stg_start), sampling.percent_to_sigma(self.stg_end)),
                               self.modality_scale, (sampling.percent_to_sigma(self.modality_start),
                                                     sampling.percent_to_sigma(self.modality_end)))

    def _check_audio_latent(self, spec) -> None:
        """An audio latent only for a family with audio, in its layout (LTX-2's [B, 8, T, 16]), T at most
        ``schema.MAX_AUDIO_FRAMES``; T = 0 asks for the video alone (as ComfyUI's LTX-2 model given a video latent)."""
        audio = self.tensors.get("audio_latent")
        if audio is None:
            return
        if spec.audio_part is None:
            raise RequestError(f"audio_latent: model {self.model} ({spec.family}) makes no audio",
                               "send audio_latent only to a model with audio (LTX-2)")
        length = spec.audio_length(tuple(audio.shape)) if audio.shape[:1] == (self.batch,) else None
        if length is None or length > schema.MAX_AUDIO_FRAMES:
            wanted = ", ".join("T" if d is None else str(d) for d in spec.audio_shape(self.batch, None))
            raise RequestError(f"audio_latent has shape {list(audio.shape)}; a {spec.family} audio latent is "
                               f"[{wanted}] with 0 ≤ T ≤ {schema.MAX_AUDIO_FRAMES} (0: the video alone)",
                               "send the audio latent as the model's empty-latent node or its audio VAE makes it")

    def _check_noise_mask(self, spec) -> None:
        """A noise mask as ComfyUI's LATENT carries one (Set Latent Noise Mask: [N, 1, H, W]; a video's may be
        [1, 1, T', H, W]), at any size: it is reshaped and resized to the latent as ComfyUI does
        (sampling/inpaint.py). Values in [0, 1]."""
        mask = self.tensors.get("noise_mask")
        if mask is None:
            return
        if not 2 <= mask.dim() <= (5 if spec.video else 4) or min(mask.shape) < 1:
            raise RequestError(f"noise_mask has shape {list(mask.shape)}; a mask is [N, 1, H, W] (a video's "
                               "also [1, 1, T, H, W])", "send the LATENT's noise_mask as Set Latent Noise Mask "
                               "makes it")
        if float(mask.min()) < 0.0 or float(mask.max()) > 1.0:
            raise RequestError(f"noise_mask holds values from {float(mask.min()):g} to {float(mask.max()):g}; a mask "
                               "is 0 (keep the latent) to 1 (make anew)", "send a mask in [0, 1]")

    def conditioning(self, spec) -> tuple[dict, dict | None]:
        """Positive and (optional) negative conditioning, checked against the model's spec.

        An optional mask (PixArt's context_mask) given on one side only is all ones on the other,
        so both sides can still batch. Sides may differ in text lengths, optional tensors and
        reference latents: those run one model call each (generate.side_differences)."""
        sides = [self._side(spec, prefix) if prefix + "context" in self.tensors else None
                 for prefix in ("", "negative_")]
        positive, negative = sides
        if positive is not None and negative is not None:
            for key in (k for k in spec.optional_conditioning if k.endswith("_mask")):
                masked = key.removesuffix("_mask")
                for side, other in ((positive, negative), (negative, positive)):
                    if key in side and key not in other and masked in other:
                        other[key] = torch.ones(other[masked].shape[:2])
        return positive, negative

    def sides(self, spec) -> tuple[dict, dict | None]:
        """The positive and (optional) negative conditioning every rank runs: as sent, or for a built-in
        test model sent none, its stand-in text from the seed with the reference latents sent (or, sent none, its
        own drawn from the seed: BuiltinModel.references)."""
        positive, negative = self.conditioning(spec)
        if positive is not None:
            return positive, negative
        if self.model not in registry.BUILTINS:
            keys = ", ".join(key for key in spec.conditioning_shapes(1, 1) if key not in spec.optional_conditioning)
            raise RequestError(f"model {self.model} needs text conditioning: send {keys} "
                               "(and the same with a negative_ prefix for cfg > 1)",
                               "encode the prompt with the model's text encoders (xdit-backend sample --embeds FILE)",
                               node_hint="connect the prompt's conditioning (CLIP Text Encode) to the sampler's "
                                         "positive input")
        latent = spec.latent_shape(self.batch, self.width, self.height, self.frames)
        sent = any(REFERENCE.fullmatch(name.removeprefix("negative_")) for name in self.tensors)
        drawn = () if sent else registry.resolve_builtin(self.model).references  # flux-kontext-tiny's own
        return self.with_references(spec, *registry.random_conditioning(self.model, self.batch, self.seed, spec,
                                                                        references=drawn, latent=latent))

    def with_references(self, spec, positive: dict, negative: dict | None) -> tuple[dict, dict | None]:
        """Stand-in text (a built-in's, registry.random_conditioning) with the reference latents the
        request sent: ``reference_<i>`` for both sides, ``negative_reference_<i>`` for the negative
        one where given (xdit-backend sample --reference-latent without --embeds)."""
        sent = {name: t for name, t in self.tensors.items() if REFERENCE.fullmatch(name)}
        positive = {**positive, **self._references(spec, "", sent)}
        if negative is None:
            return positive, None
        sent_negative = {name.removeprefix("negative_"): t for name, t in self.tensors.items()
                         if REFERENCE.fullmatch(name.removeprefix("negative_")) and name.startswith("negative_")}
        negative = {**negative, **self._references(spec, "negative_", sent_negative or sent)}
        return positive, negative

    def _side(self, spec, prefix: str) -> dict[str, torch.Tensor]:
        """One side's tensors by key (without the prefix): the spec's shapes (None: any length), its
        optional keys and masks, and its reference latents; any other key is refused by name."""
        given = {name.removeprefix(prefix): tensor for name, tensor in self.tensors.items()
                 if name not in GENERATION_TENSORS and not CONTROL.fullmatch(name)
                 and name.startswith("negative_") == bool(prefix)}
        context = given["context"]
        text_tokens = context.shape[1] if context.dim() == 3 else -1
        shapes = spec.conditioning_shapes(self.batch, text_tokens)
        side = {}
        for key, shape in shapes.items():
            tensor = given.get(key)
            if tensor is None and key in spec.optional_conditioning:
                continue
            if tensor is None or not shape_fits(tuple(tensor.shape), shape):
                got = "nothing" if tensor is None else f"shape {list(tensor.shape)}"
                raise RequestError(f"{prefix}{key}: model {self.model} needs shape {shape_text(shape)}, got {got}",
                                   "encode the prompt with the text encoders that belong to this model")
            side[key] = tensor
        for key in spec.optional_conditioning:  # a mask: one value per token of the tensor it masks
            if key in shapes or key not in given:
                continue
            of = key.removesuffix("_mask")
            if of not in side:
                raise RequestError(f"{prefix}{key} was sent without {prefix}{of}, the tensor it masks",
                                   f"send {prefix}{of} with it, or leave both out")
            want = (self.batch, side[of].shape[1])
            if tuple(given[key].shape) != want:
                raise RequestError(f"{prefix}{key} has shape {list(given[key].shape)}; it needs {list(want)}, "
                                   f"one value per token of {prefix}{of}")
            side[key] = given[key]
        side.update(self._references(spec, prefix, given))
        unknown = sorted(set(given) - set(side))
        if unknown:
            takes = [*shapes, *(k for k in spec.optional_conditioning if k not in shapes)]
            if spec.takes_references:
                takes.append("reference_0…")
            raise RequestError(f"{prefix}{unknown[0]}: a {spec.family} model takes no {unknown[0]!r}",
                               f"send {', '.join(takes)}")
        return side

    def modulates_per_token(self, spec) -> bool:
        """Whether the model takes a timestep per token: a noise mask on Wan 2.2 TI2V-5B (Generation's
        ``kept_clean``), which the memory model counts."""
        return spec.masked_timesteps_per_frame and "noise_mask" in self.tensors

    def reference_tokens(self, spec) -> int:
        """The most tokens the reference latents add to one side's sequence (a reference [B, C, h, w] is
        h · w / the patch's area tokens; the negative side has the positive's unless it sent its own)."""
        def tokens(prefix: str) -> int:
            return sum(t.shape[-2] // spec.patch[1] * (t.shape[-1] // spec.patch[2])
                       for name, t in self.tensors.items()
                       if name.startswith(prefix) and REFERENCE.fullmatch(name.removeprefix(prefix)))

        return max(tokens(""), tokens("negative_"))

    def _references(self, spec, prefix: str, given: dict) -> dict[str, torch.Tensor]:
        """reference_0 … reference_{n-1} [B, C, h, w]: the latent channels, h and w multiples of the patch."""
        names = sorted((int(m.group(1)), key) for key in given if (m := REFERENCE.fullmatch(key)))
        if not names:
            return {}
        if not spec.takes_references:
            raise RequestError(f"{prefix}{names[0][1]}: model {self.model} ({spec.family}) takes no reference latents",
                               "leave --reference-latent out, or use an edit model",
                               node_hint="leave the reference images out (ReferenceLatent, TextEncodeQwenImageEdit's "
                                         "image), or load an edit model in the xDiT loader")
        if len(names) > schema.MAX_REFERENCES:
            which = "negative" if prefix else "positive"
            raise RequestError(f"{len(names)} reference latents on the {which} side; at most "
                               f"{schema.MAX_REFERENCES} are taken", f"send at most {schema.MAX_REFERENCES}")
        if [i for i, _ in names] != list(range(len(names))):
            missing = min(set(range(len(names))) - {i for i, _ in names})
            raise RequestError(f"{prefix}reference_{missing} is missing: references are numbered from 0 without gaps "
                               f"(got {', '.join(key for _, key in names)})",
                               "send reference_0, reference_1, … in order")
        channels, rows, columns = spec.latent_format.channels, spec.patch[1], spec.patch[2]
        largest = schema.MAX_SIDE // spec.vae_factor  # latent rows or columns of the largest image a request may ask
        for _, key in names:
            shape = tuple(given[key].shape)
            if len(shape) == 4 and max(shape[2:]) > largest:
                raise RequestError(f"{prefix}{key} is {shape[2]}×{shape[3]} latent pixels ({shape[2] * spec.vae_factor}"
                                   f"×{shape[3] * spec.vae_factor} image pixels); a reference may be at most "
                                   f"{largest}×{largest} ({schema.MAX_SIDE} pixels a side, as the image asked for)",
                                   "scale the reference image down before encoding it (FluxKontextImageScale, "
                                   "ImageScaleToTotalPixels)")
            if (len(shape) != 4 or shape[:2] != (self.batch, channels) or not shape[2] or not shape[3]
                    or shape[2] % rows or shape[3] % columns):
                raise RequestError(f"{prefix}{key} has shape {list(shape)}; a {spec.family} reference latent is "
                                   f"[{self.batch}, {channels}, h, w] with h a multiple of {rows} and w of {columns}",
                                   "encode the reference image with this model's VAE (a latent of the batch's size), "
                                   f"padded to a multiple of {max(rows, columns)} as ComfyUI's model pads it")
        return {key: given[key] for _, key in names}

    def generation(self, spec, positive: dict, negative: dict | None) -> Generation:
        sampling = spec.model_sampling(self.shift)
        sigmas = self.tensors.get("sigmas")
        if sigmas is None:
            sigmas = schedulers.sigmas(self.scheduler, sampling, self.steps, self.denoise, sampler=self.sampler)
        latent = self.tensors.get("latent", torch.zeros(self.latent_shape(spec)))
        parts = self.latent_parts(spec)
        if parts is not None:
            audio = self.tensors.get("audio_latent", torch.zeros(self.batch, *parts.shapes[1]))
            latent = parts.pack([latent, audio])
        return Generation(
            latent=latent,
            parts=parts,
            passes=self.passes(sampling),
            seed=self.seed,
            sigmas=cut(sigmas.float(), self.start_step, self.end_step, self.leftover_noise),
            sampling=sampling,
            sampler=self.sampler,
            cfg=self.cfg,
            guidance=self.guidance if self.guidance is not None else spec.default_guidance,
            positive=spec.prepare_conditioning(positive),  # once, before any layout sizes a buffer from it
            negative=None if negative is None else spec.prepare_conditioning(negative),
            add_noise=self.add_noise,
            cache=self.cache_options(),
            noise_mask=self.tensors.get("noise_mask"),
            model_reads_mask=spec.model_reads_noise_mask,
            kept_clean=spec.masked_timesteps_per_frame,
        )

    def cache_options(self) -> CacheOptions | None:
        if self.cache == "none":
            return None
        threshold = schema.CACHE_THRESHOLDS[self.cache] if self.cache_threshold is None else self.cache_threshold
        return CacheOptions(self.cache, threshold, self.cache_start, self.cache_end)


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
    names = field.choices if isinstance(field.choices, tuple) else CHOICES.get(field.choices, ())
    if field.kind == "choice" and value not in names:
        raise RequestError(f"{field.name} {value!r} is not supported", f"use one of: {', '.join(names)}")
    if field.kind == "dtype" and value not in field.choices:
        raise RequestError(f"{field.name} {value!r} is not supported", f"use {', '.join(field.choices)}")
    if field.kind == "layout":
        return _parallel(value)
    if field.kind == "loras":
        return _loras(value)
    if field.kind == "controls":
        try:
            return tuple(model_patch.parse(value))
        except UserError as exc:
            raise RequestError.of(exc) from None
    return value


def _write(field: schema.Field, value):
    """One attribute as its wire value (None: left out)."""
    if field.kind == "layout":
        return "auto" if value is None else value.to_json()
    if field.kind == "loras":
        return [{"path": spec.path, "strength": spec.strength} for spec in value]
    if field.kind == "controls":  # every rank must see the same range and type, or their collectives would part
        return [{"path": spec.path, "strength": spec.strength,
                 **({"start": spec.start, "end": spec.end} if (spec.start, spec.end) != (0.0, 1.0) else {}),
                 **({"type": spec.mode} if spec.mode is not None else {})}
                for spec in value]
    return value


def _loras(entries) -> tuple:
    try:
        return tuple(lora.parse(entries))
    except UserError as exc:
        raise RequestError.of(exc) from None


def _parallel(value) -> ParallelConfig | None:
    if value == "auto":
        return None
    if isinstance(value, str):
        raise RequestError(f"parallel {value!r} is not a layout", 'send "auto" or degrees such as {"ulysses": 2}')
    try:
        return ParallelConfig.from_json(value)
    except ConfigError as exc:
        raise RequestError.of(exc) from None
    except TypeError as exc:
        raise RequestError(f"parallel: {exc}") from None


def check_controls(controls, latent_of, spec, model: str, cache: str, parallel, references: bool,
                   size: tuple[int, int]) -> None:
    """A request's controls against its model: model patches only for a family that applies them, a ControlNet made
    for the model's family, none under PipeFusion, beside references or with the step cache; each latent (from
    ``latent_of(i)``, None: not sent) one image of the generation's latent ``size`` (rows, columns) — a built-in
    draws its own (the patch's own channels are checked when it is loaded)."""
    if not controls:
        return
    if cache != "none":
        raise RequestError(f"controls with the step cache ({cache}): a control adds its residuals after the "
                           "blocks, and on the steps the cache reuses, the blocks' cached output already holds "
                           "them; that is not wired yet", "use cache none with a control")
    families = [model_patch.control_family(entry) for entry in controls]  # None: a model patch
    for entry, family in zip(controls, families):
        if family is None and not spec.takes_model_patches:
            raise RequestError(f"control {entry.path}: {spec.family} models take no DiffSynth model patch (it is "
                               "made for Qwen-Image)", "leave it out, or use a Qwen-Image model")
        if family is not None and family != spec.family:
            raise RequestError(f"control {entry.path} is a {family} ControlNet, but {model} is a "
                               f"{spec.family} model", f"use a ControlNet made for {spec.family} models")
    controlnets = [entry.path for entry, family in zip(controls, families) if family is not None]
    if controlnets and parallel is not None and parallel.pipefusion > 1:
        raise RequestError(f"ControlNet {controlnets[0]} with pipefusion={parallel.pipefusion}: a ControlNet "
                           "runs a transformer of its own over the whole latent each step, which PipeFusion's "
                           "patches do not hold yet", "use ulysses, ring, cfg or dp with a ControlNet (a DiffSynth "
                           "model patch runs under PipeFusion)")
    if controlnets and references:
        raise RequestError(f"ControlNet {controlnets[0]} with reference latents: the ControlNet sees the noisy "
                           "latent's tokens only, and beside an edit's references their split is not wired yet",
                           "leave the references or the ControlNet out")
    rows, columns = size
    for index, entry in enumerate(controls):
        latent = latent_of(index)
        if latent is None:
            if not entry.built_in:
                raise RequestError(f"control {index} ({entry.path}) came without its latent control_{index}",
                                   "send the control image's VAE latent (the xDiT node encodes it; on the "
                                   "command line --control-image FILE)")
            continue
        if model_patch.takes_pixels(entry):  # XLabs': the image itself, at the generation's size
            wanted, what = (rows * spec.vae_factor, columns * spec.vae_factor), "image [1, 3, H, W]"
        else:
            wanted, what = (rows, columns), "latent [1, C, h, w]"
        if latent.dim() != 4 or latent.shape[0] != 1 or tuple(latent.shape[-2:]) != wanted:
            raise RequestError(f"control_{index} has shape {list(latent.shape)}; it must be one {what} of "
                               f"{wanted[0]} × {wanted[1]}, the generation's size",
                               "encode (or, for an XLabs ControlNet, resize) the control image at the "
                               "generation's width and height")
