"""CogVideoX single files (THUDM's SAT key layout, diffusers' names, ComfyUI's) read into diffusers' CogVideoX.

The layout is that of THUDM's SAT checkpoints (``model.diffusion_model.`` prefixed, or bare), as
diffusers' scripts/convert_cogvideox_to_diffusers.py reads it: blocks under
``transformer.layers.N``, a fused ``query_key_value`` projection (cut into q, k, v rows), and one
AdaLN modulation per block of 12 chunks (shift, scale, gate for the video's attention and MLP,
then the same six for the text) that diffusers splits between ``norm1`` (attention: chunks 0-2 and
6-8) and ``norm2`` (MLP: chunks 3-5 and 9-11). The position tables (2B's sin-cos
``pos_embedding``, 5B's RoPE ``freqs_cos`` / ``freqs_sin``) are buffers that diffusers computes
itself; they are read only to tell the two apart. CogVideoX1.5-5B-I2V (32 input channels: the start image's
latent beside the video's; an ``ofs_embed`` MLP added to the time embedding) loads; CogVideoX-5b-I2V (its learned
position table, which ComfyUI's versions have read three ways) is refused by name.

Two more layouts name every tensor by module, so their table is a rename (``renamed``):
diffusers' own names (``transformer_blocks.N.attn1.to_q``, ``patch_embed.proj``: a diffusers
transformer saved as one file, e.g. kijai's ComfyUI-CogVideoXWrapper files) and ComfyUI's
(``blocks.N.q``, ``time_embedding_linear_1``: Comfy-Org/ComfyUI's comfy/ldm/cogvideo/model.py; its
comfy/model_detection.py tells CogVideoX by ``blocks.0.norm1.linear.weight``). Neither holds the
2B's position table, so there the position kind is read off the width (1920: 2B, sin-cos).
A renamed layout's config carries ``"_key_layout"`` (diffusers' ``register_to_config`` keeps
``_`` keys out of ``__init__``), so the table can be built from the config alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

MARKERS = ("mixins.patch_embed.proj.weight", "mixins.final_layer.linear.weight", "transformer.final_layernorm.weight")
LATENT_CHANNELS = 16
PATCH = 2  # every CogVideoX: 2 × 2 latent cells per token in space
TEXT_SLOTS = 226  # THUDM's text_length (sat/configs/cogvideox_2b.yaml): 2B's position table's text part
# by patch_t: (latent width, height, frames) trained at (THUDM sat/configs; diffusers' conversion script's
# get_transformer_init_kwargs for 1.0 and 1.5)
SAMPLE = {None: (90, 60, 49), 2: (300, 300, 81)}
WIDTH_2B = 1920  # the only CogVideoX with sin-cos positions (THUDM sat/configs/cogvideox_2b.yaml hidden_size)

# diffusers module -> original one; weight / bias names are the same on both sides.
_GLOBAL = {
    "patch_embed.proj": "mixins.patch_embed.proj",
    "patch_embed.text_proj": "mixins.patch_embed.text_proj",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "norm_final": "transformer.final_layernorm",
    "norm_out.norm": "mixins.final_layer.norm_final",
    "norm_out.linear": "mixins.final_layer.adaLN_modulation.1",  # (shift, scale) on both sides
    "proj_out": "mixins.final_layer.linear",
    "ofs_embedding.linear_1": "ofs_embed.0",  # 1.5-I2V: Sequential(Linear, SiLU, Linear), as time_embed
    "ofs_embedding.linear_2": "ofs_embed.2",
}
_BLOCK = {  # under transformer.layers.N
    "norm1.norm": "input_layernorm",
    "norm2.norm": "post_attention_layernorm",
    "attn1.to_out.0": "attention.dense",
    "ff.net.0.proj": "mlp.dense_h_to_4h",
    "ff.net.2": "mlp.dense_4h_to_h",
}
_ADALN = "mixins.adaln_layer"

LAYOUT_KEY = "_key_layout"  # in a config read from a renamed layout: which one
LAYOUT_MARKERS = {  # keys that tell each renamed layout (all of them present, under one prefix)
    "diffusers": ("patch_embed.proj.weight", "patch_embed.text_proj.weight", "time_embedding.linear_1.weight",
                  "transformer_blocks.0.norm1.linear.weight"),
    # comfy/model_detection.py (Comfy-Org/ComfyUI) tells CogVideoX by blocks.0.norm1.linear.weight
    "comfyui": ("patch_embed.proj.weight", "patch_embed.text_proj.weight", "time_embedding_linear_1.weight",
                "blocks.0.norm1.linear.weight"),
}
detect_prefix = prefix_detector(MARKERS, *LAYOUT_MARKERS.values())  # THUDM's, diffusers', ComfyUI's
# diffusers name -> ComfyUI's (comfy/ldm/cogvideo/model.py: CogVideoXBlock's q, k, v, norm_q, norm_k,
# attn_out, ff_proj, ff_out; the time MLP as two top-level Linears); every other name is the same
_COMFYUI_GLOBAL = {"time_embedding.linear_1": "time_embedding_linear_1",
                   "time_embedding.linear_2": "time_embedding_linear_2",
                   "ofs_embedding.linear_1": "ofs_embedding_linear_1",
                   "ofs_embedding.linear_2": "ofs_embedding_linear_2"}
_COMFYUI_BLOCK = {"attn1.to_q": "q", "attn1.to_k": "k", "attn1.to_v": "v", "attn1.norm_q": "norm_q",
                  "attn1.norm_k": "norm_k", "attn1.to_out.0": "attn_out", "ff.net.0.proj": "ff_proj",
                  "ff.net.2": "ff_out"}


@dataclass(frozen=True)
class OuterBands(TensorSource):
    """The first and last thirds of ``rows``, without the middle third: a block modulation's video
    chunks and its text chunks, which the original interleaves with the other modulation's."""

    def convert(self, rows: torch.Tensor) -> torch.Tensor:
        third = rows.shape[0] // 3
        return torch.cat([rows[:third], rows[2 * third:]], dim=0)  # [6·D, ...]


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers key: in THUDM's layout renames, q/k/v rows of the fused
    projection, and each block's two modulations gathered from the 12 chunks of its one AdaLN
    linear; in a renamed layout the same tensor under its name there."""
    layout = config.get(LAYOUT_KEY)
    if layout is not None:
        return {key: TensorSource(prefix + renamed(key, layout)) for key in diffusers_keys}
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return {key: _source(key, prefix, width) for key in diffusers_keys}


def renamed(key: str, layout: str) -> str:
    """A diffusers key's name in a renamed layout (diffusers: itself)."""
    if layout == "diffusers":
        return key
    module, _, param = key.rpartition(".")
    if module in _COMFYUI_GLOBAL:
        return f"{_COMFYUI_GLOBAL[module]}.{param}"
    block = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module)
    if block is None:
        return key
    index, rest = block.groups()
    return f"blocks.{index}.{_COMFYUI_BLOCK.get(rest, rest)}.{param}"


