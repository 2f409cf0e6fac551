"""A request's controls: ComfyUI's model patches (its ``models/model_patches`` folder: small networks a patch node
attaches to a loaded model, here DiffSynth's block-wise ControlNet for Qwen-Image) and ControlNets (``models/
controlnet``, controlnet.py), told apart by their files' keys; each entry has a strength and, for a ControlNet,
the percent range it acts in.

As ComfyUI runs it (comfy_extras/nodes_model_patch.py in the shared snapshot, v0.3.64: QwenImageBlockWiseControlNet,
ModelPatchLoader, DiffSynthCnetPatch, QwenImageDiffsynthControlnet): the control image's VAE latent (with
``additional_in_dim`` / 4 mask channels after it for the inpainting patch) has its first 16 channels put into model
space (Wan 2.1's latent format), is padded to 2×2 patches, packed like the image and embedded by the patch's own
``img_in``: one hint token per image token. After transformer block i (a ``double_block`` patch, called in
comfy/ldm/qwen_image/model.py after every block) the image tokens — the noisy latent's, not the references' after
them — gain ``strength · block_i(x, hint)``, where block_i is RMSNorm(x) + RMSNorm(hint) through Linear, GELU,
Linear. Everything is per token, so under sequence parallelism each rank applies it to its own share of the tokens
with its own share of the hint (the family's sequence plan cuts the hint as it cuts the image): nothing is gathered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from . import controlnet, latent_formats
from .file_kind import file_entries
from .patch_embed import pack, pad_to_patch
from .storage import FLOAT8, place

LATENT_CHANNELS = 16  # the model-space channels of the hint (Wan 2.1's latent); the rest are mask channels
SEED = 7  # the built-in patches' weights
MAX_PATCHES = 8
# built-in patches (random weights, for tests and demos) and the built-in model each fits
BUILTINS = {"qwen-image-diffsynth-tiny": "qwen-image-tiny"}


@dataclass(frozen=True)
class PatchSpec:
    """One control of a request: its file (or built-in name), its strength, and the part of the schedule it acts in
    (percent of the way from the first step to the last, as ControlNetApplyAdvanced's start and end: ControlNets)."""

    path: str
    strength: float
    start: float = 0.0
    end: float = 1.0
    mode: int | None = None  # a union ControlNet's control type (SetUnionControlNetType's); None: auto

    @property
    def built_in(self) -> bool:
        return self.path in BUILTINS or self.path in controlnet.BUILTINS


class ControlBlock(nn.Module):
    """One block's control: RMSNorm(x) + RMSNorm(hint) → Linear → GELU → Linear, per token."""

    def __init__(self, dim: int):
        super().__init__()
        self.x_rms = nn.RMSNorm(dim, eps=1e-6)
        self.y_rms = nn.RMSNorm(dim, eps=1e-6)
        self.input_proj = nn.Linear(dim, dim)
        self.act = nn.GELU()
        self.output_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, hint: torch.Tensor) -> torch.Tensor:
        return self.output_proj(self.act(self.input_proj(self.x_rms(x) + self.y_rms(hint))))  # [B, n, D]


class BlockwiseControlNet(nn.Module):
    """DiffSynth's block-wise ControlNet for Qwen-Image: the hint's embedding and one ControlBlock per transformer
    block. Its state-dict keys are the file's (``img_in.*``, ``controlnet_blocks.<i>.{x_rms,y_rms,input_proj,
    output_proj}.*``)."""

    def __init__(self, blocks: int, dim: int, in_dim: int = 64, additional_in_dim: int = 0):
        super().__init__()
        self.additional_in_dim = additional_in_dim
        self.img_in = nn.Linear(in_dim + additional_in_dim, dim)
        self.controlnet_blocks = nn.ModuleList(ControlBlock(dim) for _ in range(blocks))

    def keep_blocks(self, start: int, end: int) -> None:
        """Keep the control blocks of the model's blocks [start, end) only (a PipeFusion stage's); the others, never
        called on this rank, become empty stand-ins."""
        for index in range(len(self.controlnet_blocks)):
            if not start <= index < end:
                self.controlnet_blocks[index] = nn.Identity()

    @property
    def latent_channels(self) -> int:
        """The channels of the latent the hint is made from: 16 and the mask's."""
        return self.img_in.in_features // 4

    def hint(self, latent: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] (raw VAE space, C = latent_channels) → [B, h/2·w/2, D] in the network's dtype, as
        process_input_latent_image makes it: ``img_in`` in the latent's float32 (ComfyUI casts the layer to its
        input), then rounded to the model's dtype where the patch adds it."""
        latent = latent.to(torch.float32, copy=True)  # its first channels are changed below, not the caller's
        latent[:, :LATENT_CHANNELS] = latent_formats.WAN21.process_in(latent[:, :LATENT_CHANNELS])
        tokens = pack(pad_to_patch(latent, (1, 2, 2)))  # [B, n, C·4]
        weight, bias = self.img_in.weight.float(), self.img_in.bias.float()
        return torch.nn.functional.linear(tokens, weight, bias).to(self.img_in.weight.dtype)  # [B, n, D]


