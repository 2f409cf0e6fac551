"""CogVideoX single files in THUDM's original (SAT) key layout, read into diffusers' CogVideoX.

The layout is that of THUDM's SAT checkpoints (``model.diffusion_model.`` prefixed, or bare), as
diffusers' scripts/convert_cogvideox_to_diffusers.py reads it: blocks under
``transformer.layers.N``, a fused ``query_key_value`` projection (cut into q, k, v rows), and one
AdaLN modulation per block of 12 chunks (shift, scale, gate for the video's attention and MLP,
then the same six for the text) that diffusers splits between ``norm1`` (attention: chunks 0-2 and
6-8) and ``norm2`` (MLP: chunks 3-5 and 9-11). The position tables (2B's sin-cos
``pos_embedding``, 5B's RoPE ``freqs_cos`` / ``freqs_sin``) are buffers that diffusers computes
itself; they are read only to tell the two apart. Image-to-video files (32 input channels, 1.5's
``ofs_embed``) are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import UserError
from .checkpoint import Source, bands, find_prefix

MARKERS = ("mixins.patch_embed.proj.weight", "mixins.final_layer.linear.weight", "transformer.final_layernorm.weight")
LATENT_CHANNELS = 16
PATCH = 2  # every CogVideoX: 2 × 2 latent cells per token in space
TEXT_SLOTS = 226  # THUDM's text_length (sat/configs/cogvideox_2b.yaml): 2B's position table's text part
# by patch_t: (latent width, height, frames) trained at (THUDM sat/configs; diffusers' conversion script's
# get_transformer_init_kwargs for 1.0 and 1.5)
SAMPLE = {None: (90, 60, 49), 2: (300, 300, 81)}

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
}
_BLOCK = {  # under transformer.layers.N
    "norm1.norm": "input_layernorm",
    "norm2.norm": "post_attention_layernorm",
    "attn1.to_out.0": "attention.dense",
    "ff.net.0.proj": "mlp.dense_h_to_4h",
    "ff.net.2": "mlp.dense_4h_to_h",
}
_ADALN = "mixins.adaln_layer"


@dataclass(frozen=True)
class OuterBands(Source):
    """The first and last thirds of ``rows``, without the middle third: a block modulation's video
    chunks and its text chunks, which the original interleaves with the other modulation's."""

    def convert(self, rows: torch.Tensor) -> torch.Tensor:
        third = rows.shape[0] // 3
        return torch.cat([rows[:third], rows[2 * third:]], dim=0)  # [6·D, ...]


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, Source]:
    """The original source of every diffusers key: renames, q/k/v rows of the fused projection, and
    each block's two modulations gathered from the 12 chunks of its one AdaLN linear."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return {key: _source(key, prefix, width) for key in diffusers_keys}


def _source(key: str, prefix: str, width: int) -> Source:
    module, _, param = key.rpartition(".")
    if module in _GLOBAL:
        return Source(f"{prefix}{_GLOBAL[module]}.{param}")
    block, rest = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", module).groups()
    layer = f"{prefix}transformer.layers.{block}."
    if rest in _BLOCK:
        return Source(f"{layer}{_BLOCK[rest]}.{param}")
    if rest in ("attn1.to_q", "attn1.to_k", "attn1.to_v"):
        rows = bands([width] * 3)["qkv".index(rest[-1])]
        return Source(f"{layer}attention.query_key_value.{param}", rows=rows)
    if rest in ("attn1.norm_q", "attn1.norm_k"):
        kind = "query" if rest.endswith("q") else "key"
        return Source(f"{prefix}{_ADALN}.{kind}_layernorm_list.{block}.{param}")
    if rest in ("norm1.linear", "norm2.linear"):
        # rows: 12 chunks of D; norm1 takes chunks 0-2 (video) and 6-8 (text), norm2 3-5 and 9-11
        start = 0 if rest == "norm1.linear" else 3 * width
        return OuterBands(f"{prefix}{_ADALN}.adaLN_modulations.{block}.1.{param}", rows=(start, start + 9 * width))
    raise KeyError(key)


def detect_prefix(keys) -> str | None:
    """The key prefix under which the file holds a CogVideoX model in THUDM's layout, or None."""
    return find_prefix(keys, MARKERS)


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' CogVideoXTransformer3DModel config, read off the tensor shapes; errors name the file."""

    def shape(key):
        return list(shapes[prefix + key])

    own = {key[len(prefix):] for key in shapes if key.startswith(prefix)}
    patch = shape("mixins.patch_embed.proj.weight")  # Conv2d [D, C, 2, 2] (1.0) or Linear [D, C·pt·2·2] (1.5)
    width = patch[0]
    out_rows = shape("mixins.final_layer.linear.weight")[0]  # pt·2·2·16
    patch_t = None if len(patch) == 4 else out_rows // (PATCH * PATCH * LATENT_CHANNELS)
    in_channels = patch[1] if patch_t is None else patch[1] // (patch_t * PATCH * PATCH)
    if in_channels != LATENT_CHANNELS or "ofs_embed.0.weight" in own:
        raise UserError(f"{path}: image-to-video CogVideoX is not supported (input channels {in_channels}"
                        f"{', an ofs embedding' if 'ofs_embed.0.weight' in own else ''})",
                        "use a CogVideoX text-to-video file (CogVideoX-2b, CogVideoX-5b, CogVideoX1.5-5B)")
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
    wrong = {key: shape(key) for key, want in expected.items() if shape(key) != want}
    if wrong or width % head_dim:
        raise UserError(f"{path}: its CogVideoX tensors match no CogVideoX variant (width {width}, head size "
                        f"{head_dim}; unexpected shapes: {wrong or 'width not a multiple of the head size'})",
                        "the file may be damaged or of another architecture; re-download it")
    sample_width, sample_height, sample_frames = SAMPLE[patch_t]
    return {
        "num_attention_heads": width // head_dim,
        "attention_head_dim": head_dim,
        "in_channels": in_channels,
        "out_channels": LATENT_CHANNELS,
        "time_embed_dim": time_embed_dim,
        "text_embed_dim": shape("mixins.patch_embed.text_proj.weight")[1],
        "num_layers": len({int(m.group(1)) for key in own if (m := re.match(r"transformer\.layers\.(\d+)\.", key))}),
        "sample_width": sample_width,
        "sample_height": sample_height,
        "sample_frames": sample_frames,
        "patch_size": PATCH,
        "patch_size_t": patch_t,
        "patch_bias": "mixins.patch_embed.proj.bias" in own,
        "max_text_seq_length": TEXT_SLOTS,
        "use_rotary_positional_embeddings": _rotary(own, width),
    }


def _rotary(own: set[str], width: int) -> bool:
    """5B and 1.5 (RoPE) or 2B (sin-cos): the position buffer the file carries says; without one,
    only 2B's width (1920) has sin-cos positions."""
    if "mixins.pos_embed.freqs_cos" in own:
        return True
    if "mixins.pos_embed.pos_embedding" in own:
        return False
    return width != 1920


FULL_SIZE = {  # (width, blocks, patch_t) of the released text-to-video models
    (1920, 30, None): "CogVideoX-2b",
    (3072, 42, None): "CogVideoX-5b",
    (3072, 42, 2): "CogVideoX1.5-5B",
}


def variant(config: dict) -> str:
    """A name for what the shapes say: the released model at full size, else the architecture."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    name = FULL_SIZE.get((width, config["num_layers"], config["patch_size_t"]))
    positions = "RoPE" if config["use_rotary_positional_embeddings"] else "sin-cos positions"
    return name or f"CogVideoX architecture, width {width}, {config['num_layers']} blocks, {positions}"
