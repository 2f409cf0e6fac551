"""HunyuanVideo 1.5 single files in Tencent's original key layout, read into diffusers' model.

Tencent's transformer files (tencent/HunyuanVideo-1.5 transformer/<480p|720p>_<t2v|i2v>/) and
Comfy-Org's repackaged ones for ComfyUI (models/diffusion_models, bare keys; or inside a
checkpoint under "model.diffusion_model.") name keys ``double_blocks.N.img_attn_q``,
``txt_in.individual_token_refiner.blocks.N.self_attn_qkv``, ``byt5_in.fc1``, ``vision_in.proj.1``,
``cond_type_embedding`` … (the names diffusers' scripts/convert_hunyuan_video1_5_to_diffusers.py
reads). The table below maps every diffusers tensor to its original: renames, the refiner's fused
qkv cut into three bands of rows, and the final
modulation's (shift, scale) halves swapped to diffusers' (scale, shift).

480p and 720p, text and image to video, have identical shapes (only the weights differ), so the
variant is the architecture; the MeanFlow step-distilled and super-resolution files differ in
shape and are refused by name.
"""

from __future__ import annotations

import math
import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, prefix_detector

MARKERS = ("img_in.proj.weight", "byt5_in.fc1.weight", "cond_type_embedding.weight")
detect_prefix = prefix_detector(MARKERS)
LATENT_CHANNELS = 32  # the model's input: latent (32) + image latent (32) + mask (1) = 65

_GLOBAL = {  # diffusers module or parameter → original
    "x_embedder.proj": "img_in.proj",
    "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder_2.norm": "byt5_in.layernorm",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "image_embedder.norm_in": "vision_in.proj.0",
    "image_embedder.linear_1": "vision_in.proj.1",
    "image_embedder.linear_2": "vision_in.proj.3",
    "image_embedder.norm_out": "vision_in.proj.4",
    "cond_type_embed.weight": "cond_type_embedding.weight",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # (shift, scale) → (scale, shift)
}
_REFINER = {
    "norm1": "norm1", "norm2": "norm2", "attn.to_out.0": "self_attn_proj", "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2", "norm_out.linear": "adaLN_modulation.1",
}
_BLOCK = {
    "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
    "attn.norm_q": "img_attn_q_norm", "attn.norm_k": "img_attn_k_norm",
    "attn.norm_added_q": "txt_attn_q_norm", "attn.norm_added_k": "txt_attn_k_norm",
    "attn.to_out.0": "img_attn_proj", "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
}
_QKV = {"to_q": ("img_attn", 0), "to_k": ("img_attn", 1), "to_v": ("img_attn", 2),
        "add_q_proj": ("txt_attn", 0), "add_k_proj": ("txt_attn", 1), "add_v_proj": ("txt_attn", 2)}


