"""Wan 2.1 VACE single files in the original key layout (as ComfyUI loads them: comfy/model_detection.py tells them
by ``vace_patch_embedding.weight``), read into diffusers' WanVACETransformer3DModel: a Wan file (wan_checkpoint's
table) with ``vace_blocks.N`` — Wan blocks under the same names, the first with ``before_proj``, each with
``after_proj`` — and ``vace_patch_embedding``. ComfyUI places the VACE blocks after every num_layers / n-th model
block from 0 (VaceWanModel's ``vace_layers_mapping``): the config's ``vace_layers``.
"""

from __future__ import annotations

import re

from ..errors import UserError
from . import wan_checkpoint
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("vace_patch_embedding.weight", "patch_embedding.weight", "head.modulation")
detect_prefix = prefix_detector(MARKERS)
_PROJECTIONS = {"proj_in": "before_proj", "proj_out": "after_proj"}


def original_key(key: str) -> str:
    """The original key (without prefix) of one diffusers key; KeyError if it has none."""
    match = re.fullmatch(r"vace_blocks\.(\d+)\.(.+)", key)
    if match is None:
        return key if key.startswith("vace_patch_embedding.") else wan_checkpoint.original_key(key)
    index, rest = match.groups()
    module, _, param = rest.rpartition(".")
    if module in _PROJECTIONS:
        return f"vace_blocks.{index}.{_PROJECTIONS[module]}.{param}"
    return "vace_" + wan_checkpoint.original_key(f"blocks.{index}.{rest}")


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    return {key: TensorSource(prefix + original_key(key)) for key in diffusers_keys}


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """The Wan config of the file's model blocks, with the VACE blocks' places and input channels."""
    base = wan_checkpoint.config_from_shapes(
        {key: shape for key, shape in shapes.items() if not key.startswith(prefix + "vace_")}, prefix, path)
    shape = FileShapes(shapes, prefix)
    count, layers = count_blocks(shape.own, "vace_blocks"), base["num_layers"]
    places = list(range(0, layers, layers // count)) if count else []
    if not count or len(places) != count:
        raise UserError(f"{path}: {count} VACE blocks beside {layers} model blocks do not spread evenly from block 0",
                        "use a Wan 2.1 VACE file (1.3B: 15 beside 30, 14B: 8 beside 40)")
    return {**base, "vace_layers": places, "vace_in_channels": shape("vace_patch_embedding.weight")[1]}


def variant(config: dict) -> str:
    width = config["num_attention_heads"] * config["attention_head_dim"]
    sizes = {1536: "Wan2.1-VACE-1.3B", 5120: "Wan2.1-VACE-14B"}
    return sizes.get(width) if len(config["vace_layers"]) in (8, 15) and width in sizes else (
        f"Wan VACE architecture, width {width}, {config['num_layers']} blocks, {len(config['vace_layers'])} VACE")
