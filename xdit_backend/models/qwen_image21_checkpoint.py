"""Qwen-Image 2.1 single files (Comfy-Org's ``qwen_image_2.1_*.safetensors``, ComfyUI's key layout) into diffusers.

ComfyUI's Qwen-Image 2.1 (comfy/ldm/qwen_image21/model.py) names its tensors as diffusers'
``QwenImage21Transformer2DModel`` does, but for the feed-forward: its ``img_mlp.gate_up`` holds [gate; up] in one
matrix (one GEMM), which diffusers keeps as ``gate_layer`` and ``proj`` (its converter,
``convert_qwen_image21_transformer_checkpoint_to_diffusers``, splits it the same way). A file with the two halves
apart (``fused_mlp`` off) is read as it is. The config is read off the shapes.
"""

from __future__ import annotations

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector
from .qwen_image_checkpoint import rope_axes  # the same split of a head: (16, 56, 56) at 128

MARKERS = ("txt_in.text_norm.weight", "modulation.1.weight", "img_in.weight")
detect_prefix = prefix_detector(MARKERS)
FULL_SIZE = (4096, 32)  # width, blocks of Qwen-Image 2.1
_HALVES = {"img_mlp.gate_layer": 0, "img_mlp.proj": 1}  # gate_up's [gate; up]


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The file's key for every diffusers parameter key: the same name under ``prefix``, the feed-forward's two
    input projections row halves of ``gate_up`` where the file fuses them."""
    width = config["num_attention_heads"] * config["attention_head_dim"]
    hidden = width * config.get("mlp_ratio", 3)
    table = {}
    for key in diffusers_keys:
        module, param = key.rsplit(".", 1)
        block, _, inside = module.partition(".img_mlp.")
        half = _HALVES.get(f"img_mlp.{inside}") if inside else None
        if half is not None and config.get("fused_mlp", True):
            table[key] = TensorSource(f"{prefix}{block}.img_mlp.gate_up.{param}",
                                      rows=(half * hidden, (half + 1) * hidden))
        else:
            table[key] = TensorSource(prefix + key)
    return table


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' QwenImage21Transformer2DModel config, read off the tensor shapes; errors name the file."""
    shape = FileShapes(shapes, prefix)
    width, in_channels = shape("img_in.weight")
    head_dim = shape("transformer_blocks.0.attn.norm_q.weight")[0]
    fused = "transformer_blocks.0.img_mlp.gate_up.weight" in shape
    hidden = shape("transformer_blocks.0.img_mlp.out.weight")[1]
    expected = {
        "txt_in.in_layer.weight": [width, shape("txt_in.text_norm.weight")[0]],
        "modulation.1.weight": [4 * width, width],
        "transformer_blocks.0.attn.to_q.weight": [width, width],
        "norm_out.linear.weight": [width, width],
        ("transformer_blocks.0.img_mlp.gate_up.weight" if fused else "transformer_blocks.0.img_mlp.proj.weight"):
            [(2 if fused else 1) * hidden, width],
    }
    wrong = shape.unexpected(expected)
    if wrong or width % head_dim or hidden % width:
        raise UserError(
            f"{path}: its Qwen-Image 2.1 tensors match no Qwen-Image 2.1 variant (width {width}, head size {head_dim}; "
            f"unexpected shapes: {wrong or 'width not a multiple of the head size, or the feed-forward of the width'})",
            "the file may be damaged or of another architecture; re-download it")
    return {
        "in_channels": in_channels,
        "out_channels": shape("proj_out.weight")[0],
        "num_layers": count_blocks(shapes, "transformer_blocks", prefix),
        "attention_head_dim": head_dim,
        "num_attention_heads": width // head_dim,
        "context_in_dim": shape("txt_in.text_norm.weight")[0],
        "mlp_ratio": hidden // width,
        "axes_dims_rope": rope_axes(head_dim),
        "fused_mlp": fused,
    }


def variant(config: dict) -> str:
    width = config["attention_head_dim"] * config["num_attention_heads"]
    if (width, config["num_layers"]) == FULL_SIZE:
        return "Qwen-Image 2.1"
    return f"Qwen-Image 2.1 architecture, width {width}, {config['num_layers']} blocks"
