"""LTX-2 single files in the original (Lightricks' / ComfyUI's) key layout, read into diffusers' LTX-2 transformer
with its two text connectors (ltx2.build_transformer).

ComfyUI loads Lightricks' names unchanged (supported_models.LTXAV has no key conversion); diffusers' names differ
in a few module names (its single-file converter, ``convert_ltx2_transformer_to_diffusers``, renames them and drops
the connectors, which its pipeline holds). The table here is that renaming, backwards, per diffusers key.

Reading a file's config is not wired yet: ComfyUI reads LTX-2's (2.0 or 2.3, positions, the cross-modal timestep
scale) from the file's embedded metadata, not from its shapes, and guessing them would give a wrong video.
"""

from __future__ import annotations

from ..errors import UserError
from .checkpoint import TensorSource, prefix_detector

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


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    raise UserError(f"{path} is an LTX-2 file, and LTX-2 files are not read yet: ComfyUI takes an LTX-2 model's "
                    "variant (2.0 or 2.3), its positions and its cross-modal timestep scale from the file's embedded "
                    "metadata, which this backend does not read yet",
                    "run LTX-2 with ComfyUI's own sampler for now; the built-in ltx2-tiny shows the layouts")


def variant(config: dict) -> str:
    return "LTX-2.3" if not config.get("use_prompt_embeddings", True) else "LTX-2.0"
