"""Flux.1's ControlNets in diffusers' layout (InstantX's Union and its single-mode nets, Shakker-Labs' Union Pro /
Pro 2.0; the files diffusers' ``FluxControlNetModel`` reads): a kind of controlnet.py.

As ComfyUI runs them (shared snapshot v0.3.64: comfy/controlnet.py ``load_controlnet_flux_instantx`` and
``ControlNet.get_control``; comfy/ldm/flux/controlnet.py ``ControlNetFlux`` with ``latent_input``; the ``control``
argument of comfy/ldm/flux/model.py): the control image's VAE latent in model space (Flux's ``process_in``; a
17-channel net's mask after it), packed 2×2 like the image, goes through ``controlnet_x_embedder`` and is added to the
embedded noisy latent; the time (σ in the model's dtype, × 1000), guidance and pooled prompt are embedded as the
model embeds them; a union net's control type (SetUnionControlNetType; none for "auto") is embedded as one more text
token before the prompt's. The double blocks then the single blocks run over [text; image] at the model's
positions, each block's image tokens through its ``controlnet_blocks`` Linear give one residual. ComfyUI repeats
them in place to Flux's 19 double and 38 single blocks (ceil(19 / n) consecutive blocks share one), times the
strength, and adds each to the image tokens after its model block.

Diffusers' ``forward`` prepends the union's token after the text is embedded, which under sequence parallelism would
come after the text's cut (one token on every rank): ``FluxControlNet.forward`` below runs the same modules with the
token joined first and the text cut after it (``control_text``, where the family's ``control_plan`` cuts it).
"""

from __future__ import annotations

import math
import warnings

import torch
from diffusers import FluxControlNetModel

from ..errors import UserError
from . import controlnet, latent_formats

FAMILY = "flux"
LATENT = latent_formats.FLUX
HINT = ("its VAE latent (Flux.1's VAE, ae.safetensors) at the generation's latent size; an XLabs ControlNet's: the "
        "image's pixels [1, 3, 8·h, 8·w] in [0, 1]")
MODEL_DOUBLE, MODEL_SINGLE = 19, 38  # ComfyUI's main_model_double / main_model_single: Flux.1's blocks
SEED = 12  # the built-in ControlNets' weights
# the built-in (controlnet.BUILTINS): its model's width, one double and one single block, a union net of 8 control
# types (ComfyUI's UNION_CONTROLNET_TYPES)
TINY_MODES = 8


class FluxControlNet(FluxControlNetModel):
    """diffusers' FluxControlNetModel (its modules, config and file layout) with the forward ComfyUI's
    ControlNetFlux computes, its text joined before the cut, and a pass-through ``control_text`` where the text is
    cut. Its ``pos_embed`` is the model's (``bind``): ComfyUI builds both from the same config."""

    def __init__(self, *args, **kwargs):
        with warnings.catch_warnings():  # diffusers 0.42's class builds the FluxPosEmbed it deprecates: not ours to fix
            warnings.simplefilter("ignore", FutureWarning)
            super().__init__(*args, **kwargs)  # its input_hint_block is None: XLabs' nets get theirs (xlabs_hint)
        self.control_text = torch.nn.Identity()

    def forward(self, hidden_states, controlnet_cond, encoder_hidden_states, pooled_projections, timestep, img_ids,
                guidance=None, mode: int | None = None):
        """hidden_states [B, N, 64] the noisy latent's packed tokens, controlnet_cond [B, N, C·4] the hint's,
        encoder_hidden_states [B, L, context_dim], pooled_projections [B, pooled_dim], timestep and guidance [B]
        (σ and the scale), img_ids [N, 3]. Returns each double block's and each single block's residual
        [B, N, D] (not yet times the strength)."""
        dtype = hidden_states.dtype
        image = self.x_embedder(hidden_states) + self.controlnet_x_embedder(controlnet_cond)  # [B, N, D]
        timestep = timestep.to(dtype) * 1000  # ComfyUI hands the ControlNet σ in the model's dtype
        temb = (self.time_text_embed(timestep, pooled_projections) if guidance is None else
                self.time_text_embed(timestep, guidance.to(dtype) * 1000, pooled_projections))  # [B, D]
        text = self.context_embedder(encoder_hidden_states)  # [B, L, D]
        if mode is not None and getattr(self, "controlnet_mode_embedder", None) is not None:
            token = self.controlnet_mode_embedder(torch.tensor([mode], device=text.device)).to(dtype)  # [1, D]
            text = torch.cat([token.expand(text.shape[0], 1, -1), text], dim=1)  # [B, 1 + L, D]
        text = self.control_text(text)  # sequence parallelism cuts the text here, the union's token with it
        ids = torch.cat([img_ids.new_zeros(text.shape[1], 3), img_ids])  # [L', 3] text (all 0), then [N, 3]
        rope = self.pos_embed(ids)
        double, single = [], []
        for block, out in zip(self.transformer_blocks, self.controlnet_blocks):
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            double.append(out(image))  # [B, N, D]
        for block, out in zip(self.single_transformer_blocks, self.controlnet_single_blocks):
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            single.append(out(image))  # [B, N, D]: the image tokens only, as ComfyUI's img[:, txt:]
        return double, single