def _source(key: str, prefix: str, width: int) -> TensorSource:
    module, _, param = key.rpartition(".")
    if module in _GLOBAL:
        return TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
    block, rest = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module).groups()
    layer = f"{prefix}transformer.layers.{block}."
    if rest in _BLOCK:
        return TensorSource(f"{layer}{_BLOCK[rest]}.{param}")
    if rest in ("attn1.to_q", "attn1.to_k", "attn1.to_v"):
        rows = bands([width] * 3)["qkv".index(rest[-1])]
        return TensorSource(f"{layer}attention.query_key_value.{param}", rows=rows)
    if rest in ("attn1.norm_q", "attn1.norm_k"):
        kind = "query" if rest.endswith("q") else "key"
        return TensorSource(f"{prefix}{_ADALN}.{kind}_layernorm_list.{block}.{param}")
    if rest in ("norm1.linear", "norm2.linear"):
        # rows: 12 chunks of D; norm1 takes chunks 0-2 (video) and 6-8 (text), norm2 3-5 and 9-11
        start = 0 if rest == "norm1.linear" else 3 * width
        return OuterBands(f"{prefix}{_ADALN}.adaLN_modulations.{block}.1.{param}", rows=(start, start + 9 * width))
    raise KeyError(key)


def layout_of(keys, prefix: str) -> str | None:
    """Which renamed layout the file's keys under ``prefix`` are in; None: THUDM's."""
    return next((layout for layout, markers in LAYOUT_MARKERS.items()
                 if all(prefix + marker in keys for marker in markers)), None)


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' CogVideoXTransformer3DModel config, read off the tensor shapes; errors name the file."""
    layout = layout_of(shapes, prefix)
    if layout is not None:
        return _renamed_config(shapes, prefix, path, layout)

    shape = FileShapes(shapes, prefix)
    own = shape.own
    patch = shape("mixins.patch_embed.proj.weight")  # Conv2d [D, C, 2, 2] (1.0) or Linear [D, C·pt·2·2] (1.5)
    width = patch[0]
    patch_t, in_channels = _patches(patch, shape("mixins.final_layer.linear.weight"))
    # a learned table beside RoPE's buffers: CogVideoX-5b-I2V's (2B's sin-cos table comes without them)
    _image_input(path, in_channels, {"mixins.pos_embed.pos_embedding", "mixins.pos_embed.freqs_cos"} <= own)
    ofs = shape("ofs_embed.0.weight")[0] if "ofs_embed.0.weight" in own else None
    head_dim = shape(f"{_ADALN}.query_layernorm_list.0.weight")[0]  # the per-head q/k LayerNorm
    time_embed_dim = shape("time_embed.0.weight")[0]
    expected = {
        "transformer.layers.0.attention.query_key_value.weight": [3 * width, width],
        "transformer.layers.0.attention.dense.weight": [width, width],
        f"{_ADALN}.adaLN_modulations.0.1.weight": [12 * width, time_embed_dim],
        "time_embed.0.weight": [time_embed_dim, width],
        "mixins.final_layer.linear.weight": [(patch_t or 1) * PATCH * PATCH * LATENT_CHANNELS, width],
        "mixins.final_layer.adaLN_modulation.1.weight": [2 * width, time_embed_dim],
    }
    _check(path, shape.unexpected(expected), width, head_dim)
    blocks = count_blocks(own, "transformer.layers")
    return _config(width, head_dim, patch_t, time_embed_dim, shape("mixins.patch_embed.text_proj.weight")[1], blocks,
                   "mixins.patch_embed.proj.bias" in own, _rotary(own, width), in_channels, ofs)


