"""HunyuanDiT 1.2's ControlNets (Tencent's canny / depth / pose, in the original layout ComfyUI loads): a kind of
controlnet.py.

As ComfyUI runs them (shared snapshot v0.3.64: comfy/controlnet.py ``load_controlnet_hunyuandit``, StrengthType
CONSTANT; comfy/ldm/hydit/controlnet.py ``HunYuanControlNet``; the ``control`` argument of comfy/ldm/hydit/models.py):
a copy of the model's first half — its own text projection and padding, time and pooled-text embedding, patch
embedding and blocks. The control image's VAE latent in model space (SDXL's format) goes through the same patch
embedding as the noisy latent and, through ``before_proj`` (a zero linear), is added to it; each block's output
through its ``after_proj`` gives one residual. The model's second-half blocks pop them, last first, as they pop
their long skips: block depth/2 + 1 + i takes skip + residual, times the strength. The ControlNet's blocks must be
as many as the model's skips (19 for 40 blocks).

Diffusers' ``HunyuanDiT2DControlNetModel`` holds the same modules (its ``input_block`` is ``before_proj``, its
``controlnet_blocks`` ``after_proj_list``); the forward below runs them with the text and time the model wrapper
prepares from the ControlNet's own modules, at positions from its own ``rotary_table`` (parameterless, where the
sequence plan cuts the RoPE, as the model's).
"""

from __future__ import annotations

import re

import torch
from diffusers import HunyuanDiT2DControlNetModel

from ..errors import UserError
from . import controlnet, latent_formats
from .hunyuan_dit import RotaryTable

FAMILY = "hunyuan_dit"
LATENT = latent_formats.SDXL
HINT = "its VAE latent (HunyuanDiT's, SDXL's VAE) at the generation's latent size"
SEED = 14  # the built-in ControlNet's weights


class HunyuanDiTControlNet(HunyuanDiT2DControlNetModel):
    """diffusers' HunyuanDiT ControlNet (its modules, config and names) with the forward ComfyUI's HunYuanControlNet
    computes, and its own RoPE table module."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_table = RotaryTable(self.config.attention_head_dim, self.config.patch_size)

    def forward(self, hidden_states, controlnet_cond, text, temb):
        """hidden_states [B, 4, h, w] the (scaled) noisy latent, controlnet_cond [B, 4, h, w] the hint in model
        space, text [B, L, 1024] and temb [B, D] from this network's own modules. Returns each block's residual
        [B, N, D] (not yet times the strength)."""
        rope = self.rotary_table(*hidden_states.shape[-2:], device=hidden_states.device)  # (cos, sin) [N, head_dim]
        image = self.pos_embed(hidden_states) + self.input_block(self.pos_embed(controlnet_cond))  # [B, N, D]
        samples = []
        for block, out in zip(self.blocks, self.controlnet_blocks):
            image = block(image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            samples.append(out(image))
        return samples


def network_class():
    return HunyuanDiTControlNet


def matches(keys: set) -> bool:
    """A HunyuanDiT ControlNet, as ComfyUI tells it (its after_proj_list)."""
    return "after_proj_list.0.weight" in keys and "before_proj.weight" in keys


def _config(width: int, heads: int, blocks: int, in_channels: int, patch: int, ffn: int, clip_dim: int,
            mt5_dim: int, pooled: int, text_len: int, text_len_t5: int) -> dict:
    return dict(num_attention_heads=heads, attention_head_dim=width // heads, in_channels=in_channels,
                patch_size=patch, hidden_size=width, transformer_num_layers=2 * (blocks + 1),
                mlp_ratio=(ffn + 0.5) / width, cross_attention_dim=clip_dim, cross_attention_dim_t5=mt5_dim,
                pooled_projection_dim=pooled, text_len=text_len, text_len_t5=text_len_t5,
                use_style_cond_and_image_meta_size=False)


def read(path: str, state: dict) -> HunyuanDiTControlNet:
    """The ControlNet in ``state`` (the original names, ``before_proj``, ``after_proj_list``) in diffusers' names,
    its config off the shapes (on the CPU, in the file's precision)."""
    from .hunyuan_dit_checkpoint import source

    if "style_embedder.weight" in state:
        raise UserError(f"ControlNet {path} embeds a style (a HunyuanDiT 1.0 / 1.1 ControlNet); ComfyUI and this "
                        "version run 1.2's", "use a HunyuanDiT 1.2 ControlNet")
    width, in_channels, patch, _ = state["x_embedder.proj.weight"].shape
    head = state["blocks.0.attn1.q_norm.weight"].shape[0]
    blocks = 1 + max(int(m[1]) for key in state if (m := re.match(r"blocks\.(\d+)\.", key)))
    text_len_t5 = state["pooler.positional_embedding"].shape[0] - 1
    config = _config(width, width // head, blocks, in_channels, patch, state["blocks.0.mlp.fc1.weight"].shape[0],
                     state["text_embedding_padding"].shape[1], state["mlp_t5.0.weight"].shape[1],
                     state["pooler.c_proj.weight"].shape[0], state["text_embedding_padding"].shape[0] - text_len_t5,
                     text_len_t5)
    with torch.device("meta"):
        network = HunyuanDiTControlNet(**config)
    converted = {}
    try:
        for key in network.state_dict():
            if key.startswith("input_block."):
                converted[key] = state[key.replace("input_block.", "before_proj.", 1)]
            elif key.startswith("controlnet_blocks."):
                converted[key] = state[key.replace("controlnet_blocks.", "after_proj_list.", 1)]
            else:
                found = source(key, "", width)
                converted[key] = found.select(state[found.key])
        network.load_state_dict(converted, strict=True, assign=True)
    except (KeyError, RuntimeError) as exc:
        raise UserError(f"ControlNet {path}: its tensors do not fit HunyuanDiT's ControlNet ({str(exc)[:300]})",
                        "use a HunyuanDiT 1.2 ControlNet (Tencent's canny, depth or pose)") from None
    network.rotary_table = RotaryTable(head, patch)  # its tables were made on the meta device: none held
    return network


def built_in(name: str) -> HunyuanDiTControlNet:
    """A built-in ControlNet (controlnet.BUILTINS) for its model: as many blocks as the model has skips."""
    from .builtins import BUILTINS as MODELS

    config = MODELS[controlnet.BUILTINS[name]].config
    width = config["hidden_size"]
    made = _config(width, config["num_attention_heads"], config["num_layers"] // 2 - 1, config["in_channels"],
                   config["patch_size"], int(width * config["mlp_ratio"]), config["cross_attention_dim"],
                   config["cross_attention_dim_t5"], config["pooled_projection_dim"], config["text_len"],
                   config["text_len_t5"])
    return controlnet.drawn(SEED, lambda: HunyuanDiTControlNet(**made),
                            lambda network: (*network.controlnet_blocks, network.input_block))


def bind(network, transformer) -> None:
    """Nothing to take from the model: the ControlNet has its own embeddings and tables."""


def blocks(network) -> list:
    """The blocks weight sharding splits."""
    return list(network.blocks)


def width(network) -> int:
    return network.config.hidden_size


def hint_shape(network, latent_size: tuple[int, int]) -> tuple[int, ...]:
    return (network.config.in_channels, *latent_size)


def hint(network, latent: torch.Tensor) -> torch.Tensor:
    return controlnet.model_space(latent, LATENT)  # [1, 4, h, w]: the network's patch embedding embeds it