def network_class():
    return FluxControlNet


def matches(keys: set) -> bool:
    """A Flux ControlNet as ComfyUI tells it: diffusers' layout (``controlnet_x_embedder`` beside the blocks'
    outputs, not Qwen-Image's feed-forward names), or XLabs' (BFL's block names)."""
    if "controlnet_blocks.0.weight" not in keys:
        return False
    return "double_blocks.0.img_attn.norm.key_norm.scale" in keys or (
        "controlnet_x_embedder.weight" in keys and "transformer_blocks.0.img_mlp.net.0.proj.weight" not in keys)


def _count(state, prefix: str) -> int:
    return 1 + max((int(key.split(".")[1]) for key in state if key.startswith(prefix)), default=-1)


def read(path: str, state: dict) -> FluxControlNet:
    """The ControlNet in ``state`` (read from ``path``), its config read off the shapes (on the CPU, in the file's
    precision)."""
    if "double_blocks.0.img_attn.norm.key_norm.scale" in state:
        return read_xlabs(path, state)
    width, in_channels = state["x_embedder.weight"].shape
    head = state["transformer_blocks.0.attn.norm_q.weight"].shape[0]
    modes = state.get("controlnet_mode_embedder.weight")
    config = dict(in_channels=in_channels, num_layers=_count(state, "transformer_blocks."),
                  num_single_layers=_count(state, "single_transformer_blocks."), attention_head_dim=head,
                  num_attention_heads=width // head, joint_attention_dim=state["context_embedder.weight"].shape[1],
                  pooled_projection_dim=state["time_text_embed.text_embedder.linear_1.weight"].shape[1],
                  guidance_embeds="time_text_embed.guidance_embedder.linear_1.weight" in state,
                  num_mode=None if modes is None else modes.shape[0])
    with torch.device("meta"):
        network = FluxControlNet(**config)
        hint_channels = state["controlnet_x_embedder.weight"].shape[1]  # 64, or 68 with an inpainting mask
        network.controlnet_x_embedder = torch.nn.Linear(hint_channels, width)
    try:
        network.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise UserError(f"ControlNet {path}: its tensors do not fit Flux's ControlNet ({str(exc)[:300]})",
                        "use a Flux.1 ControlNet in diffusers' layout (InstantX's, Shakker-Labs')") from None
    return network


def xlabs_hint() -> torch.nn.Sequential:
    """XLabs' pixel embedding (ComfyUI's ControlNetFlux ``input_hint_block``): eight 3×3 convolutions to 16
    channels, three of them of stride 2, SiLU between: [B, 3, H, W] → [B, 16, H/8, W/8]."""
    layers, channels = [], 3
    for index in range(8):
        layers.append(torch.nn.Conv2d(channels, 16, 3, padding=1, stride=2 if index in (2, 4, 6) else 1))
        if index < 7:
            layers.append(torch.nn.SiLU())
        channels = 16
    return torch.nn.Sequential(*layers)