@dataclass
class AppliedPatch:
    """A patch as one generation applies it: the network, its hint tokens for the generation's latent, the strength."""

    network: BlockwiseControlNet
    hint: torch.Tensor  # [1, N, D]: one token per noisy image token
    strength: float


def parse(entries: list) -> list[PatchSpec]:
    """The ``controls`` of a request, checked: [{"path": str, "strength": number[, "start", "end", "type"]}, …]."""
    example = {"path": "models/model_patches/qwen_image_canny_diffsynth_controlnet.safetensors", "strength": 1.0}
    own = ("start", "end", "type")  # checked here, the rest by file_entries
    without_ranges = [{k: v for k, v in entry.items() if k not in own} if isinstance(entry, dict)
                      else entry for entry in entries] if isinstance(entries, list) else entries
    files = file_entries(without_ranges, "control", MAX_PATCHES, example, "models/model_patches or models/controlnet",
                         (*BUILTINS, *controlnet.BUILTINS))
    return [PatchSpec(path, strength, *_percent_range(entry), _union_type(entry))
            for (path, strength), entry in zip(files, entries)]


def _union_type(entry: dict) -> int | None:
    """A control entry's union type (a union ControlNet's; None when left out: ComfyUI's "auto"), checked."""
    mode = entry.get("type")
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or mode < 0):
        raise UserError(f"control type {mode!r}: a union ControlNet's type number ≥ 0",
                        "as SetUnionControlNetType numbers them (openpose 0, depth 1, … canny 3, … tile 6), or "
                        "leave it out for auto")
    return mode


def _percent_range(entry: dict) -> tuple[float, float]:
    """A control entry's start and end (a ControlNet's; 0 and 1 when left out), checked."""
    start, end = entry.get("start", 0.0), entry.get("end", 1.0)
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in (start, end)) or not 0 <= start <= end <= 1:
        raise UserError(f"control range start {start!r}, end {end!r}: two numbers 0 ≤ start ≤ end ≤ 1",
                        "as ControlNetApplyAdvanced's start_percent and end_percent")
    return float(start), float(end)


def read(path: str) -> BlockwiseControlNet:
    """A model patch file, as ModelPatchLoader reads it (on the CPU, in the file's precision); one ComfyUI does not
    know, or one this version does not run, is refused with what it is."""
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except (OSError, ValueError) as exc:  # safetensors' own errors are ValueError subclasses
        raise UserError(f"model patch {path}: not a readable safetensors file ({exc})",
                        "check the file: ComfyUI keeps model patches in models/model_patches") from None
    if controlnet.kind_of_keys(state) is not None:
        return controlnet.read(path, state)
    if "controlnet_blocks.0.y_rms.weight" not in state:
        kind = ("a SigLIP style projector (USO)" if "feature_embedder.mid_layer_norm.bias" in state
                else f"no model patch ComfyUI knows (keys {sorted(state)[:3]}…)")
        raise UserError(f"model patch {path} is {kind}; this version runs DiffSynth's block-wise ControlNet for "
                        "Qwen-Image and Z-Image's Fun ControlNet", "use a Qwen-Image DiffSynth ControlNet patch (e.g. "
                        "qwen_image_canny_diffsynth_controlnet.safetensors) or a Z-Image Fun ControlNet Union file")
    blocks = 1 + max(int(key.split(".")[1]) for key in state if key.startswith("controlnet_blocks."))
    dim, in_features = state["img_in.weight"].shape
    network = BlockwiseControlNet(blocks, dim, 64, in_features - 64)
    network.load_state_dict({key: value.float() for key, value in state.items()})
    return network.to(state["img_in.weight"].dtype)


