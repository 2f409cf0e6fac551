"""Flux.2 single files in the original (BFL / Comfy-Org) key layout, read into diffusers' Flux.2.

A table, as for Flux.1: every diffusers parameter names the BFL tensor it comes from and, for
the fused qkv projections of the double-stream blocks, its third. Each tensor is then read alone
through a memory-mapped slice, so a PipeFusion stage or a weight shard reads only what it keeps;
diffusers' own converter (convert_flux2_transformer_checkpoint_to_diffusers) renames a whole state
dict held in memory. The single-stream blocks' fused linear1 / linear2 are diffusers'
to_qkv_mlp_proj / to_out as they are. dev and klein are told apart by their shapes: a guidance
embedding (dev) and the width (comfy/model_detection.py: flux2 is marked by
double_stream_modulation_img.lin.weight; heads = width / 128).
"""

from __future__ import annotations

import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

MARKERS = ("img_in.weight", "double_stream_modulation_img.lin.weight", "final_layer.linear.weight")
detect_prefix = prefix_detector(MARKERS)

_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
_DOUBLE = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.norm_q": ("img_attn.norm.query_norm",), "attn.norm_k": ("img_attn.norm.key_norm",),
    "attn.to_out.0": ("img_attn.proj",),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.norm_added_q": ("txt_attn.norm.query_norm",), "attn.norm_added_k": ("txt_attn.norm.key_norm",),
    "attn.to_add_out": ("txt_attn.proj",),
    "ff.linear_in": ("img_mlp.0",), "ff.linear_out": ("img_mlp.2",),
    "ff_context.linear_in": ("txt_mlp.0",), "ff_context.linear_out": ("txt_mlp.2",),
}
_SINGLE = {
    "attn.to_qkv_mlp_proj": ("linear1",), "attn.to_out": ("linear2",),
    "attn.norm_q": ("norm.query_norm",), "attn.norm_k": ("norm.key_norm",),
}
ROPE_THETA = 2000  # comfy/model_detection.py, flux2: theta 2000, axes_dim [32, 32, 32, 32] at head size 128


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The BFL source of every diffusers parameter key (``prefix``: the file's key prefix)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    table = {}
    for key in diffusers_keys:
        module, param = key.rsplit(".", 1)
        bfl_param = "scale" if re.search(r"norm_(q|k|added_q|added_k)$", module) else param
        if module == "norm_out.linear":  # BFL (shift, scale), diffusers (scale, shift)
            table[key] = TensorSource(f"{prefix}final_layer.adaLN_modulation.1.{param}", swap_halves=True)
            continue
        if module in _GLOBAL:
            table[key] = TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
            continue
        match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
        if not match:
            raise KeyError(key)
        kind, index, rest = match.groups()
        double = kind == "transformer_blocks"
        name, *third = (_DOUBLE if double else _SINGLE)[rest]
        rows = bands([width] * 3)[third[0]] if third else None  # q, k or v of a fused [3·D, D] qkv
        bfl_block = "double_blocks" if double else "single_blocks"
        table[key] = TensorSource(f"{prefix}{bfl_block}.{index}.{name}.{bfl_param}", rows)
    return table


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' Flux2Transformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    mlp = shape("double_blocks.0.img_mlp.2.weight")[1]  # the MLP's hidden width (3·D)
    config = {
        "patch_size": 1,
        "in_channels": in_channels,
        "out_channels": shape("final_layer.linear.weight")[0],
        "num_layers": count_blocks(shapes, "double_blocks", prefix),
        "num_single_layers": count_blocks(shapes, "single_blocks", prefix),
        "attention_head_dim": head_dim,
        "num_attention_heads": width // head_dim,
        "joint_attention_dim": shape("txt_in.weight")[1],
        "timestep_guidance_channels": shape("time_in.in_layer.weight")[1],
        "mlp_ratio": mlp / width,
        "axes_dims_rope": (head_dim // 4,) * 4,
        "rope_theta": ROPE_THETA,
        "guidance_embeds": "guidance_in.in_layer.weight" in shape,
    }
    expected = {
        "double_blocks.0.img_attn.qkv.weight": [3 * width, width],
        "double_blocks.0.img_mlp.0.weight": [2 * mlp, width],
        "double_stream_modulation_img.lin.weight": [6 * width, width],
        "final_layer.adaLN_modulation.1.weight": [2 * width, width],
    }
    if config["num_single_layers"]:
        expected["single_blocks.0.linear1.weight"] = [3 * width + 2 * mlp, width]
    wrong = shape.unexpected(expected)
    if width % head_dim or head_dim % 4 or int(width * config["mlp_ratio"]) != mlp or wrong:
        raise UserError(
            f"{path}: its Flux.2 tensors match no Flux.2 variant (width {width}, head size {head_dim}, MLP {mlp}; "
            f"unexpected shapes: {wrong or 'width, head size and MLP width do not fit together'})",
            "the file may be damaged or of another architecture; re-download it")
    return config


KLEIN = {3072: "Flux.2-klein 4B", 4096: "Flux.2-klein 9B"}  # by width; base and distilled share their shapes


def variant(config: dict) -> str:
    """A name for what the shapes say: Flux.2-dev (guidance embedding) or a klein size, else the architecture."""
    width = config["attention_head_dim"] * config["num_attention_heads"]
    blocks = f"{config['num_layers']}+{config['num_single_layers']} blocks"
    if config["guidance_embeds"]:
        return "Flux.2-dev" if width == 6144 else f"Flux.2-dev architecture, width {width}, {blocks}"
    return KLEIN.get(width, f"Flux.2-klein architecture, width {width}, {blocks}")
