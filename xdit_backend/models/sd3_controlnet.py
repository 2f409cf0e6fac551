"""SD3.5's ControlNets in Stability's layout (sd3.5_large_controlnet_blur / canny / depth): a kind of controlnet.py.

As ComfyUI runs them (shared snapshot v0.3.64: comfy/controlnet.py ``load_controlnet_sd35`` and ``ControlNetSD35``;
comfy/cldm/dit_embedder.py ``ControlNetEmbedder``; the ``control`` argument of comfy/ldm/modules/diffusionmodules/
mmdit.py): the noisy latent goes through the *model's* patch embedding (``pre_run`` copies the model's ``x_embedder``
into the ControlNet) plus a sin-cos table of the latent's token grid centred on 7.5 (``get_2d_sincos_pos_embed_torch``,
not the model's cropped table); the time (1000·σ in the model's dtype) and the pooled prompt are embedded; the control
image's VAE latent in model space (SD3's ``process_in``; a canny net's image first mapped x → 127.5·x + 0.5, a depth
net's x → 1 − x, by the file's ``control_type``) goes through ``pos_embed_input`` and is added. Then DiT blocks
(self-attention over the image tokens only, no text), each block's output through its ``controlnet_blocks`` Linear
giving one residual, repeated ceil(width/64 ÷ blocks) times in place (width/64 is the model's depth: 38 for SD3.5
Large), times the strength, added to the image tokens after the model's joint blocks in order.

diffusers' ``SD3ControlNetModel`` without a text path holds the same blocks (its ``SD3SingleTransformerBlock`` is
ComfyUI's DismantledBlock: the file's ``attn.qkv``, ``attn.proj``, ``mlp.fc1/fc2`` and ``adaLN_modulation.1`` are
renamed on reading); ``SD35ControlNet.forward`` below embeds as ComfyUI does and leaves a pass-through
``control_tokens`` where sequence parallelism cuts the tokens (the image's and the hint's, already summed).
"""

from __future__ import annotations

import math
import re

import torch
from diffusers import SD3ControlNetModel

from ..errors import UserError
from . import controlnet, latent_formats

FAMILY = "sd3"
LATENT = latent_formats.SD3
HINT = "its VAE latent (SD3.5's VAE) at the generation's latent size"
HEAD_DIM = 64  # ComfyUI's loader: heads = width / 64
PREPROCESS = {1: "canny", 2: "depth"}  # the file's control_type → how the control image is mapped before encoding
# the file's block names (ComfyUI's DismantledBlock) → diffusers' SD3SingleTransformerBlock's
BLOCK_NAMES = {"adaLN_modulation.1": "norm1.linear", "attn.proj": "attn.to_out.0", "mlp.fc1": "ff.net.0.proj",
               "mlp.fc2": "ff.net.2"}


def centered_sincos(width: int, rows: int, columns: int, device=None) -> torch.Tensor:
    """[rows·columns, width] float32: the sin-cos table of a rows × columns token grid whose shorter side spans
    [0, 15] and whose longer side is stretched around the same centre (7.5): columns' half of the channels, then
    rows', each [sin | cos] over width/4 frequencies 10000^(−i/(width/4))."""
    small = min(rows, columns)
    half_rows, half_columns = 7.5 * rows / small, 7.5 * columns / small
    grid_rows, grid_columns = torch.meshgrid(
        torch.linspace(7.5 - half_rows, 7.5 + half_rows, rows, device=device),
        torch.linspace(7.5 - half_columns, 7.5 + half_columns, columns, device=device), indexing="ij")
    quarter = width // 4
    frequencies = 1.0 / 10000 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter)

    def table(positions):  # [rows, columns] → [rows·columns, width / 2]
        angles = positions.reshape(-1, 1) * frequencies  # [M, width / 4]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    return torch.cat([table(grid_columns), table(grid_rows)], dim=1)  # [rows·columns, width]


class SD35ControlNet(SD3ControlNetModel):
    """diffusers' SD3ControlNetModel without a text path (its modules and config) with the forward ComfyUI's
    ControlNetEmbedder computes. ``x_embedder`` is the model's patch embedding (``bind``)."""

    def __init__(self, *args, control_type: int = -1, **kwargs):
        super().__init__(*args, **kwargs)
        self.control_type = control_type  # the file's: 0 blur, 1 canny, 2 depth (-1: none given)
        self.x_embedder = None  # the model's ``pos_embed.proj`` once bound
        self.control_tokens = torch.nn.Identity()

    def forward(self, hidden_states, controlnet_cond, pooled_projections, timestep):
        """hidden_states [B, 16, h, w] the noisy latent, controlnet_cond [B, C, h, w] the hint (model space),
        pooled_projections [B, pooled_dim], timestep [B] (1000·σ). Returns each block's residual [B, N, D] (not yet
        times the strength)."""
        dtype = self.pos_embed_input.proj.weight.dtype
        rows, columns = hidden_states.shape[-2] // 2, hidden_states.shape[-1] // 2
        image = self.x_embedder(hidden_states.to(dtype)).flatten(2).transpose(1, 2)  # [B, N, D]
        image = image + centered_sincos(image.shape[-1], rows, columns, image.device).to(dtype)
        temb = self.time_text_embed(timestep.to(dtype), pooled_projections)  # [B, D]
        image = image + self.pos_embed_input(controlnet_cond.to(dtype))  # [B, N, D]
        image = self.control_tokens(image)  # sequence parallelism cuts here: [B, N/P, D]
        samples = []
        for block, out in zip(self.transformer_blocks, self.controlnet_blocks):
            image = block(image, temb)
            samples.append(out(image))
        return samples


