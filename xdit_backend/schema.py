"""The ``sample`` request's fields, declared once.

Everything else is derived from ``SAMPLE``:
- the JSON types the wire accepts (``protocol.REQUEST_FIELDS["sample"]``, checked before anything else);
- the request object's reading and range checks (``request.SampleRequest.parse``; its attributes are
  written out there, in this order, and tests/unit/test_schema.py holds them to it);
- what rank 0 broadcasts to the other ranks (``SampleRequest.to_fields``, read back by ``parse``);
- the ``xdit-backend sample`` flags (``add_flags`` / ``flag_fields``);
- the nodes' names, defaults and ranges (``fields``, the constants below).

Light on purpose: protocol.py and the ComfyUI nodes import it, so it imports no torch. The
names a ``choice`` may take live with their code (sampling/samplers.py, sampling/schedulers.py);
request.py looks them up by the registry name given here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

MAX_SIDE = 16384
MAX_STEPS = 10000
MAX_BATCH = 64
SEED_RANGE = (0, 2**64 - 1)  # ComfyUI's seed widget range
MAX_FRAMES = 1025
MAX_AUDIO_FRAMES = 8192  # an audio latent's frames (LTX-2: 25 a second, so 5 min 27 s)
# Reference latents per side (image editing): Flux.2 takes up to 10 reference images (Black Forest
# Labs' model card), Qwen-Image-Edit-2509 three; two sides of them fit protocol.Limits.max_tensors.
MAX_REFERENCES = 10
CACHE_METHODS = ("none", "fbcache", "teacache")  # parallel/step_cache.py
# A cache method's threshold when the request gives none (here, not in step_cache.py, for the nodes, which
# import no torch): ParaAttention's recommended first-block threshold for Flux; TeaCache's 1.5× setting for Flux.
CACHE_THRESHOLDS = {"fbcache": 0.08, "teacache": 0.25}
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")  # auto: device.compute_dtype
WEIGHT_DTYPE_NAMES = ("default", "fp8_e4m3fn", "fp8_e5m2")  # ComfyUI's UNETLoader choices (models/storage.py)
NUMBER = (int, float)

# How request.py reads a field's wire value into the request (and writes it back for the ranks):
KINDS = ("text", "int", "float", "bool", "choice", "dtype", "layout", "loras", "controls", "inputs")


@dataclass(frozen=True)
class Field:
    """One field of a ``sample`` request."""

    name: str  # on the wire (JSON), and ``--name-with-dashes`` on the command line
    wire: type | tuple  # the JSON types accepted
    kind: str  # one of KINDS
    default: object = None  # the value when the field is absent; None: absent means "not given"
    low: float | None = None  # a number's inclusive range
    high: float | None = None
    choices: tuple | str = ()  # a choice's names, or the registry that holds them ("samplers", "schedulers")
    attr: str = ""  # the request attribute, when it differs from ``name``
    required: str = ""  # the error when the field is missing ("": optional)
    help: str = ""
    flag: str = ""  # the command-line flag, when it differs from --name (booleans: the one that sets it)
    cli: bool = True  # False: the CLI builds the field from its own flags (the layout's degrees)

    @property
    def attribute(self) -> str:
        return self.attr or self.name

    @property
    def option(self) -> str:
        if self.flag:
            return self.flag
        return ("--no-" if self.default is True else "--") + self.name.replace("_", "-")


SAMPLE: tuple[Field, ...] = (
    Field("model", str, "text", required="a sample request needs a 'model' (a built-in name such as flux-tiny)",
          help="a built-in model (each family has a tiny one: flux-tiny, wan-tiny, …), a model file or a folder"),
    Field("width", int, "int", 1024, 16, MAX_SIDE, help="pixels"),
    Field("height", int, "int", 1024, 16, MAX_SIDE, help="pixels"),
    Field("batch", int, "int", 1, 1, MAX_BATCH, help="images (or videos) generated together"),
    Field("steps", int, "int", 20, 1, MAX_STEPS, help="steps of the schedule"),
    Field("seed", int, "int", 0, *SEED_RANGE, help="the noise seed (ComfyUI's: the same seed, the same noise)"),
    Field("cfg", NUMBER, "float", 1.0, 0.0, 100.0, help="true CFG scale (uses the negative when > 1)"),
    Field("guidance", NUMBER, "float", None, 0.0, 100.0,
          help="Flux guidance embedding (default: the model's, 3.5; only Flux.1-dev-style models take one)"),
    Field("shift", NUMBER, "float", None, 1e-3, 100.0,
          help="flow shift (default: the model's, Flux 1.15)"),
    Field("parallel", (dict, str), "layout", "auto", cli=False,
          help='the layout: degrees such as {"ulysses": 2}, or "auto" (the backend picks one for its world size)'),
    Field("profile", bool, "bool", False,
          help="report step times, traffic, memory and the request each rank ran (the bench asks for it)"),
    Field("dtype", str, "dtype", "auto", choices=DTYPE_NAMES,
          help="weights and compute (auto: float32 on the CPU; bfloat16 on CUDA from sm 8.0, float16 before)"),
    Field("weight_dtype", str, "dtype", "default", choices=WEIGHT_DTYPE_NAMES,
          help="how Linear weights are stored on the device: default keeps the file's precision (an fp8 "
               "or GGUF file stays so, upcast one layer at a time); fp8_e4m3fn / fp8_e5m2 store a 16/32-bit "
               "file's in that float8 (half a bf16 model's memory)"),
    Field("loras", list, "loras", [], flag="--lora",
          help="LoRA files patched onto the loaded model (no copy), in order: [{path, strength}, ...]; on the command "
               "line PATH[:STRENGTH], repeated (strength 1 by default)"),
    Field("controls", list, "controls", [], flag="--control",
          help="controls that steer the image by a control latent, in order: a ControlNet file (ComfyUI's "
               "models/controlnet: Flux.1's InstantX / Shakker-Labs Union and XLabs', Stability's SD3.5 Large ones, "
               "HunyuanDiT 1.2's, Qwen-Image's InstantX Union), a Qwen-Image DiffSynth ControlNet patch or a Z-Image "
               "Fun ControlNet (models/model_patches), or a built-in (flux-controlnet-tiny, sd3-controlnet-tiny, "
               "hunyuan-dit-controlnet-tiny, qwen-image-controlnet-tiny, qwen-image-diffsynth-tiny, "
               "z-image-fun-controlnet-tiny): "
               "[{path, strength[, start, end, type]}, ...] "
               "(start, end: a ControlNet's percent range, as ControlNetApplyAdvanced's; type: a union ControlNet's "
               "control type, SetUnionControlNetType's number), the i-th's control latent sent as tensor control_<i>; "
               "on the command line FILE|NAME, repeated, each followed by its --control-image and options"),
    Field("frames", int, "int", 1, 1, MAX_FRAMES, help="video models (Wan): frames, 1 + a multiple of 4"),
    Field("start_step", int, "int", 0, 0, MAX_STEPS,
          help="first step of the --steps schedule to run (KSamplerAdvanced; Wan 2.2's two experts are two runs)"),
    Field("end_step", int, "int", None, 0, MAX_STEPS, help="step to stop at (default: the last)"),
    Field("add_noise", bool, "bool", True,
          help="False / --no-add-noise: the input latent already holds its noise (a second expert's run)"),
    Field("return_with_leftover_noise", bool, "bool", False, attr="leftover_noise", flag="--leftover-noise",
          help="stop at --end-step's noise level instead of denoising fully (for a second run)"),
    Field("sampler", str, "choice", "euler", choices="samplers", help="ComfyUI's sampler names"),
    Field("scheduler", str, "choice", "simple", choices="schedulers",
          help='ComfyUI\'s scheduler names; a "sigmas" tensor overrides it'),
    Field("denoise", NUMBER, "float", 1.0, 0.0, 1.0,
          help="< 1: img2img, the tail of a longer schedule, as KSampler does it"),
    Field("compile", bool, "bool", False,
          help="torch.compile the transformer's blocks (the first request compiles; the backend keeps the "
               "compiled model for later requests, at any size)"),
    Field("cache", str, "choice", "none", choices=CACHE_METHODS,
          help="step cache: reuse the blocks after the first on steps where they barely change (fbcache: the "
               "first block's residual decides; teacache: the time embedding's change, rescaled per family)"),
    Field("cache_threshold", NUMBER, "float", None, 0.0, 10.0,
          help="higher reuses more steps, further from the uncached result (default: "
               + ", ".join(f"{method} {threshold}" for method, threshold in CACHE_THRESHOLDS.items()) + ")"),
    Field("cache_start", int, "int", 2, 0, MAX_STEPS, help="steps always computed at the start"),
    Field("cache_end", int, "int", 1, 0, MAX_STEPS, help="steps always computed at the end"),
    # LTX-2's guidance beyond CFG (sampling/guidance.py: ComfyUI's LTXV guider and guidance nodes)
    Field("audio_cfg", NUMBER, "float", None, 0.0, 100.0,
          help="LTX-2: the audio's CFG scale (LTXVDualCFGGuider's audio_cfg; cfg is the video's; default: cfg)"),
    Field("stg_scale", NUMBER, "float", 0.0, 0.0, 100.0,
          help="LTX-2: spatio-temporal guidance (LTXVSpatioTemporalGuidance's scale; 0: off): one pass more a step, "
               "the self-attention of --stg-blocks a value passthrough"),
    Field("stg_blocks", str, "text", "29", help="LTX-2: the blocks STG perturbs (numbers, comma-separated)"),
    Field("stg_start", NUMBER, "float", 0.0, 0.0, 1.0, help="LTX-2: STG's start percent"),
    Field("stg_end", NUMBER, "float", 1.0, 0.0, 1.0, help="LTX-2: STG's end percent"),
    Field("modality_scale", NUMBER, "float", 1.0, 1.0, 100.0,
          help="LTX-2: modality guidance (LTXVModalityGuidance's scale; 1: off): one pass more a step, the "
               "audio↔video attention cut"),
    Field("modality_start", NUMBER, "float", 0.0, 0.0, 1.0, help="LTX-2: modality guidance's start percent"),
    Field("modality_end", NUMBER, "float", 1.0, 0.0, 1.0, help="LTX-2: modality guidance's end percent"),
)
FIELDS = {field.name: field for field in SAMPLE}


def wire_types() -> dict[str, type | tuple]:
    """The JSON types of a ``sample`` message's fields, for protocol.py."""
    return {field.name: field.wire for field in SAMPLE}


