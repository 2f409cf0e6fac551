"""Z-Image's Fun ControlNet (alibaba-pai's Z-Image-Turbo-Fun-Controlnet-Union 1.0, 2.0 and 2.1, which ComfyUI
loads as a model patch from ``models/model_patches``): a kind of controlnet.py. Its files use diffusers' names
(``control_layers.<i>.attention.to_q.weight``, …), so the blocks are diffusers' own (``ZImageControlTransformerBlock``,
``ZImageTransformerBlock``); the way they run is ComfyUI's, which differs from diffusers' ``ZImageControlNetModel``
(that one attends over the caption too).

As ComfyUI runs it (Comfy-Org/ComfyUI at 08f68f0: comfy_extras/nodes_model_patch.py ``ModelPatchLoader``,
``ZImageControlPatch``, ``ZImageFunControlnet``; comfy/ldm/lumina/controlnet.py ``ZImage_Control``; the
``noise_refiner`` and ``double_block`` patches of comfy/ldm/lumina/model.py at 617048a):

- the control input is the control image's VAE latent in model space (Flux's ``process_in``, Z-Image's latent
  format), and for the 2.x files after it the inpainting mask (1 channel) and the inpainting image's latent
  (16): 16 or 33 channels, patched 2 × 2 (channels last) and embedded by ``control_all_x_embedder``: one control
  token per real image token (no pad tokens), attending only to each other, at the image's RoPE positions;
- 1.0 (6 control layers): two plain blocks refine the control tokens first; 2.x (3 or 15 control layers): two
  control blocks run beside the model's noise refiners, the first on its embedded image tokens
  (``before_proj(c) + x``), each adding ``after_proj(c)`` × strength to the image tokens after its noise refiner;
  a 15-layer file whose refiner outputs are zero (``broken``, as ComfyUI marks it) runs its control layers there
  instead, as ComfyUI does;
- control layer k runs after the model's main block k · round(30 / layers) (ComfyUI's 30, Z-Image's main blocks,
  whatever the model's), layer 0 on the main blocks' input image tokens, and adds ``after_proj(c)`` × strength to
  the image tokens.

Under sequence parallelism (z_image.py) the refiner stage runs whole on every rank, as the model's refiners do;
then the control tokens are cut as the image's real tokens (``control_tokens``, the family's control plan), the
control layers attend through the model's sequence-parallel attention, and each rank adds its own share.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from ..errors import UserError
from . import controlnet, latent_formats

FAMILY = "z_image"
LATENT = latent_formats.FLUX  # Z-Image's latent format (comfy/supported_models.py: Lumina2's, Flux's)
HINT = ("the control image's VAE latent (Z-Image's VAE: Flux's) at the generation's latent size, and for a 2.x file "
        "the inpainting mask and the inpainting image's latent after it (33 channels)")
INPAINT_HINT_CHANNELS = 33  # a 2.x file's input: the control latent (16 channels), the mask (1), the inpainting latent
COMFY_MAIN_BLOCKS = 30  # ComfyUI's ZImageControlPatch places the control layers over 30 main blocks
BROKEN_LAYERS = 15  # ComfyUI checks a 15-layer file's refiner outputs for zeros (``broken``)
SEED = 19  # the built-in's weights
REFINER_MARK = "runs_whole"  # z_image.REFINER_MARK: an attention module that attends locally under SP


def network_class():
    return ZImageFunControlNet


class ZImageFunControlNet(nn.Module):
    """The Fun ControlNet's modules under the file's names, and its steps as ComfyUI's ZImage_Control takes them."""

    def __init__(self, dim: int, heads: int, layers: int, hint_channels: int, refiner_control: bool,
                 refiners: int = 2, broken: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        from diffusers.models.controlnets.controlnet_z_image import ZImageControlTransformerBlock
        from diffusers.models.transformers.transformer_z_image import ZImageTransformerBlock

        self.refiner_control, self.broken = refiner_control, broken
        self.control_layers = nn.ModuleList(
            ZImageControlTransformerBlock(i, dim, heads, heads, norm_eps, True, block_id=i) for i in range(layers))
        self.control_all_x_embedder = nn.ModuleDict({"2-1": nn.Linear(4 * hint_channels, dim)})
        self.control_noise_refiner = nn.ModuleList(
            ZImageControlTransformerBlock(1000 + i, dim, heads, heads, norm_eps, True, block_id=i) if refiner_control
            else ZImageTransformerBlock(1000 + i, dim, heads, heads, norm_eps, True, modulation=True)
            for i in range(refiners))
        for block in self.control_noise_refiner:  # the refiner stage runs whole on every rank, as the model's refiners
            setattr(block.attention, REFINER_MARK, True)
        self.control_tokens = nn.Identity()  # where sequence parallelism cuts the control tokens (the control plan)

    @property
    def hint_channels(self) -> int:
        return self.control_all_x_embedder["2-1"].in_features // 4

    def forward(self, hint: torch.Tensor, freqs: torch.Tensor, adaln: torch.Tensor) -> torch.Tensor:
        """The control tokens before the model's noise refiners: ``hint`` [B, n, 4·C] embedded, and for a 1.0 file
        refined by its plain blocks (at the image's positions ``freqs`` [B, n, D/2], time ``adaln``): [B, n, D]."""
        control = self.control_all_x_embedder["2-1"](hint)  # [B, n, D]
        if not self.refiner_control:
            for block in self.control_noise_refiner:
                control = block(control, None, freqs, adaln)
        return control

    def refiner_step(self, index: int, control, image, freqs, adaln):
        """Beside the model's noise refiner ``index``: (its residual or None, the control tokens after it), the
        image tokens ``image`` [B, n, D] those that entered the noise refiners."""
        if not self.refiner_control:
            return None, control
        if not self.broken:
            return step(self.control_noise_refiner[index], control, image, freqs, adaln)
        with _whole(self.control_layers):
            if index == 0:
                return step(self.control_layers[0], control, image, freqs, adaln)
            first = None
            for block in self.control_layers[1:]:  # ComfyUI: every later layer, the first one's residual
                residual, control = step(block, control, image, freqs, adaln)
                first = residual if first is None else first
            return first, control

    def layer_at(self, block: int) -> int | None:
        """The control layer that runs after the model's main block ``block``, or None."""
        every = round(COMFY_MAIN_BLOCKS / len(self.control_layers))
        layer, rest = divmod(block, every)
        return layer if rest == 0 and layer < len(self.control_layers) else None


def step(block, control, image, freqs, adaln):
    """One control block: (its residual ``after_proj(c)``, c) [B, n, D] each; the first block takes ``image`` too."""
    stacked = block(control if block.block_id == 0 else control[None], image, None, freqs, adaln)  # [2, B, n, D]
    return stacked[-2], stacked[-1]



@contextmanager
def _whole(blocks):
    """A broken file's control layers in the refiner stage: attending locally, over the whole control (under SP)."""
    for block in blocks:
        setattr(block.attention, REFINER_MARK, True)
    try:
        yield
    finally:
        for block in blocks:
            delattr(block.attention, REFINER_MARK)


def matches(keys: set) -> bool:
    """A Fun ControlNet's keys, as ComfyUI's ModelPatchLoader tells it."""
    return "control_all_x_embedder.2-1.weight" in keys


def read(path: str, state: dict) -> ZImageFunControlNet:
    """The network in ``state`` (read from ``path``), its shape read off the tensors as ComfyUI reads it (on the
    CPU, in the file's precision)."""
    try:
        layers = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("control_layers."))
        refiners = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("control_noise_refiner."))
        dim, inputs = state["control_all_x_embedder.2-1.weight"].shape
        head = state["control_layers.0.attention.norm_q.weight"].shape[0]
        refiner_control = "control_noise_refiner.0.before_proj.weight" in state
        refiner_out = state.get("control_noise_refiner.0.after_proj.weight")
        broken = layers == BROKEN_LAYERS and refiner_out is not None and not torch.count_nonzero(refiner_out)
        with torch.device("meta"):
            network = ZImageFunControlNet(dim, dim // head, layers, inputs // 4, refiner_control, refiners,
                                          bool(broken))
        network.load_state_dict(state, strict=True, assign=True)
    except (KeyError, ValueError, RuntimeError) as exc:  # a tensor missing, none of a list, or one of another shape
        raise UserError(f"model patch {path}: its tensors do not fit Z-Image's Fun ControlNet ({str(exc)[:300]})",
                        "use alibaba-pai's Z-Image-Turbo-Fun-Controlnet-Union file as released") from None
    return network


