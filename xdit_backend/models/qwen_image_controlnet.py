"""Qwen-Image's ControlNet (InstantX's ControlNet Union and its inpainting variant; diffusers'
``QwenImageControlNetModel``, whose key layout the files use): a kind of controlnet.py.

As ComfyUI runs it (shared snapshot v0.3.64: comfy/controlnet.py ``load_controlnet_qwen_instantx`` and
``ControlNet.get_control``; comfy/ldm/qwen_image/controlnet.py; the ``control`` argument of
comfy/ldm/qwen_image/model.py): the control image's VAE latent, in model space (Wan 2.1's ``process_in``; the
inpainting variant's mask channels after it), packed like the image, is embedded by ``controlnet_x_embedder`` and
added to the embedded noisy latent; the network's blocks run on it with the prompt at the model's input, time and
positions; each block's output through its ``controlnet_blocks`` Linear, times the strength, is the residual of
ceil(60 / blocks) consecutive model blocks, added to their image tokens after them.
"""

from __future__ import annotations

import math

import torch

from ..errors import UserError
from . import controlnet, latent_formats

FAMILY = "qwen_image"
LATENT = latent_formats.WAN21  # the hint's latent (Qwen-Image's VAE is Wan 2.1's)
HINT = "its VAE latent (Qwen-Image's VAE: Wan 2.1's) at the generation's latent size"
MODEL_BLOCKS = 60  # ComfyUI's main_model_double for Qwen-Image: the residuals are repeated to the model's blocks
SEED = 11  # the built-in ControlNets' weights


class ModelTables(torch.nn.Module):
    """Stands in for a ControlNet's own RoPE module: the model's tables are handed to it (qwen_image.rope_and_time
    replaces this module's output), since ComfyUI gives both networks the same positions."""

    def forward(self, *args, **kwargs):
        return None


def network_class():
    from diffusers import QwenImageControlNetModel

    return QwenImageControlNetModel


def matches(keys: set) -> bool:
    """A Qwen-Image ControlNet's keys, as ComfyUI tells it (Qwen-Image's feed-forward name beside the blocks'
    controlnet outputs: a Flux one has ``ff``)."""
    return "controlnet_blocks.0.weight" in keys and "transformer_blocks.0.img_mlp.net.0.proj.weight" in keys


def read(path: str, state: dict):
    """The ControlNet in ``state`` (read from ``path``) as diffusers' QwenImageControlNetModel, its config read off
    the shapes (on the CPU, in the file's precision)."""
    from diffusers import QwenImageControlNetModel

    blocks = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("transformer_blocks."))
    width, in_channels = state["img_in.weight"].shape
    head = state["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    config = dict(num_layers=blocks, attention_head_dim=head, num_attention_heads=width // head,
                  in_channels=in_channels, joint_attention_dim=state["txt_in.weight"].shape[1],
                  extra_condition_channels=state["controlnet_x_embedder.weight"].shape[1] - in_channels)
    with torch.device("meta"):
        network = QwenImageControlNetModel(**config)
    try:
        network.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"ControlNet {path}: its tensors do not fit Qwen-Image's ControlNet ({str(exc)[:300]})",
                        "use a Qwen-Image ControlNet in diffusers' layout (InstantX's)") from None
    return _with_model_tables(network)  # its own frequency tables were made on the meta device


def built_in(name: str):
    """A built-in ControlNet (controlnet.BUILTINS) for its model's size, from a fixed seed: one block."""
    from diffusers import QwenImageControlNetModel

    from .builtins import BUILTINS as MODELS

    config = MODELS[controlnet.BUILTINS[name]].config
    network = controlnet.drawn(SEED, lambda: QwenImageControlNetModel(
        num_layers=1, attention_head_dim=config["attention_head_dim"],
        num_attention_heads=config["num_attention_heads"], in_channels=config.get("in_channels", 64),
        joint_attention_dim=config["joint_attention_dim"], axes_dims_rope=tuple(config["axes_dims_rope"])),
        lambda made: (*made.controlnet_blocks, made.controlnet_x_embedder))
    return _with_model_tables(network)


def _with_model_tables(network):
    """The network with the model's RoPE tables instead of its own: ModelTables, and the pass-through modules they
    leave through (as the model's: qwen_image.rope_and_time), where the family's control plan cuts them."""
    network.pos_embed = ModelTables()
    network.image_rope, network.text_rope = torch.nn.Identity(), torch.nn.Identity()
    return network


def bind(network, transformer) -> None:
    """Nothing to take from the model: its tables come in each call (qwen_image.rope_and_time)."""


def blocks(network) -> list:
    """The blocks weight sharding splits."""
    return list(network.transformer_blocks)


def width(network) -> int:
    return network.config.num_attention_heads * network.config.attention_head_dim


def hint_shape(network, latent_size: tuple[int, int]) -> tuple[int, ...]:
    """The control input [C, h, w]: the latent's and an inpainting variant's mask channels (2×2 patches embedded)."""
    return (network.controlnet_x_embedder.in_features // 4, *latent_size)


def hint(network, latent: torch.Tensor) -> torch.Tensor:
    return controlnet.packed(controlnet.model_space(latent, LATENT))  # [1, N, C·4], the embedder's input


def model_residuals(samples: list[torch.Tensor], blocks: int) -> list[torch.Tensor]:
    """The residual of each of the model's ``blocks`` from the network's ``samples`` (one per network block), as
    ComfyUI repeats them to Qwen-Image's 60."""
    repeat = math.ceil(MODEL_BLOCKS / len(samples))
    return [samples[block // repeat] for block in range(blocks)]
