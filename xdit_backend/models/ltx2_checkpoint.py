"""LTX-2 single files in the original (Lightricks' / ComfyUI's) key layout, read into diffusers' LTX-2 transformer
with its two text connectors (ltx2.build_transformer).

ComfyUI loads Lightricks' names unchanged (supported_models.LTXAV has no key conversion); diffusers' names differ
in a few module names (its single-file converter, ``convert_ltx2_transformer_to_diffusers``, renames them and drops
the connectors, which its pipeline holds). The table here is that renaming, backwards, per diffusers key.

The config is ComfyUI's: the sizes from the shapes (comfy/model_detection.py: 32 heads, head size from attn2's keys),
then everything the file's embedded metadata says (its ``config`` JSON's ``transformer``: 2.0 or 2.3, positions,
RoPE, the cross-modal timestep scale, the connectors), each mapped to diffusers' name: a safetensors header's, or a
GGUF's ``config`` string (ComfyUI-GGUF hands it to ComfyUI as the header). A file without that metadata gets ComfyUI's
LTXAVModel defaults, as ComfyUI gives it; one whose weights are 2.3's (gated attention) is refused: its RoPE layout and
positions are only in that config.
"""

from __future__ import annotations

import json

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("patchify_proj.weight", "audio_patchify_proj.weight",
           "av_ca_a2v_gate_adaln_single.emb.timestep_embedder.linear_1.weight")
detect_prefix = prefix_detector(MARKERS)

# diffusers module path (its start) → the original's, longest first where one is the other's prefix
_RENAMED = (
    ("audio_proj_in.", "audio_patchify_proj."),
    ("proj_in.", "patchify_proj."),
    ("audio_prompt_adaln.", "audio_prompt_adaln_single."),
    ("prompt_adaln.", "prompt_adaln_single."),
    ("audio_time_embed.", "audio_adaln_single."),
    ("time_embed.", "adaln_single."),
    ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
    ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
    ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
    ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single."),
)
# names inside a path (block tables, q/k norms, the connectors' block list)
_INNER = (
    (".video_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_video"),
    (".audio_a2v_cross_attn_scale_shift_table", ".scale_shift_table_a2v_ca_audio"),
    (".norm_q.", ".q_norm."),
    (".norm_k.", ".k_norm."),
    ("_embeddings_connector.transformer_blocks.", "_embeddings_connector.transformer_1d_blocks."),
)


