"""HunyuanDiT 1.0–1.2 single files in Tencent's original key layout, read into diffusers' HunyuanDiT.

Tencent's ``pytorch_model_*.pt`` state dicts, as ComfyUI's comfy/ldm/hydit/models.py names them:
bare in models/diffusion_models, or inside a checkpoint ("model.diffusion_model."; ComfyUI's
hunyuan_dit_1.x.safetensors). The conversion is a table: renames, the fused self-attention
``Wqkv`` and cross-attention ``kv_proj`` cut into bands of rows, and the final modulation's
halves swapped ((shift, scale) → diffusers' (scale, shift)). The original's norms are named by
position in the block (norm2 before the MLP, norm3 before the cross-attention); diffusers' the
other way round. 1.0 / 1.1 are told from 1.2 by the style embedding (with it, the size embedding).
"""

from __future__ import annotations

import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

MARKERS = ("mlp_t5.0.weight", "x_embedder.proj.weight", "extra_embedder.0.weight", "text_embedding_padding")
detect_prefix = prefix_detector(MARKERS)
SIZE_EMBEDDING = 6 * 256  # six image-size numbers, each a 256-wide sinusoid (comfy/ldm/hydit/models.py)

# diffusers module (or parameter) -> original one; weight / bias names are the same on both sides.
_GLOBAL = {
    "text_embedding_padding": "text_embedding_padding",  # [77 + 256, 1024]
    "text_embedder.linear_1": "mlp_t5.0",
    "text_embedder.linear_2": "mlp_t5.2",
    "pos_embed.proj": "x_embedder.proj",
    "time_extra_emb.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_extra_emb.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_extra_emb.extra_embedder.linear_1": "extra_embedder.0",
    "time_extra_emb.extra_embedder.linear_2": "extra_embedder.2",
    "time_extra_emb.style_embedder": "style_embedder",  # 1.0 / 1.1 only
    **{f"time_extra_emb.pooler.{name}": f"pooler.{name}"
       for name in ("positional_embedding", "q_proj", "k_proj", "v_proj", "c_proj")},
    "proj_out": "final_layer.linear",
}
_BLOCK = {
    "norm1.linear": "default_modulation.1",
    "norm1.norm": "norm1",
    "attn1.norm_q": "attn1.q_norm",
    "attn1.norm_k": "attn1.k_norm",
    "attn1.to_out.0": "attn1.out_proj",
    "norm2": "norm3",  # before the cross-attention
    "attn2.to_q": "attn2.q_proj",
    "attn2.norm_q": "attn2.q_norm",
    "attn2.norm_k": "attn2.k_norm",
    "attn2.to_out.0": "attn2.out_proj",
    "norm3": "norm2",  # before the MLP
    "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2",
    "skip_norm": "skip_norm",  # second-half blocks only
    "skip_linear": "skip_linear",
}
_FUSED = {"attn1.to_q": ("attn1.Wqkv", 0, 3), "attn1.to_k": ("attn1.Wqkv", 1, 3), "attn1.to_v": ("attn1.Wqkv", 2, 3),
          "attn2.to_k": ("attn2.kv_proj", 0, 2), "attn2.to_v": ("attn2.kv_proj", 1, 2)}  # (original, band, of)


