"""Resolving a model argument (a built-in name, a model file or a diffusers folder) and building the model."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from . import flux_checkpoint, lora
from .flux import FluxModel, FluxSpec


class ModelError(UserError):
    """A model argument that cannot be resolved or loaded; the hint says what to pass instead."""


@dataclass(frozen=True)
class BuiltinModel:
    """A tiny random-weight model for demos and tests: built from a config and a fixed seed, so
    every rank and every process builds bit-identical weights without any file."""

    config: dict
    text_tokens: int  # length of the random conditioning a request without embeddings gets
    seed: int = 0
    description: str = field(default="", compare=False)


BUILTINS: dict[str, BuiltinModel] = {
    "flux-tiny": BuiltinModel(
        config=dict(
            patch_size=1,
            in_channels=64,  # 16 latent channels × a 2×2 patch
            num_layers=2,
            num_single_layers=5,  # 5 single ≈ 2 double in parameters: PipeFusion stages can balance
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ),
        text_tokens=8,
        description="Flux.1-dev architecture, 2+5 blocks, width 64, random weights (a test model)",
    ),
}


def resolve_builtin(name: str) -> BuiltinModel:
    if name in BUILTINS:
        return BUILTINS[name]
    raise ModelError(f"{name!r} is not a built-in model", f"built-in models: {', '.join(BUILTINS)}")


@dataclass(frozen=True)
class Source:
    """A resolved model argument: what kind it is, where, and its diffusers config."""

    kind: str  # "builtin", "file" (BFL/ComfyUI layout) or "folder" (diffusers layout)
    ref: str
    config: dict
    prefix: str = ""  # the file's key prefix ("model.diffusion_model." in a ComfyUI checkpoint)
    describes: str = ""


def resolve(ref: str) -> Source:
    """A built-in name, a safetensors file in the original Flux layout, or a diffusers folder."""
    if ref in BUILTINS:
        return Source("builtin", ref, BUILTINS[ref].config, describes=BUILTINS[ref].description)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(f"no model at {ref}: not a built-in name, and no such file or folder",
                         f"give a .safetensors file from ComfyUI's models/diffusion_models (or unet, checkpoints), "
                         f"a diffusers model folder, or a built-in model: {', '.join(BUILTINS)}")
    stat = path.stat()
    return _resolve_path(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _resolve_path(path: str, mtime_ns: int, size: int) -> Source:
    """Read a file's header (or a folder's config) once per version of the file."""
    if Path(path).is_dir():
        return _resolve_folder(path)
    try:
        with safe_open(path, "pt") as handle:
            shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
    except Exception as exc:  # safetensors raises its own error types for damaged files
        raise ModelError(f"{path} is not a readable safetensors file ({exc})",
                         "the file may be truncated (an interrupted download?): check its size, or re-download it") from None
    prefix = flux_checkpoint.detect_prefix(shapes)
    if prefix is None:
        found = sorted({key.split(".")[0] for key in shapes})[:12]
        raise ModelError(f"{path}: no supported model layout found (top-level keys: {', '.join(found) or 'none'})",
                         "supported: Flux (dev, schnell) single files in the BFL / ComfyUI layout, "
                         "and diffusers model folders")
    try:
        config = flux_checkpoint.config_from_shapes(shapes, prefix, path)
    except UserError as exc:
        raise ModelError(exc.message, exc.hint) from None
    except KeyError as exc:
        raise ModelError(f"{path}: Flux tensor {exc} is missing", "the file is incomplete: re-download it") from None
    return Source("file", path, config, prefix, flux_checkpoint.variant(config))


def _resolve_folder(path: str) -> Source:
    config_file = Path(path) / "config.json"
    if not config_file.exists() and (Path(path) / "transformer" / "config.json").exists():
        config_file = Path(path) / "transformer" / "config.json"  # a whole pipeline folder
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: no readable diffusers config.json ({exc})",
                         "a diffusers model folder holds config.json and its safetensors") from None
    if config.get("_class_name") != "FluxTransformer2DModel":
        raise ModelError(f"{path} holds a {config.get('_class_name')!r}, not a supported model",
                         "supported: FluxTransformer2DModel folders")
    init = {k: v for k, v in config.items() if not k.startswith("_")}
    return Source("folder", str(config_file.parent), init, describes="Flux (diffusers folder)")


def identity(ref: str) -> tuple[str, int]:
    """What a loaded model is cached under: its name or resolved path, and the file's version
    (modification time; 0 for a built-in), so a changed file is loaded again."""
    source = resolve(ref)
    if source.kind == "builtin":
        return ref, 0
    return source.ref, Path(source.ref).stat().st_mtime_ns


def block_sizes(ref: str) -> list[int]:
    """Parameter count of each block, double-stream then single-stream, counted on the meta device."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**resolve(ref).config)
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


def spec(ref: str) -> FluxSpec:
    """What the model takes and allows, from its config: nothing is built or loaded."""
    return FluxSpec.from_config(resolve(ref).config)


def build(ref: str, device: torch.device, dtype: torch.dtype = torch.float32, loras=()) -> FluxModel:
    """Build or load a model onto ``device`` in ``dtype`` (seeded weights for a built-in, else its
    file), with ``loras`` (lora.LoraSpec) merged into its weights."""
    from diffusers import FluxTransformer2DModel

    source = resolve(ref)
    if source.kind == "builtin":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BUILTINS[ref].seed)
            transformer = FluxTransformer2DModel(**source.config).to(device)
        if dtype != transformer.dtype:
            transformer = transformer.to(dtype)
    elif source.kind == "folder":
        transformer = FluxTransformer2DModel.from_pretrained(source.ref, torch_dtype=dtype, local_files_only=True)
        transformer = transformer.to(device)
    else:
        transformer = _load_bfl_file(source, dtype).to(device)
    try:
        reports = lora.merge(transformer, list(loras)) if loras else []
    except UserError as exc:
        raise ModelError(exc.message, exc.hint) from None
    return FluxModel(transformer, ref, FluxSpec.from_config(source.config), reports)


def _load_bfl_file(source: Source, dtype: torch.dtype):
    """Construct on the meta device, then take each tensor from the file (memory-mapped, converted)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**source.config)
    width = source.config["num_attention_heads"] * source.config["attention_head_dim"]
    table = flux_checkpoint.sources(transformer.state_dict().keys(), source.prefix)
    try:
        with safe_open(source.ref, "pt", device="cpu") as handle:
            weights = {key: flux_checkpoint.read_tensor(handle, src, width, dtype) for key, src in table.items()}
    except Exception as exc:
        raise ModelError(f"{source.ref}: could not read its weights ({exc})",
                         "the file may be truncated or damaged: re-download it") from None
    transformer.load_state_dict(weights, strict=True, assign=True)
    return transformer


def random_conditioning(name: str, batch: int, seed: int, spec: FluxSpec) -> tuple[dict, dict]:
    """Deterministic stand-in text embeddings for a built-in model, derived from the seed.

    Positive and negative sides come from one generator (seeded apart from the noise), so the same
    seed always gives the same prompt and a different seed a different one.
    """
    generator = torch.Generator().manual_seed((seed * 2654435761 + 97) % 2**63)
    shapes = spec.conditioning_shapes(batch, resolve_builtin(name).text_tokens)
    positive = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    negative = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    return positive, negative
