"""PixArt-α and PixArt-Σ single files in the original (PixArt / ComfyUI) key layout, read into
diffusers' PixArtTransformer2DModel at any width that is a multiple of PixArt's 72-wide heads.

α or Σ? The transformer is the same; the files differ in what surrounds it:

* ``y_embedder.y_embedding`` (the learned null caption) has one row per T5 token: 120 in α, 300 in
  Σ. It decides; a file without it counts as α only if it has α-1024's micro-condition embedders.
* ``csize_embedder`` / ``ar_embedder`` (resolution and aspect-ratio micro-conditions): α-1024-MS
  only. Their presence is ``use_additional_conditions``.
* ``pos_embed`` (a fixed sin-cos buffer at the training resolution, not read: diffusers recomputes
  it) gives ``sample_size`` = patches per side × patch size. Without it: α without micro-conditions
  is α-512 (64), anything else the 1024 models (128).

diffusers' configs follow the conversion scripts: α leaves ``interpolation_scale`` unset (diffusers
takes max(sample_size // 64, 1): 1 at 512, 2 at 1024), Σ sets it to image size / 512, that is
sample_size / 64 (0.5, 1, 2, 4 at 256 … 2048). So ``interpolation_scale is None`` marks α in a config.

Heads are not in the weights. PixArt's are 72 wide (16 × 72 = 1152), so heads = width // 72 and a
width that is not a multiple of 72 is refused rather than guessed.
"""

from __future__ import annotations

import math
import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

# t_block and the cross-attention's q_linear are PixArt's own (SD3 also has x_embedder / t_embedder).
MARKERS = ("t_block.1.weight", "blocks.0.cross_attn.q_linear.weight", "x_embedder.proj.weight")
detect_prefix = prefix_detector(MARKERS)
HEAD_DIM = 72
ALPHA_TOKENS = 120  # Σ: 300

# diffusers module → original module ("" names the parameter's own module: scale_shift_table).
_GLOBAL = {
    "": "final_layer",
    "pos_embed.proj": "x_embedder.proj",
    "caption_projection.linear_1": "y_embedder.y_proj.fc1",
    "caption_projection.linear_2": "y_embedder.y_proj.fc2",
    "adaln_single.emb.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "adaln_single.emb.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "adaln_single.emb.resolution_embedder.linear_1": "csize_embedder.mlp.0",
    "adaln_single.emb.resolution_embedder.linear_2": "csize_embedder.mlp.2",
    "adaln_single.emb.aspect_ratio_embedder.linear_1": "ar_embedder.mlp.0",
    "adaln_single.emb.aspect_ratio_embedder.linear_2": "ar_embedder.mlp.2",
    "adaln_single.linear": "t_block.1",
    "proj_out": "final_layer.linear",
}
# Per block: diffusers module → (original module, part, parts): a band of `parts` equal row bands.
_BLOCK = {
    "": ("",),
    "attn1.to_q": ("attn.qkv", 0, 3), "attn1.to_k": ("attn.qkv", 1, 3), "attn1.to_v": ("attn.qkv", 2, 3),
    "attn1.to_out.0": ("attn.proj",),
    "attn2.to_q": ("cross_attn.q_linear",),
    "attn2.to_k": ("cross_attn.kv_linear", 0, 2), "attn2.to_v": ("cross_attn.kv_linear", 1, 2),
    "attn2.to_out.0": ("cross_attn.proj",),
    "ff.net.0.proj": ("mlp.fc1",), "ff.net.2": ("mlp.fc2",),
}


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers state_dict key (``prefix``: the file's key prefix)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    table = {}
    for key in diffusers_keys:
        block = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", key)
        module, _, param = (block.group(2) if block else key).rpartition(".")
        if block and module in _BLOCK:
            name, *split = _BLOCK[module]
            # fused qkv [3W, W] and kv_linear [2W, C]: q, k, v are consecutive bands of W rows
            rows = bands([width] * split[1])[split[0]] if split else None
            table[key] = TensorSource(prefix + _join("blocks", block.group(1), name, param), rows)
        elif not block and module in _GLOBAL:
            table[key] = TensorSource(prefix + _join(_GLOBAL[module], param))
        else:
            raise KeyError(key)
    return table


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' PixArtTransformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    width, in_channels, patch, _ = shape("x_embedder.proj.weight")  # a conv: [W, C, p, p]
    layers = count_blocks(shapes, "blocks", prefix)
    caption_channels = shape("y_embedder.y_proj.fc1.weight")[1]
    out_rows = shape("final_layer.linear.weight")[0]  # p·p·out_channels, patch pixels outermost
    micro = "csize_embedder.mlp.0.weight" in shape
    tokens = shapes.get(prefix + "y_embedder.y_embedding")
    alpha = tokens[0] == ALPHA_TOKENS if tokens else micro
    expected = {
        "t_block.1.weight": [6 * width, width],
        "t_embedder.mlp.0.weight": [width, 256],
        "blocks.0.attn.qkv.weight": [3 * width, width],
        "blocks.0.cross_attn.q_linear.weight": [width, width],
        "blocks.0.cross_attn.kv_linear.weight": [2 * width, width],
        "blocks.0.mlp.fc1.weight": [4 * width, width],
        "blocks.0.scale_shift_table": [6, width],
        "final_layer.scale_shift_table": [2, width],
    }
    if micro:
        expected["csize_embedder.mlp.0.weight"] = expected["ar_embedder.mlp.0.weight"] = [width // 3, 256]
    pos = shapes.get(prefix + "pos_embed")  # [1, patches, W], patches = (sample_size / p)²
    grid = math.isqrt(pos[1]) if pos else 0
    if pos:
        expected["pos_embed"] = [1, grid * grid, width]
    wrong = shape.unexpected(expected)
    if out_rows % (patch * patch):
        wrong["final_layer.linear.weight"] = shape("final_layer.linear.weight")
    problems = [f"unexpected shapes: {wrong}"] if wrong else []
    if width % HEAD_DIM:
        problems.append(f"width {width} is not a multiple of PixArt's head size {HEAD_DIM}")
    if "blocks.0.attn.q_norm.weight" in shape:
        problems.append("it normalises queries and keys (qk_norm), which diffusers' PixArt does not")
    if problems:
        raise UserError(f"{path}: its PixArt tensors match no PixArt variant ({'; '.join(problems)})",
                        "the file may be damaged or of another architecture; re-download it")
    sample_size = grid * patch if pos else (64 if alpha and not micro else 128)
    return {
        "num_attention_heads": width // HEAD_DIM,
        "attention_head_dim": HEAD_DIM,
        "in_channels": in_channels,
        "out_channels": out_rows // (patch * patch),
        "num_layers": layers,
        "patch_size": patch,
        "sample_size": sample_size,
        "caption_channels": caption_channels,
        "cross_attention_dim": shape("blocks.0.cross_attn.kv_linear.weight")[1],
        "interpolation_scale": None if alpha else (sample_size // 64 if sample_size % 64 == 0 else sample_size / 64),
        "use_additional_conditions": micro,
        "norm_type": "ada_norm_single",
        "num_embeds_ada_norm": 1000,
        "activation_fn": "gelu-approximate",
        "attention_bias": True,
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
    }


def variant(config: dict) -> str:
    """A name for what the shapes say: PixArt-α / PixArt-Σ with the resolution at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    if (width, config["num_layers"]) == (1152, 28):
        kind = "PixArt-α" if config["interpolation_scale"] is None else "PixArt-Σ"
        return f"{kind} {config['sample_size'] * 8}"
    return f"PixArt architecture, width {width}, {config['num_layers']} blocks"