def _renamed_config(shapes: dict[str, list[int]], prefix: str, path: str, layout: str) -> dict:
    """The config of a file in diffusers' or ComfyUI's names (read as diffusers' through ``renamed``)."""

    file = FileShapes(shapes, prefix)

    def shape(key):
        return file(renamed(key, layout))

    own = file.own
    patch = shape("patch_embed.proj.weight")  # Conv2d [D, C, 2, 2] (1.0) or Linear [D, C·pt·2·2] (1.5)
    width = patch[0]
    patch_t, in_channels = _patches(patch, shape("proj_out.weight"))
    _image_input(path, in_channels, "patch_embed.pos_embedding" in own)  # a learned position table: 5b-I2V's
    # 1.5-I2V's ofs embedding: diffusers' ofs_embedding.linear_1, ComfyUI's ofs_embedding_linear_1
    ofs_key = renamed("ofs_embedding.linear_1.weight", layout)
    ofs = file(ofs_key)[0] if ofs_key in own else None
    head_dim = shape("transformer_blocks.0.attn1.norm_q.weight")[0]  # the per-head q/k LayerNorm
    time_embed_dim = shape("time_embedding.linear_1.weight")[0]
    expected = {
        "transformer_blocks.0.attn1.to_q.weight": [width, width],
        "transformer_blocks.0.attn1.to_out.0.weight": [width, width],
        "transformer_blocks.0.norm1.linear.weight": [6 * width, time_embed_dim],
        "time_embedding.linear_1.weight": [time_embed_dim, width],
        "proj_out.weight": [(patch_t or 1) * PATCH * PATCH * LATENT_CHANNELS, width],
        "norm_out.linear.weight": [2 * width, time_embed_dim],
    }
    _check(path, {renamed(key, layout): shape(key) for key, want in expected.items() if shape(key) != want},
           width, head_dim)
    blocks = count_blocks(own, "transformer_blocks" if layout == "diffusers" else "blocks")
    config = _config(width, head_dim, patch_t, time_embed_dim, shape("patch_embed.text_proj.weight")[1], blocks,
                     renamed("patch_embed.proj.bias", layout) in own, width != WIDTH_2B, in_channels, ofs)
    return {**config, LAYOUT_KEY: layout}