def network_class():
    return SD35ControlNet


def matches(keys: set) -> bool:
    """An SD3.5 ControlNet in Stability's layout, as ComfyUI tells it."""
    return ("controlnet_blocks.0.weight" in keys and "pos_embed_input.proj.weight" in keys
            and "transformer_blocks.0.adaLN_modulation.1.bias" in keys)


def _config(width: int, blocks: int, pooled: int, hint_channels: int) -> dict:
    return dict(num_layers=blocks, attention_head_dim=HEAD_DIM, num_attention_heads=width // HEAD_DIM,
                joint_attention_dim=None, pooled_projection_dim=pooled, use_pos_embed=False, pos_embed_type=None,
                in_channels=16, extra_conditioning_channels=hint_channels - 16,
                force_zeros_for_pooled_projection=False)


def read(path: str, state: dict) -> SD35ControlNet:
    """The ControlNet in ``state`` (read from ``path``), renamed to diffusers' blocks (on the CPU, in the file's
    precision); its own patch embedding is dropped (ComfyUI replaces it with the model's)."""
    width, pooled = state["time_text_embed.text_embedder.linear_1.weight"].shape
    if width == pooled:
        raise UserError(f"ControlNet {path} embeds the pooled prompt twice (an SD3.5 ControlNet with its own "
                        "y-embedder); this version reads the SD3.5 Large ones (blur, canny, depth)",
                        "use Stability's sd3.5_large_controlnet_blur / canny / depth")
    control_type = state.get("control_type")
    renamed = {}
    for key, value in state.items():
        if key == "control_type" or key.startswith("pos_embed."):
            continue
        block = re.fullmatch(r"(transformer_blocks\.\d+\.)(.+)\.(weight|bias)", key)
        if block is None:
            renamed[key] = value
        elif block[2] == "attn.qkv":
            for name, part in zip(("to_q", "to_k", "to_v"), value.chunk(3)):
                renamed[f"{block[1]}attn.{name}.{block[3]}"] = part
        else:
            renamed[f"{block[1]}{BLOCK_NAMES.get(block[2], block[2])}.{block[3]}"] = value
    blocks = 1 + max(int(key.split(".")[1]) for key in renamed if key.startswith("transformer_blocks."))
    config = _config(width, blocks, pooled, state["pos_embed_input.proj.weight"].shape[1])
    with torch.device("meta"):
        network = SD35ControlNet(**config, control_type=-1 if control_type is None else round(control_type.item()))
    try:
        network.load_state_dict(renamed, strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"ControlNet {path}: its tensors do not fit SD3.5's ControlNet ({str(exc)[:300]})",
                        "use Stability's SD3.5 Large ControlNets (blur, canny, depth)") from None
    return network


SEED = 13  # the built-in ControlNet's weights


def built_in(name: str) -> SD35ControlNet:
    """A built-in ControlNet (controlnet.BUILTINS) for its model's width (2 blocks of 64-wide heads), from a seed."""
    from .builtins import BUILTINS as MODELS

    config = MODELS[controlnet.BUILTINS[name]].config
    width = config["num_attention_heads"] * config["attention_head_dim"]
    return controlnet.drawn(SEED, lambda: SD35ControlNet(**_config(width, 2, config["pooled_projection_dim"], 16)),
                            lambda made: (*made.controlnet_blocks, made.pos_embed_input.proj))


def bind(network: SD35ControlNet, transformer) -> None:
    """Give the network the model's patch embedding, as ControlNetSD35.pre_run copies it."""
    network.x_embedder = transformer.pos_embed.proj


def blocks(network) -> list:
    """The blocks weight sharding splits."""
    return list(network.transformer_blocks)


def width(network) -> int:
    return network.config.num_attention_heads * network.config.attention_head_dim


def hint_shape(network, latent_size: tuple[int, int]) -> tuple[int, ...]:
    return (network.pos_embed_input.proj.in_channels, *latent_size)


def hint(network, latent: torch.Tensor) -> torch.Tensor:
    return controlnet.model_space(latent, LATENT)  # [1, C, h, w]: the network's own patch convolution embeds it


def model_residuals(samples: list[torch.Tensor], blocks: int, width: int) -> list[torch.Tensor | None]:
    """The residual of each of the model's ``blocks`` from the network's ``samples``: each repeated in place
    ceil(width / 64 ÷ samples) times, as ComfyUI's ControlNetEmbedder does (None past them)."""
    repeat = math.ceil(width // HEAD_DIM / len(samples))
    return [samples[block // repeat] if block < repeat * len(samples) else None for block in range(blocks)]