def _rename(rest: str, table: dict[str, str]) -> str | None:
    if rest in table:
        return table[rest]
    module, _, param = rest.rpartition(".")
    return f"{table[module]}.{param}" if module in table else None


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers key (``config``: the width the refiner's qkv bands have)."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return {key: _source(key, prefix, width) for key in diffusers_keys}


def _source(key: str, prefix: str, width: int) -> TensorSource:
    if match := re.fullmatch(r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.(.+)", key):
        base, rest = f"{prefix}txt_in.individual_token_refiner.blocks.{match.group(1)}.", match.group(2)
        if m := re.fullmatch(r"attn\.to_([qkv])\.(weight|bias)", rest):  # one fused [3·D, D] qkv
            return TensorSource(f"{base}self_attn_qkv.{m.group(2)}", bands([width] * 3)["qkv".index(m.group(1))])
        original = _rename(rest, _REFINER)
    elif match := re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", key):
        base, rest = f"{prefix}double_blocks.{match.group(1)}.", match.group(2)
        if (m := re.fullmatch(r"attn\.(\w+)\.(weight|bias)", rest)) and m.group(1) in _QKV:
            stream, index = _QKV[m.group(1)]  # separate q, k, v tensors, as Tencent ships them
            return TensorSource(f"{base}{stream}_{'qkv'[index]}.{m.group(2)}")
        original = _rename(rest, _BLOCK)
    else:
        base, original = prefix, _rename(key, _GLOBAL)
    if original is None:
        raise KeyError(key)
    return TensorSource(base + original, swap_halves=key.startswith("norm_out.linear"))


def rope_axes(head_dim: int) -> tuple[int, int, int] | None:
    """RoPE's (frames, rows, columns) split of a head: (16, 56, 56) of 128 in every released file;
    the same proportions (1/8, 7/16, 7/16) at test widths that are multiples of 32."""
    return (head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16) if head_dim % 32 == 0 else None


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' HunyuanVideo15Transformer3DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    own = shape.own
    width, in_channels, *patch = shape("img_in.proj.weight")  # Conv3d [D, C_in, p_t, p_h, p_w]
    if any(key.startswith("time_r_in.") for key in own):
        raise UserError(f"{path}: a HunyuanVideo 1.5 MeanFlow (step-distilled) file: its second time embedding "
                        "needs the next step's noise level, which is not supported",
                        "use a HunyuanVideo 1.5 480p or 720p text-to-video (or image-to-video) file")
    if in_channels != 2 * LATENT_CHANNELS + 1:
        raise UserError(f"{path}: HunyuanVideo 1.5 with {in_channels} input channels (the super-resolution "
                        f"models) is not supported; the generation models take {2 * LATENT_CHANNELS + 1}",
                        "use a HunyuanVideo 1.5 480p or 720p text-to-video (or image-to-video) file")
    head_dim = shape("double_blocks.0.img_attn_q_norm.weight")[0]
    axes = rope_axes(head_dim)
    blocks = {int(m.group(1)) for key in own if (m := re.match(r"double_blocks\.(\d+)\.", key))}
    refiners = {int(m.group(1)) for key in own if (m := re.match(r"txt_in\.individual_token_refiner\.blocks\.(\d+)\.", key))}
    hidden = shape("double_blocks.0.img_mlp.fc1.weight")[0]
    out_rows = shape("final_layer.linear.weight")[0]
    expected = {
        "double_blocks.0.img_mod.linear.weight": [6 * width, width],
        "double_blocks.0.img_mlp.fc2.weight": [width, hidden],
        "txt_in.individual_token_refiner.blocks.0.self_attn_qkv.weight": [3 * width, width],
        "final_layer.adaLN_modulation.1.weight": [2 * width, width],
        "cond_type_embedding.weight": [3, width],
    }
    wrong = shape.unexpected(expected)
    if axes is None or width % head_dim or out_rows % math.prod(patch) or wrong:
        raise UserError(f"{path}: its HunyuanVideo 1.5 tensors match no HunyuanVideo 1.5 variant (width {width}, "
                        f"head {head_dim}, patch {tuple(patch)}; unexpected shapes: {wrong or 'none'})",
                        "the file may be damaged or of another architecture; re-download it")
    return {
        "in_channels": in_channels,
        "out_channels": out_rows // math.prod(patch),
        "num_attention_heads": width // head_dim,
        "attention_head_dim": head_dim,
        "num_layers": len(blocks),
        "num_refiner_layers": len(refiners),
        "mlp_ratio": hidden / width,
        "patch_size": patch[1],
        "patch_size_t": patch[0],
        "qk_norm": "rms_norm",
        "text_embed_dim": shape("txt_in.input_embedder.weight")[1],
        "text_embed_2_dim": shape("byt5_in.fc1.weight")[1],
        "image_embed_dim": shape("vision_in.proj.1.weight")[1],
        "rope_theta": 256.0,
        "rope_axes_dim": axes,
    }


def variant(config: dict) -> str:
    """A name for what the shapes say: the released architecture at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    if (width, config["num_layers"]) == (2048, 54):
        return "HunyuanVideo 1.5 (8.3 B; 480p and 720p, text and image to video have the same shapes)"
    return f"HunyuanVideo 1.5 architecture, width {width}, {config['num_layers']} blocks"