def fields(**values) -> dict:
    """A request's wire fields from keyword values (the nodes build theirs with it): every name
    must be a field of SAMPLE, and None leaves an optional field out."""
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise KeyError(f"{', '.join(unknown)}: not a field of a sample request (fields: {', '.join(FIELDS)})")
    return {name: value for name, value in values.items() if value is not None}


# --------------------------------------------------------------------------- the command line


def path_and_strength(text: str) -> dict:
    """PATH or PATH:STRENGTH → {"path", "strength"}."""
    path, _, strength = text.rpartition(":") if ":" in text else (text, "", "1")
    try:
        return {"path": path, "strength": float(strength)}
    except ValueError:
        return {"path": text, "strength": 1.0}


def control_entry(text: str) -> dict:
    """FILE or a built-in's NAME → {"path", "strength": 1} (its options follow it: cli.py's --control-*)."""
    return {"path": text, "strength": 1.0}


_ARG_TYPES = {"int": int, "float": float, "text": str, "choice": str, "dtype": str}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per field the CLI takes as it is (``cli``). Every flag defaults to None (absent):
    the backend applies the field's default, so the defaults live in SAMPLE only."""
    for field in SAMPLE:
        if not field.cli:
            continue
        listed = field.kind in ("bool", "loras", "controls")
        shown = "" if field.default is None or listed else f" (default {field.default})"
        kwargs = {"dest": field.name, "default": None, "help": field.help + shown}
        if field.kind == "bool":
            kwargs.update(action="store_const", const=not field.default)
        elif field.kind == "loras":
            kwargs.update(action="append", type=path_and_strength, metavar="PATH[:STRENGTH]")
        elif field.kind == "controls":
            kwargs.update(action="append", type=control_entry, metavar="FILE|NAME")
        else:
            kwargs["type"] = _ARG_TYPES[field.kind]
            if isinstance(field.choices, tuple) and field.choices:
                kwargs["choices"] = field.choices
        if field.required:
            kwargs["required"] = True
        parser.add_argument(field.option, **kwargs)