def source(key: str, prefix: str, width: int) -> TensorSource:
    """The original source of one diffusers key; KeyError if it has none."""
    if key in ("norm_out.linear.weight", "norm_out.linear.bias"):
        return TensorSource(prefix + "final_layer.adaLN_modulation.1." + key.rpartition(".")[2], swap_halves=True)
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)\.(weight|bias)", key)
    if match:
        block, module, param = match.groups()
        base = f"{prefix}blocks.{block}."
        if module in _FUSED:
            original, band, of = _FUSED[module]
            return TensorSource(f"{base}{original}.{param}", rows=bands([width] * of)[band])
        return TensorSource(f"{base}{_BLOCK[module]}.{param}")
    if key in _GLOBAL:
        return TensorSource(prefix + _GLOBAL[key])
    module, _, param = key.rpartition(".")
    return TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers key."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return {key: source(key, prefix, width) for key in diffusers_keys}


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' HunyuanDiT2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    own = shape.own
    width, in_channels, patch, _ = shape("x_embedder.proj.weight")  # Conv2d: [D, C, p, p]
    head_dim = shape("blocks.0.attn1.q_norm.weight")[0]  # the QK layer norm is per head
    depth = count_blocks(own, "blocks")
    text_len_t5 = shape("pooler.positional_embedding")[0] - 1  # the pooler's extra mean token
    text_len = shape("text_embedding_padding")[0] - text_len_t5
    clip_dim, mt5_dim = shape("text_embedding_padding")[1], shape("mlp_t5.0.weight")[1]
    pooled = shape("pooler.c_proj.weight")[0]
    size_conditioning = "style_embedder.weight" in own
    ffn = shape("blocks.0.mlp.fc1.weight")[0]
    extra = pooled + (SIZE_EMBEDDING + width if size_conditioning else 0)
    expected = {
        "blocks.0.attn1.Wqkv.weight": [3 * width, width],
        "blocks.0.attn2.kv_proj.weight": [2 * width, clip_dim],
        "blocks.0.default_modulation.1.weight": [width, width],
        "extra_embedder.0.weight": [4 * width, extra],
        "mlp_t5.2.weight": [clip_dim, 4 * mt5_dim],
        "final_layer.linear.weight": [patch * patch * 2 * in_channels, width],  # ε (v) and the variance
        "final_layer.adaLN_modulation.1.weight": [2 * width, width],
    }
    if depth - 1 > depth // 2:  # the blocks after the middle one take a skip (none at depth 2)
        expected[f"blocks.{depth - 1}.skip_linear.weight"] = [width, 2 * width]
    wrong = {key: shape(key) if key in shape else "missing" for key, want in expected.items()
             if key not in shape or shape(key) != want}
    if wrong or width % head_dim or depth % 2:
        raise UserError(
            f"{path}: its HunyuanDiT tensors match no HunyuanDiT variant (width {width}, head size {head_dim}, "
            f"{depth} blocks; unexpected shapes: {wrong or 'width not a multiple of the head size, or an odd depth'})",
            "the file may be damaged or of another architecture; re-download it")
    return {
        "num_attention_heads": width // head_dim,
        "attention_head_dim": head_dim,
        "in_channels": in_channels,
        "patch_size": patch,
        "activation_fn": "gelu-approximate",
        "sample_size": 128,  # the patch embedding's nominal size: unused (no absolute positions)
        "hidden_size": width,
        "num_layers": depth,
        # diffusers sizes the MLP as int(width · ratio): the half keeps DiT-g's 6144 = 1408 × 4.3636… whole
        "mlp_ratio": (ffn + 0.5) / width,
        "learn_sigma": True,
        "cross_attention_dim": clip_dim,
        "norm_type": "layer_norm",
        "cross_attention_dim_t5": mt5_dim,
        "pooled_projection_dim": pooled,
        "text_len": text_len,
        "text_len_t5": text_len_t5,
        "use_style_cond_and_image_meta_size": size_conditioning,
    }


FULL_SIZE = {(1408, 40): "HunyuanDiT-g/2"}  # (width, blocks) of the released models (1.0, 1.1, 1.2)


def variant(config: dict) -> str:
    """A name for what the shapes say: the release (1.0 / 1.1 or 1.2) and the size."""
    version = "1.0 / 1.1" if config["use_style_cond_and_image_meta_size"] else "1.2"
    width = config["num_attention_heads"] * config["attention_head_dim"]
    size = FULL_SIZE.get((width, config["num_layers"]), f"architecture, width {width}, {config['num_layers']} blocks")
    return f"HunyuanDiT {version} ({size})"