def built_in(blocks: int, dim: int) -> BlockwiseControlNet:
    """A random patch for a model of ``blocks`` blocks of width ``dim`` (the tiny built-ins'), from a fixed seed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        network = BlockwiseControlNet(blocks, dim)
        for block in network.controlnet_blocks:  # RMSNorm starts at ones: give the norms' scales some spread
            for norm in (block.x_rms, block.y_rms):
                nn.init.uniform_(norm.weight, 0.5, 1.5)
    return network


def network(spec: PatchSpec, device: torch.device, dtype: torch.dtype):
    """The control's network on ``device`` in ``dtype`` (a file's, read; a built-in's, drawn for its model's size):
    a BlockwiseControlNet, or a ControlNet (diffusers' QwenImageControlNetModel, with the pass-through modules its
    RoPE tables leave through, as the model's: qwen_image.rope_and_time)."""
    if spec.path in controlnet.BUILTINS:
        made = controlnet.built_in(spec.path)
    elif spec.built_in:
        from . import builtins

        config = builtins.BUILTINS[BUILTINS[spec.path]].config
        made = built_in(config["num_layers"], config["num_attention_heads"] * config["attention_head_dim"])
    else:
        made = read(spec.path)
    return placed(made, device, dtype).requires_grad_(False)


def placed(network: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """``network`` on ``device``: its Linear weights kept in a float8 file's precision (upcast a layer at a time
    at compute, as the model's: storage.StoredLinear), every other floating tensor in ``dtype``."""
    for module in network.modules():
        for leaf, tensor in list(module._parameters.items()):
            if tensor is not None:
                module._parameters[leaf] = nn.Parameter(place(module, leaf, tensor.detach(), device, dtype, None, True),
                                                        requires_grad=False)
        for leaf, tensor in list(module._buffers.items()):
            if tensor is not None:
                module._buffers[leaf] = tensor.to(device, dtype if tensor.is_floating_point() else None)
    return network


def blocks_of(network) -> list[nn.Module]:
    """The blocks weight sharding splits: a ControlNet's own transformer blocks, a patch's control blocks (those a
    PipeFusion stage kept)."""
    if not isinstance(network, BlockwiseControlNet):
        return controlnet.kind_of(network).blocks(network)
    return [block for block in network.controlnet_blocks if not isinstance(block, nn.Identity)]


def takes_pixels(spec: PatchSpec) -> bool:
    """Whether the control takes the image's pixels (an XLabs ControlNet embeds them itself), not its VAE latent."""
    if spec.built_in:
        return False
    from safetensors import safe_open

    try:
        with safe_open(spec.path, framework="pt") as handle:
            return controlnet.PIXEL_HINT in handle.keys()
    except (OSError, ValueError):
        return False  # unreadable: reading it says so


def control_family(spec: PatchSpec) -> str | None:
    """The family a ControlNet is made for (None: a model patch, or a file reading will say what is wrong with)."""
    if spec.built_in:
        return controlnet.family_of_builtin(spec.path) if spec.path in controlnet.BUILTINS else None
    from safetensors import safe_open

    try:
        with safe_open(spec.path, framework="pt") as handle:
            kind = controlnet.kind_of_keys(handle.keys())
    except (OSError, ValueError):
        return None  # unreadable: reading it says so
    return None if kind is None else kind.FAMILY


def nbytes(spec: PatchSpec, dtype: torch.dtype) -> int:
    """The bytes the patch's network holds in ``dtype``, from the file's header (nothing is read) or the built-in's
    size: the fit check counts them before loading. A float8 tensor stays so (``placed``: a Linear weight; counted
    at one byte, the rare float8 bias or norm with it)."""
    if spec.built_in:
        return sum(p.numel() for p in network(spec, torch.device("meta"), dtype).parameters()) * dtype.itemsize
    from safetensors import safe_open

    with safe_open(spec.path, framework="pt") as handle:
        slices = [handle.get_slice(key) for key in handle.keys()]
        return sum(math.prod(part.get_shape()) * (1 if part.get_dtype().startswith("F8") else dtype.itemsize)
                   for part in slices)


def applied(spec: PatchSpec, made, latent: torch.Tensor | None, seed: int, latent_size: tuple[int, int], model,
            sampling):
    """The control as a generation applies it: its hint from the control ``latent`` [1, C, h, w] (a built-in's drawn
    from ``seed`` when none is sent), checked against the ``model`` it patches (the whole model's blocks: a PipeFusion
    stage holds some of them); a ControlNet's σ range from ``sampling`` (the model's: percent_to_sigma)."""
    if not isinstance(made, BlockwiseControlNet):
        return _applied_controlnet(spec, made, latent, seed, latent_size, model.transformer, model.width, sampling)
    blocks, width = model.transformer.config.num_layers, model.width
    have = (len(made.controlnet_blocks), made.img_in.out_features)
    if have != (blocks, width):
        raise UserError(f"model patch {spec.path} has {have[0]} blocks of width {have[1]}, but the model has {blocks} "
                        f"of width {width}", "use a patch made for this model (Qwen-Image's: 60 blocks of 3072)")
    if latent is None:
        generator = torch.Generator().manual_seed(seed)
        latent = torch.randn((1, made.latent_channels, *latent_size), generator=generator)
    elif latent.shape[1] != made.latent_channels:
        raise UserError(f"the control latent for {spec.path} has {latent.shape[1]} channels; the patch takes "
                        f"{made.latent_channels} ({LATENT_CHANNELS} latent channels"
                        f"{' and the mask' if made.additional_in_dim else ''})",
                        "encode the control image with the model's VAE (Qwen-Image's: Wan 2.1's)")
    with torch.no_grad():
        hint = made.hint(latent.to(made.img_in.weight.device))  # [1, N, D]
    return AppliedPatch(made, hint, spec.strength)


def _applied_controlnet(spec: PatchSpec, made, latent, seed: int, latent_size: tuple[int, int], transformer,
                        width: int, sampling) -> controlnet.AppliedControlNet:
    kind = controlnet.kind_of(made)
    if kind.width(made) != width:
        raise UserError(f"ControlNet {spec.path} has width {kind.width(made)}, but the model has {width}",
                        "use a ControlNet made for this model (Flux.1's and Qwen-Image's: 3072)")
    embedder = getattr(made, "controlnet_mode_embedder", None)
    if spec.mode is not None and embedder is not None and spec.mode >= embedder.num_embeddings:
        raise UserError(f"ControlNet {spec.path}: union type {spec.mode}, but it has {embedder.num_embeddings} types",
                        f"use a type 0 … {embedder.num_embeddings - 1} (SetUnionControlNetType's), or none (auto)")
    shape = kind.hint_shape(made, latent_size)  # [C, h, w]: a latent's, or (XLabs') the image's pixels
    if latent is None:
        generator = torch.Generator().manual_seed(seed)
        latent = torch.randn((1, *shape), generator=generator)
    elif tuple(latent.shape[1:]) != shape:
        raise UserError(f"the control input for {spec.path} has shape {list(latent.shape)}; this ControlNet takes "
                        f"{[1, *shape]}", f"send the control image as this ControlNet takes it: {kind.HINT}")
    computes = next(p for p in made.parameters() if p.dtype not in FLOAT8)  # a bias: the compute dtype
    with torch.no_grad():
        hint = kind.hint(made, latent.to(computes.device)).to(computes.device, computes.dtype)
    kind.bind(made, transformer)
    sigmas = (sampling.percent_to_sigma(spec.start), sampling.percent_to_sigma(spec.end))
    return controlnet.AppliedControlNet(made, hint, spec.strength, sigmas, spec.mode)
