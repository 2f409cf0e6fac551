"""Qwen-Image single files (Comfy-Org's ``qwen_image_*.safetensors``, ComfyUI's key layout) into diffusers.

ComfyUI's Qwen-Image model (comfy/ldm/qwen_image/model.py) names every tensor as diffusers'
``QwenImageTransformer2DModel`` does (measured: the two state dicts have the same keys and shapes,
and ``norm_out.linear`` is (scale, shift) in both), so the table is the identity under the file's
prefix. The config comes from the shapes; Qwen-Image, -2512, -Edit and -Edit-2509 share one
architecture (an Edit model is the same weights' shapes used with reference latents).
"""

from __future__ import annotations

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("txt_norm.weight", "img_in.weight", "transformer_blocks.0.img_mod.1.weight",
           "transformer_blocks.0.attn.add_q_proj.weight")
detect_prefix = prefix_detector(MARKERS)
FULL_SIZE = (3072, 60)  # width, blocks of Qwen-Image (20 B)
ZERO_COND_MARKER = "__index_timestep_zero__"


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The file's key for every diffusers parameter key: the same name under ``prefix``."""
    return {key: TensorSource(prefix + key) for key in diffusers_keys}


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' QwenImageTransformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    blocks = count_blocks(shapes, "transformer_blocks", prefix)
    out_values = shape("proj_out.weight")[0]
    if "time_text_embed.addition_t_embedding.weight" in shape:
        raise UserError(f"{path}: a Qwen-Image-Layered model (it has an additional timestep embedding), "
                        "which this backend does not run yet", "use Qwen-Image or Qwen-Image-Edit")
    expected = {
        "txt_in.weight": [width, shape("txt_norm.weight")[0]],
        "transformer_blocks.0.img_mod.1.weight": [6 * width, width],
        "transformer_blocks.0.attn.to_q.weight": [width, width],
        "transformer_blocks.0.img_mlp.net.0.proj.weight": [4 * width, width],
        "norm_out.linear.weight": [2 * width, width],
        "proj_out.weight": [out_values, width],
    }
    wrong = shape.unexpected(expected)
    if wrong or width % head_dim or in_channels % 4 or out_values % 4:
        raise UserError(
            f"{path}: its Qwen-Image tensors match no Qwen-Image variant (width {width}, head size {head_dim}; "
            f"unexpected shapes: {wrong or 'width not a multiple of the head size, or channels not 2×2 patches'})",
            "the file may be damaged or of another architecture; re-download it")
    return {
        "patch_size": 2,
        "in_channels": in_channels,
        "out_channels": out_values // 4,
        "num_layers": blocks,
        "attention_head_dim": head_dim,
        "num_attention_heads": width // head_dim,
        "joint_attention_dim": shape("txt_norm.weight")[0],
        "axes_dims_rope": rope_axes(head_dim),
        # Qwen-Image-Edit-2511: ComfyUI's files carry this empty marker (its model's "index_timestep_zero" default)
        "zero_cond_t": ZERO_COND_MARKER in shape,
    }


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Qwen-Image's RoPE split of a head: (16, 56, 56) at 128; the same proportions, even, at other sizes."""
    side = (7 * head_dim // 16) // 2 * 2
    return (head_dim - 2 * side, side, side)


def variant(config: dict) -> str:
    """A name for what the shapes say (Qwen-Image and its Edit models share every shape)."""
    width = config["attention_head_dim"] * config["num_attention_heads"]
    if (width, config["num_layers"]) == FULL_SIZE:
        return "Qwen-Image-Edit-2511 (20 B)" if config.get("zero_cond_t") else "Qwen-Image / Qwen-Image-Edit (20 B)"
    return f"Qwen-Image architecture, width {width}, {config['num_layers']} blocks"
