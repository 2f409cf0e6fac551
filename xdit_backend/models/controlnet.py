"""ControlNets: a control network of the model's own kind that reads the control image and returns a residual for
each of the model's blocks. Here Qwen-Image's (InstantX's ControlNet Union and its inpainting variant; diffusers'
``QwenImageControlNetModel``, whose key layout the files use).

As ComfyUI runs it (shared snapshot v0.3.64: comfy/controlnet.py ``load_controlnet_qwen_instantx`` and
``ControlNet.get_control``; comfy/ldm/qwen_image/controlnet.py; the ``control`` argument of
comfy/ldm/qwen_image/model.py): the control image's VAE latent, in model space (Wan 2.1's ``process_in``; the
inpainting variant's mask channels after it), packed like the image, is embedded by ``controlnet_x_embedder`` and
added to the embedded noisy latent; the network's blocks run on it with the prompt at the model's input, time and
positions; each block's output through its ``controlnet_blocks`` Linear, times the strength, is the residual of
ceil(60 / blocks) consecutive model blocks, added to their image tokens after them. It runs while σ lies in the
range the start and end percents give (``percent_to_sigma``); chained ControlNets' residuals add, in order.

Under sequence parallelism the network runs with the model's own plan, its hint cut like the image, and returns
its residuals already split: each rank adds its share to its own tokens, nothing gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import latent_formats
from .patch_embed import pack, pad_to_patch

MODEL_BLOCKS = 60  # ComfyUI's main_model_double for Qwen-Image: the residuals are repeated to the model's blocks
SEED = 11  # the built-in ControlNets' weights
# built-in ControlNets (random weights, for tests and demos), the built-in model each fits, and their blocks
BUILTINS = {"qwen-image-controlnet-tiny": ("qwen-image-tiny", 1)}


class ModelTables(torch.nn.Module):
    """Stands in for a ControlNet's own RoPE module: the model's tables are handed to it (qwen_image.rope_and_time
    replaces this module's output), since ComfyUI gives both networks the same positions."""

    def forward(self, *args, **kwargs):
        return None


def is_controlnet(state_keys) -> bool:
    """Whether a control file is a Qwen-Image ControlNet (InstantX's layout)."""
    return "controlnet_x_embedder.weight" in state_keys


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
    network.pos_embed = ModelTables()  # its frequency tables were made on the meta device
    return network


def built_in(name: str):
    """A built-in ControlNet for its built-in model's size, from a fixed seed."""
    from diffusers import QwenImageControlNetModel

    from .builtins import BUILTINS as MODELS

    model, blocks = BUILTINS[name]
    config = MODELS[model].config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        network = QwenImageControlNetModel(
            num_layers=blocks, attention_head_dim=config["attention_head_dim"],
            num_attention_heads=config["num_attention_heads"], in_channels=config.get("in_channels", 64),
            joint_attention_dim=config["joint_attention_dim"], axes_dims_rope=tuple(config["axes_dims_rope"]))
        with torch.no_grad():  # diffusers zero-initialises the control outputs (a new ControlNet adds nothing)
            for module in (*network.controlnet_blocks, network.controlnet_x_embedder):
                torch.nn.init.normal_(module.weight, std=0.05)
    network.pos_embed = ModelTables()
    return network


@dataclass
class AppliedControlNet:
    """A ControlNet as one generation applies it: the network, its hint tokens, strength and σ range."""

    network: object  # diffusers' QwenImageControlNetModel
    hint: torch.Tensor  # [1, N, C·4]: the control latent in model space, packed like the image
    strength: float
    sigmas: tuple[float, float]  # active while sigmas[1] ≤ σ ≤ sigmas[0] (ComfyUI's timestep_range)

    def active(self, sigma: float) -> bool:
        return not (sigma > self.sigmas[0] or sigma < self.sigmas[1])

    def residual_of(self, samples: list[torch.Tensor], block: int) -> torch.Tensor:
        """The residual of model block ``block`` from the network's ``samples`` (one per network block)."""
        return samples[block // math.ceil(MODEL_BLOCKS / len(samples))]


def hint_tokens(latent: torch.Tensor, in_features: int) -> torch.Tensor:
    """[1, C, h, w] raw VAE latent (16 channels and an inpainting variant's mask channels) → [1, N, C·4]: the first
    16 in model space (Wan 2.1), padded to 2×2 patches and packed, as ComfyUI's get_control and process_img do."""
    if latent.shape[1] * 4 != in_features:
        raise UserError(f"the control latent has {latent.shape[1]} channels; this ControlNet takes {in_features // 4}",
                        "encode the control image with the model's VAE (Qwen-Image's: Wan 2.1's)")
    latent = latent.to(torch.float32, copy=True)
    latent[:, :16] = latent_formats.WAN21.process_in(latent[:, :16])
    return pack(pad_to_patch(latent, (1, 2, 2)))