def built_in(name: str) -> ZImageFunControlNet:
    """A built-in Fun ControlNet (controlnet.BUILTINS) for its model's size, from a fixed seed: the 3-layer 2.x layout
    (control refiners, the inpainting channels)."""
    from .builtins import BUILTINS as MODELS

    config = MODELS[controlnet.BUILTINS[name]].config
    return controlnet.drawn(SEED, lambda: ZImageFunControlNet(
        config["dim"], config["n_heads"], 3, INPAINT_HINT_CHANNELS, True, config["n_refiner_layers"]),
        lambda made: [getattr(block, name) for block in (*made.control_layers, *made.control_noise_refiner)
                      for name in ("after_proj", "before_proj") if hasattr(block, name)])


def bind(network: ZImageFunControlNet, transformer) -> None:
    """Nothing to take from the model; its noise refiners must be as many as the network's (run beside them)."""
    refiners = len(transformer.noise_refiner)
    if len(network.control_noise_refiner) != refiners:
        raise UserError(f"this Fun ControlNet has {len(network.control_noise_refiner)} noise refiner blocks, the model "
                        f"{refiners}", "use a Fun ControlNet made for this Z-Image model")


def blocks(network: ZImageFunControlNet) -> list:
    """The blocks weight sharding splits."""
    return [*network.control_noise_refiner, *network.control_layers]


def width(network: ZImageFunControlNet) -> int:
    return network.control_all_x_embedder["2-1"].out_features


def hint_shape(network: ZImageFunControlNet, latent_size: tuple[int, int]) -> tuple[int, ...]:
    return (network.hint_channels, *latent_size)


def hint(network: ZImageFunControlNet, latent: torch.Tensor) -> torch.Tensor:
    """[1, C, h, w] raw VAE latents (a 2.x file's: control, mask, inpainting) → the embedder's input [1, n, 4·C]: each
    latent in model space, patched 2 × 2 with the channels last, as ZImage_Control patches it."""
    latent = latent.to(torch.float32, copy=True)
    latent[:, :LATENT.channels] = LATENT.process_in(latent[:, :LATENT.channels])
    if latent.shape[1] == INPAINT_HINT_CHANNELS:  # the inpainting latent after the mask
        latent[:, LATENT.channels + 1:] = LATENT.process_in(latent[:, LATENT.channels + 1:])
    b, c, h, w = latent.shape
    patches = latent.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)  # [1, h/2, w/2, 2, 2, C]
    return patches.reshape(b, -1, 4 * c)  # [1, n, 4·C]
