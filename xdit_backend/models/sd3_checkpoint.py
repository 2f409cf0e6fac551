"""SD3 / SD3.5 single files in the original (Stability / ComfyUI) key layout, read into diffusers' SD3.

The conversion is a table: every diffusers ``SD3Transformer2DModel`` state_dict key names the
``checkpoint.TensorSource`` it comes from (a fused qkv gives each projection a band of rows). It works at
any width and infers the config from the tensor shapes alone.

Buffers: ``pos_embed.pos_embed`` (the position table) is a persistent buffer whenever
``pos_embed_max_size`` is set, which it always is here, so it is in the state_dict; it is read from
the file's ``pos_embed`` (same shape, [1, max_size², width]), so a strict load works and the model
uses the file's table, not one recomputed by diffusers.

Modulations: the original's final layer and the last block's context block (``pre_only``: only
shift and scale, feeding diffusers' ``AdaLayerNormContinuous``) hold (shift, scale); diffusers holds
(scale, shift), so those two are read with ``swap_halves``. Every other modulation has one order.

``sample_size`` is not stored in a file (it only sets a pipeline's default size): it is 128 latents
(1024 px, what every SD3 was trained at), or the position table's size where that is smaller.
"""

from __future__ import annotations

import math
import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, prefix_detector

MARKERS = ("x_embedder.proj.weight", "joint_blocks.0.x_block.attn.qkv.weight",
           "joint_blocks.0.context_block.attn.qkv.weight")
detect_prefix = prefix_detector(MARKERS)
HEAD_DIM = 64  # every SD3; files without qk-norm weights do not store it
FREQUENCY_DIM = 256  # sinusoidal timestep features fed to t_embedder

_GLOBAL = {  # diffusers module -> original module
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
}
# Inside joint_blocks.<i>: diffusers module -> (original module, band of the fused qkv or None).
_BLOCK = {
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
    "attn.to_out.0": ("x_block.attn.proj", None),
    "attn.to_add_out": ("context_block.attn.proj", None),
    "attn.norm_q": ("x_block.attn.ln_q", None), "attn.norm_k": ("x_block.attn.ln_k", None),
    "attn.norm_added_q": ("context_block.attn.ln_q", None), "attn.norm_added_k": ("context_block.attn.ln_k", None),
    "attn2.to_out.0": ("x_block.attn2.proj", None),
    "attn2.norm_q": ("x_block.attn2.ln_q", None), "attn2.norm_k": ("x_block.attn2.ln_k", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None), "ff.net.2": ("x_block.mlp.fc2", None),
    "ff_context.net.0.proj": ("context_block.mlp.fc1", None), "ff_context.net.2": ("context_block.mlp.fc2", None),
    # fused [q; k; v] projections: rows [0, D), [D, 2D), [2D, 3D)
    "attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1), "attn.to_v": ("x_block.attn.qkv", 2),
    "attn.add_q_proj": ("context_block.attn.qkv", 0), "attn.add_k_proj": ("context_block.attn.qkv", 1),
    "attn.add_v_proj": ("context_block.attn.qkv", 2),
    "attn2.to_q": ("x_block.attn2.qkv", 0), "attn2.to_k": ("x_block.attn2.qkv", 1), "attn2.to_v": ("x_block.attn2.qkv", 2),
}