def read_xlabs(path: str, state: dict) -> FluxControlNet:
    """An XLabs ControlNet (BFL's names for its Flux blocks, ``input_hint_block`` and ``pos_embed_input`` beside
    them, as ComfyUI's load_controlnet_flux_xlabs_mistoline reads it) in diffusers' names, its config off the
    shapes."""
    from .checkpoint import count_blocks
    from .flux_checkpoint import rope_axes, sources

    width, in_channels = state["img_in.weight"].shape
    head = state["double_blocks.0.img_attn.norm.query_norm.scale"].shape[0]
    config = dict(in_channels=in_channels, num_layers=count_blocks(state, "double_blocks"),
                  num_single_layers=count_blocks(state, "single_blocks"), attention_head_dim=head,
                  num_attention_heads=width // head, joint_attention_dim=state["txt_in.weight"].shape[1],
                  pooled_projection_dim=state["vector_in.in_layer.weight"].shape[1],
                  guidance_embeds="guidance_in.in_layer.weight" in state, axes_dims_rope=rope_axes(head))
    with torch.device("meta"):
        network = FluxControlNet(**config)
        network.input_hint_block = xlabs_hint()
        network.controlnet_x_embedder = torch.nn.Linear(state["pos_embed_input.weight"].shape[1], width)
    own = ("controlnet_blocks.", "controlnet_single_blocks.", "input_hint_block.")
    converted = {key: value for key, value in state.items() if key.startswith(own)}
    converted.update({f"controlnet_x_embedder.{p}": state[f"pos_embed_input.{p}"] for p in ("weight", "bias")})
    model_keys = [key for key in network.state_dict() if key not in converted]
    try:
        converted.update({key: source.select(state[source.key])
                          for key, source in sources(model_keys, "", config).items()})
        network.load_state_dict(converted, strict=True, assign=True)
    except (KeyError, RuntimeError) as exc:
        raise UserError(f"ControlNet {path}: its tensors do not fit an XLabs Flux ControlNet ({str(exc)[:300]})",
                        "use XLabs' flux-canny / depth / hed controlnet v3 files, or InstantX's and Shakker-Labs'")
    return network


def built_in(name: str) -> FluxControlNet:
    """A built-in ControlNet (controlnet.BUILTINS) for its model's size, from a fixed seed."""
    from .builtins import BUILTINS as MODELS

    config = MODELS[controlnet.BUILTINS[name]].config
    keep = ("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
            "guidance_embeds", "axes_dims_rope")
    return controlnet.drawn(
        SEED, lambda: FluxControlNet(**{k: config[k] for k in keep}, num_layers=1, num_single_layers=1,
                                     num_mode=TINY_MODES),
        lambda made: (*made.controlnet_blocks, *made.controlnet_single_blocks, made.controlnet_x_embedder))


def bind(network: FluxControlNet, transformer) -> None:
    """Give the network the model's positions (its RoPE module: no weights)."""
    network.pos_embed = transformer.pos_embed


def blocks(network) -> list:
    """The blocks weight sharding splits."""
    return [*network.transformer_blocks, *network.single_transformer_blocks]


def width(network) -> int:
    return network.config.num_attention_heads * network.config.attention_head_dim


def hint_shape(network, latent_size: tuple[int, int]) -> tuple[int, ...]:
    """The control input: [C, h, w] a latent's (and an inpainting variant's mask's) channels; an XLabs net's the
    image's pixels [3, 8·h, 8·w]."""
    if network.input_hint_block is not None:
        return (3, 8 * latent_size[0], 8 * latent_size[1])
    return (network.controlnet_x_embedder.in_features // 4, *latent_size)


def hint(network, control: torch.Tensor) -> torch.Tensor:
    """[1, N, C·4], the embedder's input: the latent in model space, packed; an XLabs net's pixels mapped to
    [−1, 1] through its convolutions (÷ 8 in space, 16 channels), packed (ControlNetFlux.forward's, done once per
    generation: the hint does not change between steps)."""
    if network.input_hint_block is None:
        return controlnet.packed(controlnet.model_space(control, LATENT))
    weight = network.input_hint_block[0].weight
    return controlnet.packed(network.input_hint_block(control.to(weight.dtype) * 2.0 - 1.0))


def model_residuals(samples: list[torch.Tensor], blocks: int, single: bool, tiled: bool) -> list[torch.Tensor]:
    """The residual of each of the model's ``blocks`` double (or ``single``) blocks from the network's ``samples``
    (one per network block), repeated as ComfyUI repeats them to Flux.1's 19 and 38 (Flux.1 has those): each in place
    (a latent-input net's), or the whole list over and over (``tiled``: XLabs')."""
    if tiled:
        return [samples[block % len(samples)] for block in range(blocks)]
    repeat = math.ceil((MODEL_SINGLE if single else MODEL_DOUBLE) / len(samples))
    return [samples[block // repeat] for block in range(blocks)]

