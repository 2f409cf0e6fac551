"""Z-Image single files in the original key layout (Tongyi-MAI's native checkpoints, as
Comfy-Org/z_image_turbo repackages them: models/diffusion_models/z_image_turbo_bf16.safetensors),
read into diffusers' ``ZImageTransformer2DModel``.

The original is ComfyUI's Lumina2/NextDiT layout (comfy/ldm/lumina/model.py): the same module
names as diffusers except ``x_embedder`` / ``final_layer`` (diffusers keys them by patch size,
``all_x_embedder.2-1``), the fused ``attention.qkv`` (diffusers' to_q / to_k / to_v: a band of
rows each), ``attention.out`` (``to_out.0``) and ``q_norm`` / ``k_norm`` (``norm_q`` / ``norm_k``).
diffusers' own single-file converter (convert_z_image_transformer_checkpoint_to_diffusers) is the
same renaming, but it splits each qkv as a whole tensor in memory; the table reads only the rows a
tensor needs (checkpoint.TensorSource), as the other families do. The config comes from the shapes.
"""

from __future__ import annotations

import re

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, bands, count_blocks, prefix_detector

MARKERS = ("x_embedder.weight", "cap_embedder.1.weight", "x_pad_token", "cap_pad_token",
           "layers.0.attention.qkv.weight")
detect_prefix = prefix_detector(MARKERS)
BLOCK_LISTS = ("noise_refiner", "context_refiner", "layers")
HEAD_DIM = 128  # Z-Image: 3840 = 30 × 128 (comfy/model_detection.py: n_heads 30 for dim 3840)
AXES_DIMS = (32, 48, 48)  # RoPE pairs per axis at head size 128 (comfy/model_detection.py, Z-Image)
AXES_LENS = (1536, 512, 512)  # comfy/model_detection.py, Z-Image: caption positions up to 1536
ROPE_THETA = 256.0  # comfy/model_detection.py, Z-Image
PATCH = 2  # 2 × 2 latent cells per token, 1 frame: the only patch Z-Image ships

_GLOBAL = {"all_x_embedder.2-1": "x_embedder", "all_final_layer.2-1": "final_layer"}
_ATTENTION = {"to_out.0": "out", "norm_q": "q_norm", "norm_k": "k_norm"}
_QKV = {"to_q": 0, "to_k": 1, "to_v": 2}
# every block's tensors in the original layout ("adaLN_modulation.0" only in modulated blocks)
_BLOCK_TENSORS = ("attention.qkv.weight", "attention.out.weight", "attention.q_norm.weight", "attention.k_norm.weight",
                  "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight",
                  "attention_norm1.weight", "attention_norm2.weight", "ffn_norm1.weight", "ffn_norm2.weight")


def _source(key: str, prefix: str, width: int) -> TensorSource:
    """The original source of one diffusers key."""
    module, _, param = key.rpartition(".")
    for ours, theirs in _GLOBAL.items():
        if module == ours or module.startswith(ours + "."):
            return TensorSource(prefix + theirs + key[len(ours):])
    match = re.fullmatch(r"(\w+\.\d+\.attention)\.(.+)", module)
    if match:
        block, inner = match.groups()
        if inner in _QKV:  # fused [q; k; v] rows, D each
            return TensorSource(f"{prefix}{block}.qkv.{param}", bands([width] * 3)[_QKV[inner]])
        return TensorSource(f"{prefix}{block}.{_ATTENTION.get(inner, inner)}.{param}")
    return TensorSource(prefix + key)  # every other name is the same in both layouts


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers key (``prefix``: the file's key prefix)."""
    return {key: _source(key, prefix, config["dim"]) for key in diffusers_keys}


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' ZImageTransformer2DModel config, read off the tensor shapes; errors name the file."""

    shape = FileShapes(shapes, prefix)
    own = shape.own
    if any(key.startswith("siglip_") for key in own):
        raise UserError(f"{path}: a Z-Image-Omni file (SigLIP image conditioning) is not supported",
                        "use a Z-Image text-to-image file (Z-Image-Turbo, Z-Image)")
    width, cap_feat_dim = shape("cap_embedder.1.weight")  # Linear(cap_feat_dim, D): [D, 2560]
    head = shape("layers.0.attention.q_norm.weight")[0]  # one RMS norm over a head
    patch_values = shape("x_embedder.weight")[1]  # Linear(2 · 2 · C, D)
    in_channels = patch_values // (PATCH * PATCH)
    layers = {name: count_blocks(own, name) for name in BLOCK_LISTS}
    missing = [f"{name}.{i}.{tensor}" for name, count in layers.items() for i in range(count)
               for tensor in _BLOCK_TENSORS + (("adaLN_modulation.0.weight",) if name != "context_refiner" else ())
               if f"{name}.{i}.{tensor}" not in own]
    missing += [key for key in ("t_embedder.mlp.0.weight", "t_embedder.mlp.2.weight", "cap_embedder.0.weight",
                                "final_layer.linear.weight", "final_layer.adaLN_modulation.1.weight") if key not in own]
    if missing or layers["noise_refiner"] != layers["context_refiner"]:
        raise UserError(f"{path}: an incomplete Z-Image file ({len(missing)} tensors missing: "
                        f"{', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}; refiner blocks "
                        f"{layers['noise_refiner']} noise, {layers['context_refiner']} context)",
                        "the file is incomplete (an interrupted download?): re-download it")
    ffn = int(width / 3 * 8)  # diffusers' Z-Image feed-forward width (10240 at 3840)
    expected = {
        "x_embedder.weight": [width, PATCH * PATCH * in_channels],
        "layers.0.attention.qkv.weight": [3 * width, width],  # as many K/V heads as query heads
        "layers.0.attention.out.weight": [width, width],
        "layers.0.feed_forward.w1.weight": [ffn, width],
        "layers.0.adaLN_modulation.0.weight": [4 * width, min(width, 256)],
        "t_embedder.mlp.2.weight": [min(width, 256), 1024],
        "final_layer.linear.weight": [PATCH * PATCH * in_channels, width],
    }
    wrong = shape.unexpected(expected)
    if wrong or width % head or head % 8:
        raise UserError(f"{path}: its Z-Image tensors match no Z-Image variant (width {width}, head size {head}; "
                        f"unexpected shapes: {wrong or 'width not a multiple of the head size'})",
                        "the file may be damaged or of another architecture (Lumina 2?); re-download it")
    # RoPE pairs per axis: Z-Image's (32, 48, 48) at head size 128, in the same proportions otherwise (tests)
    axes = AXES_DIMS if head == HEAD_DIM else (head // 4, head * 3 // 8, head * 3 // 8)
    return {
        "all_patch_size": (PATCH,),
        "all_f_patch_size": (1,),
        "in_channels": in_channels,
        "dim": width,
        "n_layers": layers["layers"],
        "n_refiner_layers": layers["noise_refiner"],
        "n_heads": width // head,
        "n_kv_heads": width // head,
        "norm_eps": 1e-5,
        "qk_norm": True,
        "cap_feat_dim": cap_feat_dim,
        "rope_theta": ROPE_THETA,
        "t_scale": 1000.0,
        "axes_dims": list(axes),
        "axes_lens": list(AXES_LENS),
    }


def variant(config: dict) -> str:
    """A name for what the shapes say. Z-Image-Turbo and Z-Image (Base) have the same shapes."""
    if (config["dim"], config["n_layers"], config["n_refiner_layers"]) == (3840, 30, 2):
        return "Z-Image (Turbo or Base: the same shapes)"
    return f"Z-Image architecture, width {config['dim']}, {config['n_layers']} blocks"