def _block_indices(shapes, prefix: str, suffix: str = "") -> list[int]:
    pattern = re.escape(prefix) + r"joint_blocks\.(\d+)\." + re.escape(suffix)
    return sorted({int(m.group(1)) for key in shapes if (m := re.match(pattern, key))})


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' SD3Transformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    ranks = {"x_embedder.proj.weight": 4, "pos_embed": 3, "context_embedder.weight": 2}
    if odd := {key: shape(key) for key, rank in ranks.items() if len(shape(key)) != rank}:
        raise UserError(f"{path}: its SD3 tensors have unexpected shapes: {odd}",
                        "the file may be damaged or of another architecture; re-download it")
    width, in_channels, patch, _ = shape("x_embedder.proj.weight")  # a conv: [width, channels, p, p]
    qk_norm = "joint_blocks.0.x_block.attn.ln_q.weight" in shape
    head_dim = shape("joint_blocks.0.x_block.attn.ln_q.weight")[0] if qk_norm else HEAD_DIM
    caption_dim, joint_dim = shape("context_embedder.weight")
    positions = shape("pos_embed")[1]  # [1, max_size², width]: a square grid of patches, flattened
    max_size = math.isqrt(positions)
    layers = _block_indices(shapes, prefix)
    shape("joint_blocks.0.x_block.attn.qkv.weight")  # KeyError when the file has no blocks at all
    dual = _block_indices(shapes, prefix, "x_block.attn2.qkv.weight")
    config = {
        "sample_size": min(128, max_size),
        "patch_size": patch,
        "in_channels": in_channels,
        "num_layers": len(layers),
        "attention_head_dim": head_dim,
        "num_attention_heads": width // head_dim,
        "joint_attention_dim": joint_dim,
        "caption_projection_dim": caption_dim,
        "pooled_projection_dim": shape("y_embedder.mlp.0.weight")[1],
        "out_channels": shape("final_layer.linear.weight")[0] // (patch * patch),
        "pos_embed_max_size": max_size,
        "dual_attention_layers": tuple(dual),
        "qk_norm": "rms_norm" if qk_norm else None,
    }
    expected = {
        "pos_embed": [1, max_size * max_size, width],
        "context_embedder.weight": [width, joint_dim],  # the text stream runs at the image width
        "t_embedder.mlp.0.weight": [width, FREQUENCY_DIM],
        "final_layer.linear.weight": [patch * patch * config["out_channels"], width],
        "final_layer.adaLN_modulation.1.weight": [2 * width, width],
    }
    for i in layers:
        last = i == layers[-1]
        block = f"joint_blocks.{i}."
        expected[block + "x_block.attn.qkv.weight"] = [3 * width, width]
        expected[block + "context_block.attn.qkv.weight"] = [3 * width, width]
        expected[block + "x_block.mlp.fc1.weight"] = [4 * width, width]
        # (shift, scale, gate) for attention and MLP, and for attn2 in dual-attention blocks
        expected[block + "x_block.adaLN_modulation.1.weight"] = [(9 if i in dual else 6) * width, width]
        # the last context block only feeds attention: (shift, scale)
        expected[block + "context_block.adaLN_modulation.1.weight"] = [(2 if last else 6) * width, width]
    wrong = shape.unexpected(expected)
    if width % head_dim:
        wrong["attention head size"] = f"{head_dim}, which does not divide the width"
    if layers != list(range(len(layers))):
        wrong["joint_blocks"] = f"indices {layers}, not 0..{len(layers) - 1}"
    if wrong:
        raise UserError(
            f"{path}: its SD3 tensors match no SD3 variant (width {width}, {len(layers)} blocks; "
            f"unexpected shapes: {wrong})",
            "the file may be damaged or of another architecture; re-download it")
    return config


_VARIANTS = {  # (width, blocks, qk_norm, dual-attention blocks, position table size) -> name
    (1536, 24, None, (), 192): "SD3-medium",
    (1536, 24, "rms_norm", tuple(range(13)), 384): "SD3.5-medium",
    (2432, 38, "rms_norm", (), 192): "SD3.5-large",
}


def variant(config: dict) -> str:
    """A name for what the shapes say: SD3-medium / SD3.5-medium / SD3.5-large at full size, else the architecture."""
    width = config["attention_head_dim"] * config["num_attention_heads"]
    key = (width, config["num_layers"], config["qk_norm"], tuple(config["dual_attention_layers"]),
           config["pos_embed_max_size"])
    family = "SD3.5" if config["qk_norm"] else "SD3"
    return _VARIANTS.get(key, f"{family} architecture, width {width}, {config['num_layers']} blocks")


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers state_dict key (``prefix``: the file's key prefix)."""
    width = config["attention_head_dim"] * config["num_attention_heads"]
    qkv = bands([width, width, width])
    last = config["num_layers"] - 1
    table = {}
    for key in diffusers_keys:
        if key == "pos_embed.pos_embed":  # the persistent position-table buffer
            table[key] = TensorSource(f"{prefix}pos_embed")
            continue
        module, param = key.rsplit(".", 1)
        if module == "norm_out.linear":
            table[key] = TensorSource(f"{prefix}final_layer.adaLN_modulation.1.{param}", swap_halves=True)
            continue
        if module in _GLOBAL:
            table[key] = TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
            continue
        match = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module)
        if not match or match.group(2) not in _BLOCK:
            raise KeyError(key)
        index, rest = int(match.group(1)), match.group(2)
        name, band = _BLOCK[rest]
        table[key] = TensorSource(f"{prefix}joint_blocks.{index}.{name}.{param}",
                            rows=None if band is None else qkv[band],
                            swap_halves=rest == "norm1_context.linear" and index == last)
    return table
