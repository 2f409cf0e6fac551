"""Wan 2.1 / 2.2 text-to-video single files in the original key layout, read into diffusers' Wan.

ComfyUI users keep these in models/diffusion_models (bare keys) or inside a checkpoint
("model.diffusion_model."). The conversion is a table of renames: every diffusers tensor has the
same shape and order as its original (the modulations are (shift, scale, gate, ...) on both sides,
the Conv3d patch embedding is the same kernel), so no rows are cut and nothing is reshaped. It
works at any width and infers the config from the shapes.

Loading note: diffusers' rope tables (``rope.freqs_cos`` / ``freqs_sin``) are non-persistent
buffers, so they are not in the state dict. Nothing re-creates them: the registry builds under
checkpoint.empty_weights, which puts only parameters on the meta device, so the buffers are
computed for real at construction.
"""

from __future__ import annotations

import math
import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("patch_embedding.weight", "time_projection.1.weight", "head.modulation")
detect_prefix = prefix_detector(MARKERS)
HEAD_DIM = 128  # every released Wan: 1.3B 1536 = 12 x 128, 5B 3072 = 24 x 128, 14B 5120 = 40 x 128
SMALL_HEAD_DIM = 32  # for test-sized widths that are not a multiple of 128 (64 = 2 x 32)
KNOWN = {"patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head"}

# diffusers module (or parameter) -> original one; weight / bias names are the same on both sides.
_GLOBAL = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",  # [1, 2, D], (shift, scale) in both
}
_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k"}
_BLOCK = {
    "scale_shift_table": "modulation",  # [1, 6, D], same order in both
    "norm2": "norm3",  # the affine cross-attention norm: diffusers calls it norm2, Wan norm3
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    **{f"{ours}.{a}": f"{theirs}.{b}" for ours, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
       for a, b in _ATTENTION.items()},
}


def _original(key: str) -> str:
    """The original key (without prefix) of one diffusers key; KeyError if it has none."""
    match = re.fullmatch(r"blocks\.(\d+)\.(.+)", key)
    base, table, rest = (f"blocks.{match.group(1)}.", _BLOCK, match.group(2)) if match else ("", _GLOBAL, key)
    if rest in table:
        return base + table[rest]
    module, _, param = rest.rpartition(".")
    if module in table:
        return f"{base}{table[module]}.{param}"
    raise KeyError(key)


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers key (``config`` is unused: Wan fuses no tensors)."""
    return {key: TensorSource(prefix + _original(key)) for key in diffusers_keys}


def head_dim(width: int) -> int | None:
    """Wan's head size: 128 at every released size; 32 for test-sized widths not a multiple of 128."""
    return next((size for size in (HEAD_DIM, SMALL_HEAD_DIM) if width % size == 0), None)


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' WanTransformer3DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    own = shape.own
    tops = {key.split(".", 1)[0] for key in own}
    width, in_channels, *patch = shape("patch_embedding.weight")  # Conv3d: [D, C_in, p_t, p_h, p_w]
    # head.head is Linear(D, C_out * p_t * p_h * p_w): its rows are C_out patch cells
    out_channels, leftover = divmod(shape("head.head.weight")[0], math.prod(patch))
    if "img_emb" in tops or any(".k_img." in key for key in own) or (not leftover and out_channels != in_channels):
        raise UserError(
            f"{path}: image-to-video Wan is not supported yet (input channels {in_channels}, output "
            f"channels {out_channels}{', an image embedder' if 'img_emb' in tops else ''})",
            "use a Wan text-to-video file (Wan2.1-T2V, Wan2.2-T2V-A14B expert, Wan2.2-TI2V-5B)")
    if tops - KNOWN:
        raise UserError(f"{path}: a Wan variant with extra modules ({', '.join(sorted(tops - KNOWN))}) "
                        "is not supported", "use a plain Wan text-to-video file")
    head = head_dim(width)
    ffn_dim = shape("blocks.0.ffn.0.weight")[0]
    expected = {
        "patch_embedding.bias": [width],
        "time_projection.1.weight": [6 * width, width],  # the six block modulations, concatenated
        "text_embedding.2.weight": [width, width],
        "blocks.0.self_attn.q.weight": [width, width],
        "blocks.0.cross_attn.k.weight": [width, width],
        "blocks.0.self_attn.norm_q.weight": [width],  # one RMS norm across all heads
        "blocks.0.ffn.2.weight": [width, ffn_dim],
        "blocks.0.modulation": [1, 6, width],
        "head.head.weight": [out_channels * math.prod(patch), width],  # differs if the rows do not divide
        "head.modulation": [1, 2, width],
    }
    wrong = shape.unexpected(expected)
    if head is None or wrong:
        raise UserError(
            f"{path}: its Wan tensors match no Wan variant (width {width}, patch {tuple(patch)}; unexpected "
            f"shapes: {wrong or f'width not a multiple of {HEAD_DIM} or {SMALL_HEAD_DIM}'})",
            "the file may be damaged or of another architecture; re-download it")
    return {
        "patch_size": tuple(patch),
        "num_attention_heads": width // head,
        "attention_head_dim": head,
        "in_channels": in_channels,
        "out_channels": out_channels,
        "text_dim": shape("text_embedding.0.weight")[1],
        "freq_dim": shape("time_embedding.0.weight")[1],
        "ffn_dim": ffn_dim,
        "num_layers": count_blocks(own, "blocks"),
        "cross_attn_norm": "blocks.0.norm3.weight" in own,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }


FULL_SIZE = {  # (width, blocks, ffn, channels) of the released models
    (1536, 30, 8960, 16): "Wan2.1-T2V-1.3B",
    (5120, 40, 13824, 16): "Wan-14B (Wan2.1-T2V-14B or a Wan2.2-A14B expert)",
    (3072, 30, 14336, 48): "Wan2.2-TI2V-5B",
}


def variant(config: dict) -> str:
    """A name for what the shapes say: the released model at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    name = FULL_SIZE.get((width, config["num_layers"], config["ffn_dim"], config["in_channels"]))
    return name or f"Wan architecture, width {width}, {config['num_layers']} blocks"
