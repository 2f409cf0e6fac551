"""Wan 2.1 / 2.2 single files in the original key layout, read into diffusers' Wan: text to video, and image to
video (Wan 2.1 I2V and FLF2V with their CLIP image embedder, Wan 2.2 I2V A14B without one: 36 input channels, the
latent's 16 and the 20 ComfyUI concatenates to it), and Wan 2.1 Fun Control (48: the control video's latent and the
start image's, which ComfyUI's WAN21 concatenates without a mask).

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
KNOWN = {"patch_embedding", "text_embedding", "time_embedding", "time_projection", "blocks", "head", "img_emb"}

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
    # the CLIP image embedder of Wan 2.1 I2V / FLF2V: LayerNorm, Linear, GELU, Linear, LayerNorm in both
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",  # FLF2V: [1, 2·257, 1280]
}
_ATTENTION = {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "norm_q": "norm_q", "norm_k": "norm_k"}
_BLOCK = {
    "scale_shift_table": "modulation",  # [1, 6, D], same order in both
    "norm2": "norm3",  # the affine cross-attention norm: diffusers calls it norm2, Wan norm3
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
    "attn2.add_k_proj": "cross_attn.k_img",  # the image tokens' keys and values (I2V with an image embedder)
    "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    **{f"{ours}.{a}": f"{theirs}.{b}" for ours, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
       for a, b in _ATTENTION.items()},
}


def original_key(key: str) -> str:
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
    return {key: TensorSource(prefix + original_key(key)) for key in diffusers_keys}


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
    image_embedder = "img_emb.proj.0.weight" in own
    # the latent alone (text to video, TI2V-5B), + 20 (image to video, FLF2V, Fun InP: the mask's 4 and the image's
    # 16), + 32 (Wan 2.1 Fun Control: the control video's latent and the start image's)
    if not leftover and in_channels - out_channels not in (0, 20, 32):
        raise UserError(f"{path}: a Wan file with {in_channels} input channels and {out_channels} output channels "
                        "is not supported", "use a Wan text-to-video file, an image-to-video one (36 input "
                        "channels) or Wan 2.1 Fun Control (48)")
    if image_embedder != ("blocks.0.cross_attn.k_img.weight" in own):
        raise UserError(f"{path}: its image embedder and its blocks' image keys do not go together",
                        "the file may be incomplete; re-download it")
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
    image = {}
    if image_embedder:
        image = {"image_dim": shape("img_emb.proj.0.weight")[0], "added_kv_proj_dim": width}
        if "img_emb.emb_pos" in own:  # FLF2V: the first and the last frame's tokens, each with its position
            image["pos_embed_seq_len"] = shape("img_emb.emb_pos")[1]
    return {
        **image,
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


FULL_SIZE = {  # (width, blocks, ffn, input channels, image embedder) of the released models
    (1536, 30, 8960, 16, None): "Wan2.1-T2V-1.3B",
    (5120, 40, 13824, 16, None): "Wan-14B (Wan2.1-T2V-14B or a Wan2.2-T2V-A14B expert)",
    (3072, 30, 14336, 48, None): "Wan2.2-TI2V-5B",
    (5120, 40, 13824, 36, 1280): "Wan2.1-I2V-14B (480p or 720p)",
    (5120, 40, 13824, 36, None): "a Wan2.2-I2V-A14B expert",
    (1536, 30, 8960, 48, 1280): "Wan2.1-Fun-1.3B-Control",
    (5120, 40, 13824, 48, 1280): "Wan2.1-Fun-14B-Control",
}


def variant(config: dict) -> str:
    """A name for what the shapes say: the released model at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    name = FULL_SIZE.get((width, config["num_layers"], config["ffn_dim"], config["in_channels"],
                          config.get("image_dim")))
    if name and config.get("pos_embed_seq_len"):
        name = "Wan2.1-FLF2V-14B"
    extra = config["in_channels"] - config["out_channels"]
    kind = {0: "", 32: " Fun Control"}.get(extra, " image to video")
    return name or f"Wan{kind} architecture, width {width}, {config['num_layers']} blocks"
