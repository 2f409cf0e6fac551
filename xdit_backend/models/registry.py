"""Resolving a model argument (a built-in name, a model file or a diffusers folder) and building the model."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import UserError
from . import (
    chroma_checkpoint,
    cogvideox_checkpoint,
    file_kind,
    flux2_checkpoint,
    flux_checkpoint,
    folder,
    gguf_blocks,
    gguf_file,
    hunyuan_dit_checkpoint,
    hunyuan_video15_checkpoint,
    lora,
    ltx2_checkpoint,
    minimax_h3_checkpoint,
    pixart_checkpoint,
    qwen_image21_checkpoint,
    qwen_image_checkpoint,
    safetensors_file,
    scaled_fp8,
    sd3_checkpoint,
    storage,
    wan_checkpoint,
    wan_vace_checkpoint,
    weights,
    z_image_checkpoint,
)
from .base import DiffusionModel, FamilySpec
from .builtins import BUILTINS, BuiltinModel
from .chroma import ChromaModel, ChromaSpec
from .chroma import build_transformer as build_chroma
from .checkpoint import Checkpoint
from .cogvideox import CogVideoXModel, CogVideoXSpec
from .flux import FluxModel, FluxSpec
from .flux2 import Flux2Model, Flux2Spec
from .hunyuan_dit import HunyuanDiTModel, HunyuanDiTSpec
from .hunyuan_video15 import HunyuanVideo15Model, HunyuanVideo15Spec
from .ltx2 import LTX2Model, LTX2Spec, build_transformer
from .minimax_h3 import MiniMaxH3Model, MiniMaxH3Spec
from .minimax_h3 import build_transformer as build_minimax_h3
from .pixart import PixArtModel, PixArtSpec
from .qwen_image import QwenImageModel, QwenImageSpec
from .qwen_image21 import QwenImage21Model, QwenImage21Spec
from .qwen_image21 import build_transformer as build_qwen_image21
from .sd3 import SD3Model, SD3Spec
from .wan import WanModel, WanSpec
from .wan_vace import WanVaceModel, WanVaceSpec
from .z_image import ZImageModel, ZImageSpec


@dataclass(frozen=True)
class Family:
    """A model family as data: its spec class (which holds its name and block lists), model wrapper,
    key-layout converter and diffusers class."""

    spec_class: type[FamilySpec]
    model: type[DiffusionModel]
    checkpoint: Checkpoint  # its <family>_checkpoint module
    diffusers_class: str
    describes: str  # the variants, for messages
    build: Callable | None = None  # builds the transformer where diffusers' class alone does not (or not quietly)

    @property
    def name(self) -> str:
        return self.spec_class.family

    @property
    def block_lists(self) -> tuple[str, ...]:
        """The transformer's ModuleLists of blocks, in execution order (its StagePlan's)."""
        return self.spec_class.stage_plan.block_lists

    def spec(self, config: dict) -> FamilySpec:
        return self.spec_class.from_config(config)

    def constructor(self) -> Callable:
        """What builds the family's transformer from its config: its own ``build``, else diffusers' class."""
        import diffusers

        return self.build or getattr(diffusers, self.diffusers_class)


def family_of_class(diffusers_class: str | None) -> Family | None:
    """The family whose transformer is diffusers' ``diffusers_class``; None: no family's."""
    return next((f for f in FAMILIES.values() if f.diffusers_class == diffusers_class), None)


# in detection order: a Flux.2 file also holds every key that marks a Flux.1 one, a Wan VACE file a Wan one's
FAMILIES = {family.name: family for family in (
    Family(Flux2Spec, Flux2Model, flux2_checkpoint, "Flux2Transformer2DModel", "Flux.2 (dev, klein 4B and 9B)"),
    Family(ChromaSpec, ChromaModel, chroma_checkpoint, "ChromaTransformer2DModel", "Chroma (Chroma1-HD, -Base)",
           build_chroma),
    Family(FluxSpec, FluxModel, flux_checkpoint, "FluxTransformer2DModel", "Flux.1 (dev, schnell)"),
    Family(SD3Spec, SD3Model, sd3_checkpoint, "SD3Transformer2DModel", "SD3 (medium), SD3.5 (medium, large)"),
    Family(PixArtSpec, PixArtModel, pixart_checkpoint, "PixArtTransformer2DModel", "PixArt-α, PixArt-Σ"),
    Family(WanVaceSpec, WanVaceModel, wan_vace_checkpoint, "WanVACETransformer3DModel", "Wan 2.1 VACE (1.3B, 14B)"),
    Family(WanSpec, WanModel, wan_checkpoint, "WanTransformer3DModel",
           "Wan 2.1 T2V (1.3B, 14B), Wan 2.2 (A14B experts, TI2V-5B)"),
    Family(HunyuanVideo15Spec, HunyuanVideo15Model, hunyuan_video15_checkpoint, "HunyuanVideo15Transformer3DModel",
           "HunyuanVideo 1.5 (480p, 720p; text to video)"),
    Family(LTX2Spec, LTX2Model, ltx2_checkpoint, "LTX2VideoTransformer3DModel", "LTX-2 (2.0, 2.3; video with audio)",
           build_transformer),
    Family(MiniMaxH3Spec, MiniMaxH3Model, minimax_h3_checkpoint, "MiniMaxH3Transformer3DModel",
           "MiniMax-H3 (video with audio; full or pruned)", build_minimax_h3),
    Family(ZImageSpec, ZImageModel, z_image_checkpoint, "ZImageTransformer2DModel", "Z-Image (Turbo, Base)"),
    Family(HunyuanDiTSpec, HunyuanDiTModel, hunyuan_dit_checkpoint, "HunyuanDiT2DModel", "HunyuanDiT 1.0, 1.1, 1.2"),
    Family(QwenImage21Spec, QwenImage21Model, qwen_image21_checkpoint, "QwenImage21Transformer2DModel",
           "Qwen-Image 2.1 (text to image)", build_qwen_image21),
    Family(QwenImageSpec, QwenImageModel, qwen_image_checkpoint, "QwenImageTransformer2DModel",
           "Qwen-Image, Qwen-Image-Edit (-2509)"),
    Family(CogVideoXSpec, CogVideoXModel, cogvideox_checkpoint, "CogVideoXTransformer3DModel",
           "CogVideoX T2V (2B, 5B, 1.5-5B)"),
)}
SUPPORTED = "; ".join(f.describes for f in FAMILIES.values())


def family_names(method: str | None = None) -> list[str]:
    """Each family's short name ("Flux.1", "Wan 2.1 T2V, Wan 2.2", …: its description without the brackets), every
    one or those that run ``method`` (a degree: "pipefusion", …), for lists people read (the nodes' descriptions)."""
    return [re.sub(r" \([^)]*\)", "", f.describes) for f in FAMILIES.values()
            if method is None or method in f.spec_class.parallel_methods]


class ModelError(UserError):
    """A model argument that cannot be resolved or loaded; the hint says what to pass instead."""


def resolve_builtin(name: str) -> BuiltinModel:
    if name in BUILTINS:
        return BUILTINS[name]
    raise ModelError(f"{name!r} is not a built-in model", f"built-in models: {', '.join(BUILTINS)}")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from (a resolved model argument: a built-in's seed, a single file
    or a diffusers folder), its family and its diffusers config."""

    kind: str  # "builtin", "file" (original key layout) or "folder" (diffusers layout)
    ref: str
    family: str
    config: dict
    prefix: str = ""  # the file's key prefix ("model.diffusion_model." in a ComfyUI checkpoint)
    describes: str = ""
    float8: bool = False  # the file holds float8 tensors (kept in float8 on the device)
    gguf: bool = False  # a GGUF file (city96's layout), not a safetensors one


def resolve(ref: str) -> ModelSource:
    """A built-in name, a safetensors file in a family's original layout, or a diffusers folder."""
    if ref in BUILTINS:
        builtin = BUILTINS[ref]
        return ModelSource("builtin", ref, builtin.family, builtin.config, describes=builtin.description)
    path = Path(ref).expanduser()
    if not path.exists():
        raise ModelError(f"no model at {ref}: not a built-in name, and no such file or folder",
                         f"give a .safetensors file from ComfyUI's models/diffusion_models (or unet, checkpoints), "
                         f"a diffusers model folder, or a built-in model: {', '.join(BUILTINS)}")
    stat = path.stat()
    return _resolve_path(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _resolve_path(path: str, mtime_ns: int, size: int) -> ModelSource:
    """Read a file's header (or a folder's config) once per version of the file."""
    if Path(path).is_dir():
        return _resolve_folder(path)
    if gguf_blocks.is_gguf(path):
        try:
            return _resolve_shapes(path, gguf_file.shapes(gguf_blocks.open_reader(path), path), gguf=True)
        except UserError as exc:
            raise ModelError.of(exc) from None
    if file_kind.pickled(path):
        raise ModelError(f"{path} is a PyTorch pickle (a .ckpt / .pt / .bin file), which the backend does not load: "
                         "unpickling can run code the file carries",
                         "use the model's .safetensors (or GGUF) file; ComfyUI's and the makers' releases have one")
    try:
        with safetensors_file.open_file(path) as handle:
            shapes = {key: handle.get_slice(key).get_shape() for key in handle.keys()}
            float8 = any(handle.get_slice(key).get_dtype().startswith("F8") for key in handle.keys())
    except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged header, or a file shorter than it says
        raise ModelError(f"{path} is not a readable safetensors file ({exc})",
                         "the file may be truncated (an interrupted download?): check its size, or re-download it") from None
    try:
        scaled_fp8.check(shapes, path)
        with safetensors_file.open_file(path) as handle:
            scaled_fp8.formats(handle, path)  # refuses quantization formats other than float8, by layer
    except UserError as exc:
        raise ModelError.of(exc) from None
    float8 = float8 or bool(scaled_fp8.MARKER in {key.rpartition(".")[2] for key in shapes})
    return _resolve_shapes(path, scaled_fp8.model_shapes(shapes), float8=float8)  # without scales and markers


def _resolve_shapes(path: str, shapes: dict[str, list[int]], float8: bool = False, gguf: bool = False) -> ModelSource:
    """The family whose original layout the file's tensor names and shapes are, and its config."""
    for family in FAMILIES.values():
        prefix = family.checkpoint.detect_prefix(shapes)
        if prefix is not None:
            break
    else:
        found = sorted({key.split(".")[0] for key in shapes})[:12]
        raise ModelError(f"{path}: no supported model layout found (top-level keys: {', '.join(found) or 'none'})",
                         f"supported single files: {SUPPORTED}, in their original key layout (as ComfyUI "
                         "loads them), bare or inside a checkpoint; or a diffusers model folder")
    try:
        config = family.checkpoint.config_from_shapes(shapes, prefix, path)
    except UserError as exc:
        raise ModelError.of(exc) from None
    except KeyError as exc:
        raise ModelError(f"{path}: {family.name} tensor {exc} is missing", "the file is incomplete: re-download it") from None
    return ModelSource("file", path, family.name, config, prefix, family.checkpoint.variant(config), float8, gguf)


def _resolve_folder(path: str) -> ModelSource:
    config_file = Path(path) / "config.json"
    if not config_file.exists() and (Path(path) / "transformer" / "config.json").exists():
        config_file = Path(path) / "transformer" / "config.json"  # a whole pipeline folder
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: no readable diffusers config.json ({exc})",
                         "a diffusers model folder holds config.json and its safetensors") from None
    family = family_of_class(config.get("_class_name"))
    supported = f"supported: {', '.join(f.diffusers_class for f in FAMILIES.values())} folders"
    if "_class_name" not in config:
        raise ModelError(f"{config_file}: names no model class (no _class_name), so it is not a diffusers model's "
                         "config", f"give the folder of a diffusers transformer (its config.json names the class); "
                                   f"{supported}")
    if family is None:
        raise ModelError(f"{path} holds a {config['_class_name']!r}, not a supported model", supported)
    init = {k: v for k, v in config.items() if not k.startswith("_")}
    return ModelSource("folder", str(config_file.parent), family.name, init,
                       describes=f"{family.name} (diffusers folder)")


def construct(source: ModelSource):
    """The family's diffusers transformer for ``source``'s config, parameters on the meta device (a
    built-in's: those no module can redraw are drawn from its seed, weights.construct)."""
    seed = BUILTINS[source.ref].seed if source.kind == "builtin" else None
    return weights.construct(FAMILIES[source.family].constructor(), source.config, seed)


def attention_geometry(config) -> tuple[int, int]:
    """(heads, head size) from a diffusers config: most families name them num_attention_heads and
    attention_head_dim; Z-Image names n_heads and its width dim."""
    get = config.get if isinstance(config, dict) else lambda key, default=None: getattr(config, key, default)
    if get("num_attention_heads") is not None:
        return get("num_attention_heads"), get("attention_head_dim")
    return get("n_heads"), get("dim") // get("n_heads")


def spec(ref: str):
    """What the model takes and allows, from its config: nothing is built or loaded."""
    source = resolve(ref)
    return FAMILIES[source.family].spec(source.config)


def build(ref: str, device: torch.device, dtype: torch.dtype = torch.float32, loras=(),
          blocks: tuple[int, int] | None = None, weight_dtype: str = "default", sharding=None, progress=None):
    """Build or load the model ``ref`` names (build_source)."""
    return build_source(resolve(ref), ref, device, dtype, loras, blocks, weight_dtype, sharding, progress)


def build_source(source: ModelSource, name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                 loras=(), blocks: tuple[int, int] | None = None, weight_dtype: str = "default",
                 sharding: weights.BlockSharding | None = None,
                 progress: Callable[[int, int], None] | None = None):
    """Build or load a model (called ``name``) onto ``device`` computing in ``dtype`` (seeded weights for a built-in,
    else its file or folder), carrying ``loras`` (lora.LoraSpec) as patches (``model.patches``: lora.py).


    Constructed on the meta device, then each tensor drawn or read, moved and cast on its own
    (weights.put): the host never holds the whole model, and a built-in is the same model on every
    device. Linear weights keep their storage precision (an fp8 or GGUF file's; ``weight_dtype``
    "fp8_e4m3fn" / "fp8_e5m2" stores a 16/32-bit model's in that float8), upcast one layer at a
    time at compute (storage.py). ``blocks`` = (start, end): a PipeFusion stage; only those blocks'
    tensors (and the embeddings around them) are drawn or read, the other blocks stay on the meta
    device for the caller to drop (parallel/pipefusion.keep_stage). ``sharding``: each block's tensors
    are read only in this rank's rows and the block is sharded as soon as they are in (weights.put), so
    the host and the device never hold more than the shards and the layers outside the blocks.
    ``progress(done, total)``: after each tensor, the parameters of ``keys`` filled so far and in all
    (service/load_progress.py tells the person waiting).
    """
    family = FAMILIES[source.family]
    fp8 = _weight_dtype(weight_dtype)
    if fp8 is not None or source.float8:
        storage.check_fp8(device, source.ref)
    transformer = construct(source)
    keys = _stage_keys(transformer, family, blocks)
    with _tensors(source, transformer, keys, device) as tensor_of:
        if progress is not None:
            tensor_of = _counted(tensor_of, transformer, keys, progress)
        weights.put(transformer, keys, tensor_of, device, dtype, fp8,
                    sharding and (sharding, _blocks(transformer, family, blocks)))
    broken = storage.non_finite(transformer) if source.kind != "builtin" else []  # a built-in's are drawn, finite
    if broken:
        raise ModelError(f"{source.ref}: {len(broken)} tensors hold NaN or infinite values once loaded "
                         f"({', '.join(broken[:3])}{', …' if len(broken) > 3 else ''})",
                         "the file is damaged, or a tensor's type was relabelled: re-download or re-convert it")
    table = family.checkpoint.sources(transformer.state_dict().keys(), "", source.config)
    patches = lora.Patches(transformer, table, dtype)  # before a stage drops the other blocks
    model = family.model(transformer, name, family.spec(source.config), patches, dtype,
                         storage.storage_dtype(transformer, dtype))
    try:
        model.lora_reports = model.patches.carry(list(loras), lora.LoraFiles(device)) if loras else []
    except UserError as exc:
        raise ModelError.of(exc) from None
    return model


def _counted(tensor_of: Callable[..., object], transformer, keys: list[str],
             progress: Callable[[int, int], None]) -> Callable[..., object]:
    """``tensor_of`` that reports, after each tensor, the parameters read so far (a sharded block's keys are read
    once each, in this rank's rows: the fraction is of this rank's work) and the total of ``keys``."""
    wanted = set(keys)
    sizes = {key: tensor.numel() for key, tensor in transformer.state_dict().items() if key in wanted}  # on meta
    total = sum(sizes.values())
    done = 0

    def counted(key: str, part: tuple[int, int] | None = None) -> object:
        nonlocal done
        tensor = tensor_of(key, part)
        done = min(total, done + sizes.get(key, 0))
        progress(done, total)
        return tensor

    return counted


def _weight_dtype(name: str) -> torch.dtype | None:
    """A request's weight_dtype as the float8 to store 16/32-bit Linear weights in; None: the file's."""
    if name == "default":
        return None
    if name not in storage.FP8:
        raise ModelError(f"weight_dtype {name!r} is not supported", f"use default, {', '.join(storage.FP8)}")
    return storage.FP8[name]


def _stage_keys(transformer, family: Family, blocks: tuple[int, int] | None) -> list[str]:
    """The state-dict keys to fill: all of them, or a stage's blocks' and those outside every block."""
    keys = list(transformer.state_dict().keys())
    if blocks is None:
        return keys
    counts = [len(getattr(transformer, name)) for name in family.block_lists]
    return [k for k in keys if (i := _block_index(k, family.block_lists, counts)) is None
            or blocks[0] <= i < blocks[1]]


def _blocks(transformer, family: Family, blocks: tuple[int, int] | None) -> dict[str, torch.nn.Module]:
    """The blocks to fill, by state-dict prefix ("transformer_blocks.3"): all of them, or a stage's."""
    named = [(f"{name}.{i}", block) for name in family.block_lists for i, block in enumerate(getattr(transformer, name))]
    start, end = blocks or (0, len(named))
    return dict(named[start:end])


def _block_index(key: str, block_lists: tuple[str, ...], counts: list[int]) -> int | None:
    """Position of the block a parameter belongs to, counting across the block lists; None: no block."""
    match = re.match(r"(\w+)\.(\d+)\.", key)
    if not match or match.group(1) not in block_lists:
        return None
    before = sum(counts[: block_lists.index(match.group(1))])
    return before + int(match.group(2))


@contextmanager
def _tensors(source: ModelSource, transformer, keys: list[str], device: torch.device):
    """``tensor_of(key)``: a built-in's drawn tensor (on the CPU, or on ``device`` for one drawn there), or one
    tensor read from the file or folder (on the CPU, in the stored dtype, memory-mapped), each only when
    ``weights.put`` asks for it."""
    if source.kind == "builtin":
        builtin = BUILTINS[source.ref]
        draw = weights.drawn(transformer, builtin.seed, device if builtin.drawn_on_device else torch.device("cpu"))
        yield lambda key, part=None: draw(key) if part is None else draw(key)[part[0]:part[1]]
        return

    def unreadable(exc: Exception) -> ModelError:
        return ModelError(f"{source.ref}: could not read its weights ({exc})",
                          "the file may be truncated or damaged: re-download it")

    with ExitStack() as stack:
        try:
            read = (folder.reader(source.ref, stack) if source.kind == "folder"
                    else _file_reader(source, keys, stack))
        except UserError as exc:
            raise ModelError.of(exc) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a damaged header, or a file shorter than it says
            raise unreadable(exc) from None

        def tensor_of(key: str, part: tuple[int, int] | None = None) -> torch.Tensor:
            try:
                return read(key, part)
            except UserError as exc:
                raise ModelError.of(exc) from None
            except Exception as exc:  # only the read: a device's out-of-memory is not the file's fault
                raise unreadable(exc) from None

        yield tensor_of


def _file_reader(source: ModelSource, keys: list[str], stack: ExitStack) -> Callable[..., torch.Tensor]:
    """``read(key, part=None)``: one diffusers tensor (or its rows ``part``) from a single file in its family's
    original layout."""
    table = FAMILIES[source.family].checkpoint.sources(keys, source.prefix, source.config)
    if source.gguf:
        read = gguf_file.file_reader(gguf_blocks.open_reader(source.ref))
    else:
        handle = stack.enter_context(safetensors_file.open_file(source.ref))
        read = scaled_fp8.ScaledReader(handle, source.ref).read  # a weight with a scale: storage.Quantized
    return lambda key, part=None: read(table[key] if part is None else replace(table[key], part=part))


def random_conditioning(name: str, batch: int, seed: int, spec, references: tuple[tuple[int, int], ...] = (),
                        latent: tuple[int, ...] | None = None) -> tuple[dict, dict]:
    """Deterministic stand-in text embeddings for a built-in model, derived from the seed.

    Positive and negative sides come from one generator (seeded apart from the noise), so the same
    seed always gives the same prompt and a different seed a different one. A dimension of any
    length (None) gets the built-in's ``text_tokens``; in a tensor shaped like the ``latent``'s (5-D
    for video: an image-to-video model's start frames and mask), the latent's frames, rows and columns (without a
    ``latent``, such optional inputs are left out).
    ``references``: the latent (rows, columns) of each reference latent to draw (a model that takes
    them), the same on both sides, drawn after the text so the text does not change with them.
    """
    if references and not spec.takes_references:
        raise ModelError(f"{name} takes no reference latents", "ask for references only from an edit model")
    generator = torch.Generator().manual_seed((seed * 2654435761 + 97) % 2**63)
    tokens = resolve_builtin(name).text_tokens

    def filled(shape: tuple) -> tuple[int, ...]:
        like_latent = latent is not None and len(shape) == len(latent) > 3
        return tuple((latent[i] if like_latent and i >= 2 else tokens) if d is None else d
                     for i, d in enumerate(shape))

    shapes = {key: filled(shape) for key, shape in spec.drawn_shapes(batch, tokens).items()
              if latent is not None or len(shape) < 5 or key not in spec.optional_conditioning}
    positive = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    negative = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    for i, (rows, columns) in enumerate(references):
        reference = torch.randn((batch, spec.latent_format.channels, rows, columns), generator=generator)
        positive[f"reference_{i}"] = negative[f"reference_{i}"] = reference
    return positive, negative
