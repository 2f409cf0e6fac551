"""Flux single files in the original (BFL / ComfyUI) key layout, read into diffusers' Flux.

The layout conversion is a table: every diffusers parameter names the BFL tensor it comes from,
and, for fused tensors, which rows (checkpoint.TensorSource). It works at any width (diffusers' own
converter assumes 3072), and infers the config from the shapes.
"""

from __future__ import annotations

import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

MARKERS = ("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight")
detect_prefix = prefix_detector(MARKERS)


_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "proj_out": "final_layer.linear",
}
_QKV = ("D", "D", "D")
_DOUBLE = {
    "norm1.linear": ("img_mod.lin",),
    "norm1_context.linear": ("txt_mod.lin",),
    "attn.to_q": ("img_attn.qkv", 0, _QKV), "attn.to_k": ("img_attn.qkv", 1, _QKV), "attn.to_v": ("img_attn.qkv", 2, _QKV),
    "attn.norm_q": ("img_attn.norm.query_norm",), "attn.norm_k": ("img_attn.norm.key_norm",),
    "attn.to_out.0": ("img_attn.proj",),
    "attn.add_q_proj": ("txt_attn.qkv", 0, _QKV), "attn.add_k_proj": ("txt_attn.qkv", 1, _QKV),
    "attn.add_v_proj": ("txt_attn.qkv", 2, _QKV),
    "attn.norm_added_q": ("txt_attn.norm.query_norm",), "attn.norm_added_k": ("txt_attn.norm.key_norm",),
    "attn.to_add_out": ("txt_attn.proj",),
    "ff.net.0.proj": ("img_mlp.0",), "ff.net.2": ("img_mlp.2",),
    "ff_context.net.0.proj": ("txt_mlp.0",), "ff_context.net.2": ("txt_mlp.2",),
}
_LINEAR1 = ("D", "D", "D", "MLP")
_SINGLE = {
    "norm.linear": ("modulation.lin",),
    "attn.to_q": ("linear1", 0, _LINEAR1), "attn.to_k": ("linear1", 1, _LINEAR1), "attn.to_v": ("linear1", 2, _LINEAR1),
    "proj_mlp": ("linear1", 3, _LINEAR1),
    "attn.norm_q": ("norm.query_norm",), "attn.norm_k": ("norm.key_norm",),
    "proj_out": ("linear2",),
}


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The BFL source of every diffusers parameter key (``prefix``: the file's key prefix)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    table = {}
    for key in diffusers_keys:
        module, param = key.rsplit(".", 1)
        if module == "norm_out.linear":
            table[key] = TensorSource(f"{prefix}final_layer.adaLN_modulation.1.{param}", swap_halves=True)
            continue
        if module in _GLOBAL:
            table[key] = TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
            continue
        table[key] = block_source(key, prefix, width, _DOUBLE, _SINGLE)
    return table


def block_source(key: str, prefix: str, width: int, double: dict, single: dict) -> TensorSource:
    """The BFL source of a diffusers block parameter ``key`` (``transformer_blocks.N.…`` or
    ``single_transformer_blocks.N.…``) by the tables ``double`` and ``single``: a name, or a band of a fused tensor."""
    module, param = key.rsplit(".", 1)
    match = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if not match:
        raise KeyError(key)
    kind, index, rest = match.groups()
    bfl_param = "scale" if param == "weight" and ("norm_q" in rest or "norm_k" in rest or "norm_added" in rest) \
        else param
    bfl_block = "double_blocks" if kind == "transformer_blocks" else "single_blocks"
    name, *split = (double if kind == "transformer_blocks" else single)[rest]
    rows = None
    if split:  # a band of a fused tensor: parts of width D or 4·D (the MLP)
        part, parts = split
        rows = bands([width if size == "D" else 4 * width for size in parts])[part]
    return TensorSource(f"{prefix}{bfl_block}.{index}.{name}.{bfl_param}", rows)


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' FluxTransformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    out_channels = shape("final_layer.linear.weight")[0]
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    # the channels ComfyUI concatenates (packed 2×2: ×4): none, the control image (Depth / Canny: 16 latent channels)
    # or the masked image and its mask (Fill: 16 + 64)
    if in_channels not in (out_channels, 2 * out_channels, out_channels + 4 * 80):
        raise UserError(f"{path}: a Flux file with {in_channels} input channels and {out_channels} output channels "
                        "is not a variant this version runs", "use a Flux.1 dev / schnell / Kontext, Fill, Depth or "
                        "Canny file")
    config = {
        **blocks_config(shapes, prefix),
        **({"out_channels": out_channels} if out_channels != in_channels else {}),
        "pooled_projection_dim": shape("vector_in.in_layer.weight")[1],
        "guidance_embeds": "guidance_in.in_layer.weight" in shape,
    }
    expected = {
        "double_blocks.0.img_attn.qkv.weight": [3 * width, width],
        "double_blocks.0.img_mlp.0.weight": [4 * width, width],
        "final_layer.linear.weight": [out_channels, width],
    }
    if config["num_single_layers"]:
        expected["single_blocks.0.linear1.weight"] = [7 * width, width]
    wrong = shape.unexpected(expected)
    if width % head_dim or wrong:
        raise UserError(
            f"{path}: its Flux tensors match no Flux variant (width {width}, head size {head_dim}; "
            f"unexpected shapes: {wrong or 'width not a multiple of the head size'})",
            "the file may be damaged or of another architecture; re-download it")
    return config


def blocks_config(shapes: dict[str, list[int]], prefix: str) -> dict:
    """What a Flux-layout file's shapes say of its blocks, in diffusers' config names (Flux.1's and Chroma's)."""
    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    head_dim = shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    return {"patch_size": 1, "in_channels": in_channels,
            "num_layers": count_blocks(shapes, "double_blocks", prefix),
            "num_single_layers": count_blocks(shapes, "single_blocks", prefix),
            "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
            "joint_attention_dim": shape("txt_in.weight")[1], "axes_dims_rope": rope_axes(head_dim)}


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Flux's RoPE split of a head: (16, 56, 56) at 128; the same proportions, even, at other sizes."""
    side = (7 * head_dim // 16) // 2 * 2
    return (head_dim - 2 * side, side, side)


def variant(config: dict) -> str:
    """A name for what the shapes say: Flux.1-dev / Flux.1-schnell at full size, else the architecture."""
    kind = "dev" if config["guidance_embeds"] else "schnell"
    width = config["attention_head_dim"] * config["num_attention_heads"]
    if (width, config["num_layers"], config["num_single_layers"]) == (3072, 19, 38):
        return f"Flux.1-{kind}"
    return f"Flux-{kind} architecture, width {width}, {config['num_layers']}+{config['num_single_layers']} blocks"