def _patches(patch: list[int], out: list[int]) -> tuple[int | None, int]:
    """(temporal patch, input channels) from the patch embedding's weight [D, C, 2, 2] (a Conv2d:
    1.0, no temporal patch) or [D, C·pt·2·2] (a Linear: 1.5) and the output projection's [pt·2·2·16, D]."""
    patch_t = None if len(patch) == 4 else out[0] // (PATCH * PATCH * LATENT_CHANNELS)
    return patch_t, patch[1] if patch_t is None else patch[1] // (patch_t * PATCH * PATCH)


def _image_input(path: str, in_channels: int, learned_positions: bool) -> None:
    """Text to video (16 input channels) or 1.5-I2V's image to video (32); a learned position table (5b-I2V) or
    another channel count refused by name."""
    if learned_positions:
        raise UserError(f"{path}: CogVideoX with learned position embeddings (CogVideoX-5b-I2V) is not supported: "
                        "ComfyUI's versions add that table three ways (as trained, as sin-cos, cut to the video)",
                        "use CogVideoX1.5-5B-I2V for image to video, or a CogVideoX text-to-video file")
    if in_channels not in (LATENT_CHANNELS, 2 * LATENT_CHANNELS):
        raise UserError(f"{path}: a CogVideoX with input channels {in_channels} is not supported",
                        "use a CogVideoX text-to-video file (16 input channels) or CogVideoX1.5-5B-I2V (32)")


def _check(path: str, wrong: dict, width: int, head_dim: int) -> None:
    if wrong or width % head_dim:
        raise UserError(f"{path}: its CogVideoX tensors match no CogVideoX variant (width {width}, head size "
                        f"{head_dim}; unexpected shapes: {wrong or 'width not a multiple of the head size'})",
                        "the file may be damaged or of another architecture; re-download it")


def _config(width: int, head_dim: int, patch_t: int | None, time_embed_dim: int, text_dim: int, blocks: int,
            patch_bias: bool, rotary: bool, in_channels: int, ofs: int | None) -> dict:
    sample_width, sample_height, sample_frames = SAMPLE[patch_t]
    return {
        "num_attention_heads": width // head_dim,
        "attention_head_dim": head_dim,
        "in_channels": in_channels,
        "ofs_embed_dim": ofs,
        "out_channels": LATENT_CHANNELS,
        "time_embed_dim": time_embed_dim,
        "text_embed_dim": text_dim,
        "num_layers": blocks,
        "sample_width": sample_width,
        "sample_height": sample_height,
        "sample_frames": sample_frames,
        "patch_size": PATCH,
        "patch_size_t": patch_t,
        "patch_bias": patch_bias,
        "max_text_seq_length": TEXT_SLOTS,
        "use_rotary_positional_embeddings": rotary,
    }


def _rotary(own: set[str], width: int) -> bool:
    """5B and 1.5 (RoPE) or 2B (sin-cos): the position buffer the file carries says; without one,
    only 2B's width (1920) has sin-cos positions."""
    if "mixins.pos_embed.freqs_cos" in own:
        return True
    if "mixins.pos_embed.pos_embedding" in own:
        return False
    return width != WIDTH_2B


FULL_SIZE = {  # (width, blocks, patch_t) of the released text-to-video models
    (1920, 30, None): "CogVideoX-2b",
    (3072, 42, None): "CogVideoX-5b",
    (3072, 42, 2): "CogVideoX1.5-5B",
}


def variant(config: dict) -> str:
    """A name for what the shapes say: the released model at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    name = FULL_SIZE.get((width, config["num_layers"], config["patch_size_t"]))
    image = config.get("in_channels", LATENT_CHANNELS) > LATENT_CHANNELS
    if name:
        return f"{name}-I2V" if image else name
    positions = "RoPE" if config["use_rotary_positional_embeddings"] else "sin-cos positions"
    kind = " image to video" if image else ""
    return f"CogVideoX{kind} architecture, width {width}, {config['num_layers']} blocks, {positions}"