def flag_fields(args: argparse.Namespace) -> dict:
    """The wire fields the flags of ``add_flags`` gave (absent flags are left out)."""
    return {field.name: getattr(args, field.name) for field in SAMPLE
            if field.cli and getattr(args, field.name, None) is not None}


# --------------------------------------------------------------------------- the ``evaluate`` request

# One model evaluation for the xDiT MODEL (nodes/remote_model.py): ComfyUI's own sampler runs in ComfyUI's
# process and calls the backend once per model call. It takes the model choice and the layout of a sample
# request; its inputs are tensors (x, timestep, guidance) and the conditioning by content hash.
EVALUATE_SHARED = ("model", "parallel", "profile", "dtype", "weight_dtype", "loras", "compile", "cache",
                   "cache_threshold", "cache_start", "cache_end")
MAX_EVALUATE_ROWS = 4 * MAX_BATCH  # a call's batch rows: ComfyUI batches cond, uncond and area chunks
EVALUATE: tuple[Field, ...] = (
    *(FIELDS[name] for name in EVALUATE_SHARED),
    Field("inputs", dict, "inputs", {},
          help="the model's conditioning by key (context, pooled, …): each the content hash "
               "(wire/content_hash.py) of a tensor sent inline, once, or held by the backend from an earlier call"),
    # the call's controls (ComfyUI's Apply ControlNet on the xDiT MODEL's conditioning, those active at its noise
    # level), each latent the input control_<i>
    FIELDS["controls"],
    # where the call stands in ComfyUI's sampling run, for the step cache (ignored without one)
    Field("generation", str, "text", "", help="the sampling run the call belongs to (its step cache's state)"),
    Field("step", int, "int", 0, 0, MAX_STEPS, help="the schedule position of the call's noise level"),
    Field("steps", int, "int", 1, 1, MAX_STEPS, help="the run's steps (its schedule's length − 1)"),
    Field("slot", int, "int", 0, 0, 4 * MAX_BATCH, help="the call's place among the calls of its step (0 decides)"),
    Field("cond_start", int, "int", 0, 0, MAX_EVALUATE_ROWS, help="the first row of x that is the cond side"),
    Field("cond_rows", int, "int", 0, 0, MAX_EVALUATE_ROWS, help="the cond side's rows from cond_start"),
)


def evaluate_wire_types() -> dict[str, type | tuple]:
    """The JSON types of an ``evaluate`` message's fields, for protocol.py."""
    return {field.name: field.wire for field in EVALUATE}
