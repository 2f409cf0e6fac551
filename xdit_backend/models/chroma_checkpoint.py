"""Chroma single files in the original (lodestones' / ComfyUI's) key layout, read into diffusers' Chroma.

Chroma is Flux.1-schnell with the per-block modulation layers pruned and one network, the
``distilled_guidance_layer`` (an approximator), making every block's modulation instead: its blocks
carry Flux's names, less ``img_mod`` / ``txt_mod`` / ``modulation``, and there is no ``time_in``,
``vector_in`` or ``guidance_in``. The table is Flux's (flux_checkpoint) for the blocks, and the
approximator's own; the config is read off the shapes (diffusers' own converter assumes width 3072).
"""

from __future__ import annotations

import re

from ..errors import UserError
from . import flux_checkpoint
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "distilled_guidance_layer.in_proj.weight")
detect_prefix = prefix_detector(MARKERS)

_GLOBAL = {"x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
           "distilled_guidance_layer.in_proj": "distilled_guidance_layer.in_proj",
           "distilled_guidance_layer.out_proj": "distilled_guidance_layer.out_proj"}
_APPROXIMATOR = {"linear_1": "in_layer", "linear_2": "out_layer"}  # its residual MLPs (ComfyUI's MLPEmbedder)
_PRUNED = ("norm1.linear", "norm1_context.linear", "norm.linear")  # Flux's modulation layers, not in Chroma
_DOUBLE = {k: v for k, v in flux_checkpoint._DOUBLE.items() if k not in _PRUNED}
_SINGLE = {k: v for k, v in flux_checkpoint._SINGLE.items() if k not in _PRUNED}


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers parameter key (``prefix``: the file's key prefix)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    table = {}
    for key in diffusers_keys:
        module, param = key.rsplit(".", 1)
        if module in _GLOBAL:
            table[key] = TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
            continue
        approximator = re.fullmatch(r"distilled_guidance_layer\.(layers|norms)\.(\d+)(?:\.(\w+))?", module)
        if approximator:
            kind, index, part = approximator.groups()
            name = f"layers.{index}.{_APPROXIMATOR[part]}.{param}" if kind == "layers" else f"norms.{index}.scale"
            table[key] = TensorSource(f"{prefix}distilled_guidance_layer.{name}")
            continue
        table[key] = flux_checkpoint.block_source(key, prefix, width, _DOUBLE, _SINGLE)
    return table


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' ChromaTransformer2DModel config, read off the tensor shapes; errors name the file."""
    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    hidden, approximator_in = shape("distilled_guidance_layer.in_proj.weight")
    config = {
        **flux_checkpoint.blocks_config(shapes, prefix),
        "approximator_num_channels": approximator_in,
        "approximator_hidden_dim": hidden,
        "approximator_layers": count_blocks(shapes, "distilled_guidance_layer.layers", prefix),
    }
    expected = {"double_blocks.0.img_attn.qkv.weight": [3 * width, width],
                "final_layer.linear.weight": [in_channels, width],
                "distilled_guidance_layer.out_proj.weight": [width, hidden]}
    wrong = shape.unexpected(expected)
    if width % head_dim or wrong or approximator_in != 64:
        raise UserError(f"{path}: its Chroma tensors match no Chroma variant (width {width}, head size {head_dim}, "
                        f"approximator input {approximator_in}; unexpected shapes: {wrong or 'none'})",
                        "the file may be damaged or of another architecture (Chroma Radiance is not run yet); "
                        "re-download it")
    return config


def variant(config: dict) -> str:
    width = config["attention_head_dim"] * config["num_attention_heads"]
    if (width, config["num_layers"], config["num_single_layers"]) == (3072, 19, 38):
        return "Chroma1 (HD, Base)"
    return f"Chroma architecture, width {width}, {config['num_layers']}+{config['num_single_layers']} blocks"
