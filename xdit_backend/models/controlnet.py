"""ControlNets: a control network of the model's own kind that reads the control image's latent and returns a
residual for the model's blocks. One module per kind, in ``KINDS`` by family: qwen_image_controlnet (InstantX's
Qwen-Image Union, diffusers' QwenImageControlNetModel), flux_controlnet (InstantX's and Shakker's Flux.1 Union,
diffusers' FluxControlNetModel), sd3_controlnet (Stability's SD3.5 Large blur / canny / depth) and
hunyuan_dit_controlnet (Tencent's HunyuanDiT 1.2 ones) and z_image_controlnet (alibaba-pai's Z-Image Fun ControlNet,
a model patch in ComfyUI, run between the model's blocks). Files are told apart by their keys, as ComfyUI's
``load_controlnet_state_dict`` tells them (comfy/controlnet.py, shared snapshot v0.3.64; the Fun ControlNet as
``ModelPatchLoader`` does).

What every kind shares, as ComfyUI's ``ControlNet.get_control`` applies it: the control image's VAE latent in model
space (the kind's latent format; an inpainting variant's mask channels after it), packed like the image; the
network runs while σ lies in the range the start and end percents give (``percent_to_sigma``); its residuals,
times the strength, are added to the model's image tokens after the blocks they belong to; chained ControlNets'
residuals add, in order (``control_merge``).

Under sequence parallelism a network runs with its family's ``control_plan``, its hint cut like the image, and
returns its residuals already split: each rank adds its share to its own tokens, nothing gathered.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from .patch_embed import pack, pad_to_patch


# the ControlNet kind of each family that has one: its module here (imported when first asked for)
KINDS = {"qwen_image": "qwen_image_controlnet", "flux": "flux_controlnet", "sd3": "sd3_controlnet",
         "hunyuan_dit": "hunyuan_dit_controlnet", "z_image": "z_image_controlnet"}
# built-in ControlNets (random weights, for tests and demos) and the built-in model each fits
BUILTINS = {"qwen-image-controlnet-tiny": "qwen-image-tiny", "flux-controlnet-tiny": "flux-tiny",
            "sd3-controlnet-tiny": "sd3-tiny", "hunyuan-dit-controlnet-tiny": "hunyuan-dit-tiny",
            "z-image-fun-controlnet-tiny": "z-image-tiny"}
# the kinds ComfyUI loads as model patches (models/model_patches, ModelPatchLoader), not as ControlNets
MODEL_PATCH_KINDS = frozenset({"z_image"})


def kind(family: str) -> ModuleType:
    return importlib.import_module(f".{KINDS[family]}", __package__)


def kind_of_keys(keys) -> ModuleType | None:
    """The kind a file with these tensor names is, or None (not a ControlNet this version runs)."""
    keys = set(keys)
    return next((kind(family) for family in KINDS if kind(family).matches(keys)), None)


def kind_of(network) -> ModuleType:
    """The kind of a loaded network."""
    return next(kind(family) for family in KINDS if isinstance(network, kind(family).network_class()))


def family_of_builtin(name: str) -> str:
    from .builtins import BUILTINS as MODELS

    return MODELS[BUILTINS[name]].family


def read(path: str, state: dict):
    """The ControlNet in ``state`` (read from ``path``), on the CPU in the file's precision."""
    return kind_of_keys(state).read(path, state)


def built_in(name: str):
    """A built-in ControlNet for its built-in model's size, from a fixed seed."""
    return kind(family_of_builtin(name)).built_in(name)


def drawn(seed: int, make, outputs) -> torch.nn.Module:
    """A built-in ControlNet: ``make()`` under a fixed seed, then the modules ``outputs(network)`` names drawn too
    (diffusers zero-initialises a ControlNet's input and output projections: a new one adds nothing)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = make()
        with torch.no_grad():
            for module in outputs(network):
                torch.nn.init.normal_(module.weight, std=0.05)
    return network


@dataclass
class AppliedControlNet:
    """A ControlNet as one generation applies it: the network, its hint tokens, strength, σ range and union mode."""

    network: object  # the kind's network (a diffusers ControlNet model)
    hint: torch.Tensor  # the control latent in model space: packed like the image [1, N, C·4] (or as the kind takes it)
    strength: float
    sigmas: tuple[float, float]  # active while sigmas[1] ≤ σ ≤ sigmas[0] (ComfyUI's timestep_range)
    mode: int | None = None  # a union ControlNet's control type (SetUnionControlNetType); None: "auto"

    def active(self, sigma: float) -> bool:
        return not (sigma > self.sigmas[0] or sigma < self.sigmas[1])


PIXEL_HINT = "input_hint_block.0.weight"  # a ControlNet that embeds the control image's pixels itself (XLabs')


def model_space(latent: torch.Tensor, latent_format) -> torch.Tensor:
    """[1, C, h, w] raw VAE latent (the model's latent channels, then an inpainting variant's mask channels) →
    float32, its latent channels in model space, as get_control puts it (``latent_format.process_in``)."""
    latent = latent.to(torch.float32, copy=True)
    latent[:, :latent_format.channels] = latent_format.process_in(latent[:, :latent_format.channels])
    return latent


def packed(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, h, w] → [1, N, C·4]: padded to 2×2 patches and packed like the image's tokens."""
    return pack(pad_to_patch(latent, (1, 2, 2)))
