"""MiniMax-H3 single files in the original (MiniMax's / Comfy-Org's) key layout, read into diffusers' MiniMax-H3.

ComfyUI loads the original names unchanged (supported_models.MiniMaxH3 has no key conversion) with each attention's
``qkv_proj`` stacked [q; k; v] and each feed-forward's ``fc1`` [gate; value]; diffusers names them as its converter
(``convert_minimax_h3_transformer_checkpoint_to_diffusers``) does: to_q / to_k / to_v (row bands of qkv_proj) and
ff.net.0.proj ([value; gate]: the halves swapped). The config is read off the shapes as comfy/model_detection.py does.
MiniMaxAI's own shards interleave q, k, v per head: re-save them as Comfy-Org's stacked file (ComfyUI reads those only).
The file's ``rope.inv_freq`` (the reference's RoPE frequencies, which ComfyUI reads) gives the config its frequency
count; diffusers recomputes the values (the same formula, float32).
"""

from __future__ import annotations

from ..errors import UserError
from .checkpoint import FileShapes, TensorSource, count_blocks, prefix_detector

MARKERS = ("video_patch_proj.weight", "audio_patch_proj.weight", "token_refiner.blocks.0.attn.qkv_proj.weight")
detect_prefix = prefix_detector(MARKERS)

_GLOBAL = {"proj_in": "video_patch_proj", "audio_proj_in": "audio_patch_proj", "context_embedder": "condition_proj",
           "time_embedder.linear_1": "time_embedder.proj_in", "time_embedder.linear_2": "time_embedder.proj_out",
           "norm_out.norm": "final_layer.norm", "norm_out.linear": "final_layer.adaln_proj.linear",
           "proj_out": "final_layer.video_out", "audio_proj_out": "final_layer.audio_out",
           "token_refiner.final_norm": "token_refiner.final_norm"}
_BLOCK = {"attn.norm_q": "attn.q_norm", "attn.norm_k": "attn.k_norm", "attn.to_out.0": "attn.out_proj",
          "ff.net.2": "mlp.fc2", "norm1": "norm1", "norm2": "norm2", "adaln_proj.linear": "adaln_proj.linear"}
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")


def sources(diffusers_keys, prefix: str, config: dict) -> dict[str, TensorSource]:
    """The original source of every diffusers parameter key (``prefix``: the file's key prefix)."""
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    table = {}
    for key in diffusers_keys:
        module, param = key.rsplit(".", 1)
        if key == "time_embedder.table":  # a pruned (curve-form) file's
            table[key] = TensorSource(f"{prefix}adaln_t_table")
            continue
        if module in _GLOBAL:
            table[key] = TensorSource(f"{prefix}{_GLOBAL[module]}.{param}")
            continue
        head, _, inside = module.partition(".")
        if head == "token_refiner":
            _, index, inside = inside.split(".", 2)  # refiner_blocks.N.…
            block = f"token_refiner.blocks.{index}"
        else:
            index, _, inside = inside.partition(".")  # transformer_blocks.N.…
            block = f"blocks.{index}"
        if inside in _QKV:
            band = _QKV.index(inside)
            table[key] = TensorSource(f"{prefix}{block}.attn.qkv_proj.{param}", rows=(band * inner, (band + 1) * inner))
        elif inside == "ff.net.0.proj":
            # [gate; value] → diffusers' SwiGLU [value; gate]
            table[key] = TensorSource(f"{prefix}{block}.mlp.fc1.{param}", swap_halves=True)
        else:
            table[key] = TensorSource(f"{prefix}{block}.{_BLOCK[inside]}.{param}")
    return table


def config_from_shapes(shapes: dict[str, list[int]], prefix: str, path: str) -> dict:
    """diffusers' MiniMaxH3Transformer3DModel config, read off the shapes as comfy/model_detection.py reads them."""
    shape = FileShapes(shapes, prefix)
    if "blocks.0.attn.to_gate_compress.weight" in shape:
        raise UserError(f"{path}: a gate-compressed (VSA) MiniMax-H3 checkpoint, which is not run yet",
                        "use Comfy-Org's MiniMax-H3 file (bf16, or pruned fp8)")
    head_dim = shape("blocks.0.attn.q_norm.weight")[0]
    hidden, video_in = shape("video_patch_proj.weight")
    if "adaln_t_table" in shape:  # pruned: a curve table [grid, k] for the time embedder, k-wide AdaLN projections
        grid, width = shape("adaln_t_table")
        time = dict(adaln_curve_grid=grid, time_embed_dim=width)
    else:
        freq_hidden, freq_dim = shape("time_embedder.proj_in.weight")
        time = dict(freq_dim=freq_dim, time_embed_hidden_dim=freq_hidden,
                    time_embed_dim=shape("time_embedder.proj_out.weight")[0])
    return dict(**time,
        num_attention_heads=shape("blocks.0.attn.qkv_proj.weight")[0] // (3 * head_dim), attention_head_dim=head_dim,
        hidden_size=hidden, num_layers=count_blocks(shapes, "blocks", prefix),
        num_refiner_layers=count_blocks(shapes, "token_refiner.blocks", prefix),
        ffn_dim=shape("blocks.0.mlp.fc1.weight")[0] // 2, in_channels=shape("final_layer.video_out.weight")[0] // 4,
        audio_in_channels=shape("final_layer.audio_out.weight")[0], text_dim=shape("condition_proj.weight")[1],
        rope_freq_dim=shape("rope.inv_freq")[0] if "rope.inv_freq" in shape else 16)


def variant(config: dict) -> str:
    pruned = ", pruned" if config.get("adaln_curve_grid") else ""
    if (config["hidden_size"], config["num_layers"]) == (5376, 50):
        return f"MiniMax-H3{pruned}"
    return f"MiniMax-H3 architecture{pruned}, width {config['hidden_size']}, {config['num_layers']} blocks"