def original_key(key: str) -> str:
    """The original layout's name of a diffusers LTX-2 parameter."""
    for new, old in _RENAMED:
        if key.startswith(new):
            key = old + key[len(new):]
            break
    for new, old in _INNER:
        key = key.replace(new, old)
    return key


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers parameter key (``prefix``: the file's key prefix)."""
    return {key: TensorSource(prefix + original_key(key)) for key in diffusers_keys}


HEADS = 32  # model_detection.py: attention_head_dim = attn2.to_k rows // 32 (both streams)
# ComfyUI's LTXAVModel defaults, for what a file's metadata leaves out (av_model.py LTXAVModel.__init__, its
# _init_model_components for the connectors, model.py LTXBaseModel for RoPE)
DEFAULTS = {"caption_channels": 3840, "positional_embedding_theta": 10000.0,
            "positional_embedding_max_pos": [20, 2048, 2048], "audio_positional_embedding_max_pos": [20],
            "causal_temporal_positioning": False, "use_middle_indices_grid": False, "timestep_scale_multiplier": 1000.0,
            "av_ca_timestep_scale_multiplier": 1.0, "apply_gated_attention": False,
            "caption_proj_before_connector": False, "caption_projection_first_linear": True,
            "cross_attention_adaln": False, "ff_bias": True, "audio_ff_bias": True, "use_prompt_adaln_single": True,
            "rope_type": "interleaved", "frequencies_precision": "float32", "connector_num_attention_heads": 30,
            "connector_attention_head_dim": 128, "connector_num_layers": 2, "connector_num_learnable_registers": 128,
            "connector_positional_embedding_max_pos": [4096], "connector_apply_gated_attention": False}


def metadata_config(path: str) -> dict:
    """The ``transformer`` part of the ``config`` JSON a Lightricks file embeds in its safetensors metadata (or a GGUF
    in its ``config`` field); {} for a file without (one re-saved or converted without its metadata)."""
    from . import gguf_blocks, safetensors_file

    if gguf_blocks.is_gguf(path):
        from .gguf_file import string_field

        metadata = {"config": string_field(gguf_blocks.open_reader(path), "config") or "{}"}
    else:
        with safetensors_file.open_file(path) as handle:
            metadata = handle.metadata() or {}
    try:
        config = json.loads(metadata.get("config", "{}"))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: its embedded LTX-2 config is not JSON ({exc})", "re-download the file") from None
    return config.get("transformer", {}) if isinstance(config, dict) else {}


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """The built transformer's config (diffusers' names, the connectors', the positions') for an LTX-2 file."""
    shape = FileShapes(shapes, prefix)
    comfy = {**DEFAULTS, "num_attention_heads": HEADS, "audio_num_attention_heads": HEADS,
             "attention_head_dim": shape("transformer_blocks.0.attn2.to_k.weight")[0] // HEADS,
             "audio_attention_head_dim": shape("transformer_blocks.0.audio_attn2.to_k.weight")[0] // HEADS,
             "cross_attention_dim": shape("transformer_blocks.0.attn2.to_k.weight")[1],
             "audio_cross_attention_dim": shape("transformer_blocks.0.audio_attn2.to_k.weight")[1],
             **metadata_config(path)}
    if not comfy["apply_gated_attention"] and "transformer_blocks.0.attn1.to_gate_logits.weight" in shape:
        raise UserError(f"{path}: an LTX-2.3 file (gated attention) without the config Lightricks embeds in it, which "
                        "holds its RoPE layout and positions",
                        "use Lightricks' or Comfy-Org's LTX-2.3 file as released, or a GGUF converted with its config "
                        "kept (a 'config' metadata field, as ComfyUI-GGUF reads it)")
    if comfy["caption_proj_before_connector"] and comfy["caption_projection_first_linear"]:
        raise UserError(f"{path}: an LTX-2 variant with a text projection before its connectors "
                        "(caption_projection_first_linear), which is not run yet", "use an LTX-2.0 or 2.3 file")
    if "keyframes_abs_pos_embedding" in shape:
        raise UserError(f"{path}: an LTX-2.5 file (its keyframe embedding), which is not run yet",
                        "use an LTX-2.0 or 2.3 file")
    gated, adaln, rope = comfy["apply_gated_attention"], comfy["cross_attention_adaln"], comfy["rope_type"]
    video_max = comfy["positional_embedding_max_pos"]

    def connector(heads: int, head_dim: int) -> dict:
        return dict(num_attention_heads=heads, attention_head_dim=head_dim, num_layers=comfy["connector_num_layers"],
                    num_learnable_registers=comfy["connector_num_learnable_registers"],
                    rope_base_seq_len=comfy["connector_positional_embedding_max_pos"][0],
                    rope_theta=comfy["positional_embedding_theta"],
                    rope_type="split" if comfy.get("rope_type", "split") == "split" else "interleaved",
                    gated_attention=comfy["connector_apply_gated_attention"])

    video_heads, video_head_dim = comfy["connector_num_attention_heads"], comfy["connector_attention_head_dim"]
    return dict(
        num_attention_heads=comfy["num_attention_heads"], attention_head_dim=comfy["attention_head_dim"],
        cross_attention_dim=comfy["cross_attention_dim"], audio_num_attention_heads=comfy["audio_num_attention_heads"],
        audio_attention_head_dim=comfy["audio_attention_head_dim"],
        audio_cross_attention_dim=comfy["audio_cross_attention_dim"],
        num_layers=count_blocks(shapes, "transformer_blocks", prefix), caption_channels=comfy["caption_channels"],
        pos_embed_max_pos=video_max[0], base_height=video_max[1], base_width=video_max[2],
        audio_pos_embed_max_pos=comfy["audio_positional_embedding_max_pos"][0],
        gated_attn=gated, audio_gated_attn=gated, cross_attn_mod=adaln, audio_cross_attn_mod=adaln,
        use_prompt_embeddings=not comfy["caption_proj_before_connector"], rope_type=rope,
        rope_double_precision=comfy["frequencies_precision"] == "float64",
        rope_theta=comfy["positional_embedding_theta"],
        timestep_scale_multiplier=comfy["timestep_scale_multiplier"],
        cross_attn_timestep_scale_multiplier=comfy["av_ca_timestep_scale_multiplier"],
        ff_bias=comfy["ff_bias"], audio_ff_bias=comfy["audio_ff_bias"],
        use_prompt_adaln_single=comfy["use_prompt_adaln_single"],
        connector=dict(video=connector(video_heads, video_head_dim),
                       audio=connector(comfy.get("audio_connector_num_attention_heads", video_heads),
                                       comfy.get("audio_connector_attention_head_dim", video_head_dim))),
        positions=dict(causal=comfy["causal_temporal_positioning"], middle=comfy["use_middle_indices_grid"]))


def variant(config: dict) -> str:
    name = "LTX-2.3" if not config.get("use_prompt_embeddings", True) else "LTX-2.0"
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return name if (width, config["num_layers"]) == (4096, 48) else f"{name} architecture, width {width}, " \
        f"{config['num_layers']} blocks"
