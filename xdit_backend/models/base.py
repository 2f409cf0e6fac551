"""What every model family shares: the request geometry a spec derives, and the loaded-model wrapper.

A family module (flux.py, wan.py, qwen_image.py, …: one per family in registry.FAMILIES) declares,
as data on its spec: the conditioning it takes, its latent format, its model sampling, how sequence
parallelism cuts its tokens and positions and which attention processor it gives them (its
SequencePlan), how PipeFusion cuts it into stages (its StagePlan), which blocks a step cache may
skip (its CachePlan), and the parallel methods it supports. Where PipeFusion needs code (a patch
entering and leaving a stage), the family's model wrapper implements the few ``DiffusionModel``
stage methods below; where attention needs code, the family's processor class (defined in its
module) computes the projections and hands the attention itself to the engine's core.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UserError
from .resize import upscale


class FamilySpec(ABC):
    """The interface every family's spec implements: a frozen dataclass of the numbers read from a
    model's config, plus these class attributes and methods. The engine (parallel/, sampling/,
    service/) reads a family only through this interface and its model wrapper (``DiffusionModel``),
    never by importing a family module; ``__init_subclass__`` refuses a family that
    leaves a required attribute unset, so a new family fails at its definition, not in a request.

    Each family sets:
    family:           its name in the registry ("flux", "sd3", …)
    latent_format:    models/latent_formats.py (ComfyUI's constants; a property where it depends on the model)
    parallel_methods: the degrees it can run with > 1 (distributed/config.DEGREES)
    sequence_plan:    where sequence parallelism cuts its tokens and gathers them (SequencePlan)
    stage_plan:       how PipeFusion cuts its blocks into stages and keeps stale K/V (StagePlan)
    cache_plan:       which blocks a step cache may skip, and what it reads to decide (CachePlan)
    and the dataclass fields ``heads`` (attention heads: Ulysses splits them) and ``blocks``
    (transformer blocks: PipeFusion cuts them into stages).

    Its conditioning (request.py checks it, nodes/translate.py makes it from ComfyUI's values):
    conditioning_shapes(batch, text_tokens): the tensors of one side of the guidance by request key;
                      a dimension None is any length (a second text encoder's tokens: HunyuanDiT's mT5).
    optional_conditioning: keys a request may leave out: a key of ``conditioning_shapes`` (its shape
                      from there), or ``<key>_mask`` [B, L_key], 1 for a real token and 0 for padding,
                      of the context ("context_mask") or of another key ("context_mt5_mask").
    comfy_conditioning: ComfyUI conditioning option → request key for the tensors besides the context
                      and the pooled output ({"conditioning_mt5xl": "context_mt5"}; "option.attribute" for a
                      tensor an option's object holds: Wan's "clip_vision_output.penultimate_hidden_states");
                      translate.py reads them.
    comfy_model_inputs: the keyword inputs ComfyUI's own diffusion model of this family takes besides x,
                      the timestep and the context (comfy/model_base.py ``_apply_model``'s ``extra_conds``) →
                      the request key each becomes ({"y": "pooled"}; "guidance": Flux's embedded guidance, per
                      row; "references": ComfyUI's ``ref_latents``, sent as ``reference_<i>`` in raw latent space;
                      for ``ref_latents_method``, the one method the family's wrapper takes). None: the xDiT MODEL
                      (nodes/model_call.py) does not run this family yet.
    takes_model_patches: the family's wrapper applies ComfyUI's block-wise model patches (models/model_patch.py:
                      a DiffSynth ControlNet) after each block, from its ``model_patches``.
    takes_controlnets: the family's wrapper runs its ControlNets (models/controlnet.py) from its ``model_patches``
                      and adds their residuals; ``control_plan`` is where sequence parallelism cuts a ControlNet
                      (the model's cuts and attention, the hint cut like the image, nothing gathered).
    takes_references: reference latents (ComfyUI's ``reference_latents``: image editing) come as
                      ``reference_0``, ``reference_1``, … [B, C, h, w] in ComfyUI's raw latent space
                      (C the latent channels, h and w multiples of the patch); the model wrapper applies
                      ``latent_format.process_in`` to them, as ComfyUI's model_base does.
    concat_channels:  channels ComfyUI concatenates to the model input (image to video, inpainting: its model's
                      ``concat_cond``); the transformer takes the latent's channels and these. The model wrapper
                      builds them from the conditioning (``DiffusionModel.concat``), or the call brings them (the
                      xDiT MODEL's x, concatenated by ComfyUI).
    prepare_conditioning(cond): one side as the model takes it (ComfyUI's ``extra_conds`` reshaping
                      it: Flux.2 pads its text to 512 tokens). SampleRequest.generation applies it once
                      per generation to both sides, so every layout (serial, ulysses/ring, cfg, dp,
                      PipeFusion's buffers) sees them so; the leader applies it to choose the layout.
    drawn_shapes(batch, text_tokens): the shapes a built-in's stand-in conditioning is drawn in (the
                      conditioning's, but where another length may vary: Wan VACE's control videos, one).
    """

    REQUIRED: ClassVar[tuple[str, ...]] = ("family", "latent_format", "parallel_methods", "sequence_plan",
                                           "stage_plan", "cache_plan", "heads", "blocks")

    vae_factor = 8  # pixels per latent cell (Wan 2.2-5B's VAE: 16)
    patch = (1, 2, 2)  # latent cells per token: (frames, rows, columns)
    video = False  # 5-D latents [B, C, T, h, w]
    time_factor = 4  # video frames per latent frame after the first (Wan's VAEs)
    default_guidance: float | None = None  # a guidance embedding (Flux-dev); None: the family has none
    takes_shift = True  # flow models have a shift; discrete EPS models (PixArt) have none
    # under a noise mask ComfyUI's model takes a timestep per frame and keeps the masked-out region clean (its WAN22
    # process_timestep and scale_latent_inpaint: Wan 2.2 TI2V-5B's image to video): the sampler hands the model the
    # mask as ``denoise_mask`` (sampling/generate.py)
    masked_timesteps_per_frame = False
    # the latent has an audio part beside the video one, its shape past the batch with None at its length (LTX-2's
    # (8, None, 16): [B, 8, T, 16]; MiniMax-H3's (32, 2, None)); the two are sampled as one (sampling/packed.py), the
    # length from the video's (``audio_frames``)
    audio_part: ClassVar[tuple[int | None, ...] | None] = None
    optional_conditioning: tuple[str, ...] = ()
    comfy_conditioning: ClassVar[dict[str, str]] = {}
    takes_references: ClassVar[bool] = False
    takes_model_patches: ClassVar[bool] = False
    takes_controlnets: ClassVar[bool] = False
    step_cache_refusal: ClassVar[str | None] = None  # why the step cache cannot run on the family, if it cannot
    method_refusals: ClassVar[dict[str, str]] = {}  # a degree left out of parallel_methods → why, for the message
    guidance_passes: ClassVar[bool] = False  # the model runs LTX-2's extra guidance passes (DiffusionModel.guidance_pass)
    control_plan: ClassVar[SequencePlan | None] = None
    comfy_model_inputs: ClassVar[dict[str, str] | None] = None
    # ComfyUI conditioning options the family needs set True (option → (what it means when not, the fix)): LTX-2's
    # unprocessed_ltxav_embeds, the text encoder's features before the model's connectors
    comfy_flags: ClassVar[dict[str, tuple[str, str]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}
        missing = [name for name in cls.REQUIRED if not hasattr(cls, name) and name not in declared]
        if missing:
            raise TypeError(f"model family {cls.__name__} does not set {', '.join(missing)} (see FamilySpec)")

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict) -> FamilySpec:
        """The spec of a model from its diffusers config."""

    @abstractmethod
    def model_sampling(self, shift: float | None):
        """ComfyUI's model sampling for this family (sampling/model_sampling.py); ``shift`` None: the default."""

    @abstractmethod
    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """The tensors a request carries for one side (positive or negative) of the guidance, by key;
        a dimension None: any length."""

    def drawn_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """The shapes a built-in's stand-in conditioning is drawn in (registry.random_conditioning): the
        conditioning's, unless a length other than the text's or the latent's may vary (Wan VACE's entries)."""
        return self.conditioning_shapes(batch, text_tokens)

    def prepare_conditioning(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One side's tensors as the model takes them; the identity unless the family reshapes them."""
        return cond

    @property
    def model_reads_noise_mask(self) -> bool:
        """Whether ComfyUI's model of this family reads a latent's noise mask (its ``denoise_mask`` extra cond):
        WAN22's timesteps per frame; Fill's and Wan I2V's concat_cond, for its mask where the conditioning has none."""
        return self.masked_timesteps_per_frame

    def split_text_tokens(self, cond: dict) -> int:
        """The tokens a side's text adds to the sequence the ranks split (the memory model's and auto's count; 0 where
        the text is only cross-attended): the context's, or what a family joins to it."""
        return cond["context"].shape[1] if self.sequence_plan.cuts_text else 0

    @property
    def concat_channels(self) -> int:
        return 0

    @property
    def pixel_multiple(self) -> int:
        return self.vae_factor * self.patch[1]

    def latent_frames(self, frames: int) -> int:
        return (frames - 1) // self.time_factor + 1 if self.video else 1

    def pixel_frames(self, latent_frames: int) -> int:
        """The video frames a latent of ``latent_frames`` frames decodes to (``latent_frames``' inverse)."""
        return (latent_frames - 1) * self.time_factor + 1

    def check_size(self, width: int, height: int, frames: int) -> None:
        """Sizes the VAE and the patches can tile; errors give the nearest sizes that work."""
        m = self.pixel_multiple
        for name, side in (("width", width), ("height", height)):
            if side % m:
                raise UserError(f"{name} {side} is not a multiple of {m} for {self.family} "
                                f"({self.vae_factor} per latent cell × {self.patch[1]} per patch)",
                                f"use {name} {side // m * m or m} or {(side // m + 1) * m}")
        if not self.video and frames != 1:
            raise UserError(f"frames {frames}: {self.family} makes images, not videos", "leave frames at 1")
        if self.video and (frames - 1) % self.time_factor:
            low = (frames - 1) // self.time_factor * self.time_factor + 1
            raise UserError(f"frames {frames} is not 1 + a multiple of {self.time_factor} (the video VAE's stride)",
                            f"use frames {low} or {low + self.time_factor}")

    def audio_frames(self, frames: int, frame_rate: float) -> int:
        """The audio part's length T for a video of ``frames`` frames at ``frame_rate`` (a family with audio)."""
        raise NotImplementedError

    def part_scales(self, shift: float | None) -> tuple[float, ...]:
        """Each latent part's factor into the sampler's space (sampling/packed.py LatentParts.scales)."""
        return (1.0, 1.0)

    def audio_shape(self, batch: int, length: int | None) -> tuple[int | None, ...]:
        """The audio latent's shape for ``batch`` rows of ``length`` frames (None: any)."""
        return (batch, *(length if d is None else d for d in self.audio_part))

    def audio_length(self, shape) -> int | None:
        """The length of an audio latent of ``shape``, None where it is not this family's audio layout."""
        axis = self.audio_part.index(None) + 1
        wanted = self.audio_shape(shape[0] if len(shape) else 0, shape[axis] if len(shape) > axis else 0)
        return shape[axis] if tuple(shape) == wanted else None

    def latent_shape(self, batch: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        h, w = height // self.vae_factor, width // self.vae_factor
        if self.video:
            return (batch, self.latent_format.channels, self.latent_frames(frames), h, w)
        return (batch, self.latent_format.channels, h, w)

    def token_grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int]:
        """(tokens the transformer sees, rows of tokens): sequence parallelism splits the first,
        PipeFusion's patches are bands of the second."""
        rows = height // self.vae_factor // self.patch[1]
        columns = width // self.vae_factor // self.patch[2]
        return self.latent_frames(frames) // self.patch[0] * rows * columns, rows



REFERENCE_PREFIX = "reference_"  # a side's reference latents: reference_0, reference_1, … (ComfyUI's, in order)


def references(cond: dict) -> list[torch.Tensor]:
    """The reference latents [B, C, h, w] (raw VAE space) a side carries, in their order."""
    keys = sorted((key for key in cond if key.startswith(REFERENCE_PREFIX) and key[len(REFERENCE_PREFIX):].isdigit()),
                  key=lambda key: int(key[len(REFERENCE_PREFIX):]))
    return [cond[key] for key in keys]


def reference_rows(latent: torch.Tensor, batch: int, index: int) -> torch.Tensor:
    """Reference latent ``index`` [b, ...] over a call's ``batch`` rows: each side's references repeated over its own
    images ([pos refs, neg refs] → [pos ×k, neg ×k])."""
    if batch % latent.shape[0]:
        raise UserError(f"reference latent {index} has batch {latent.shape[0]}, the latent {batch}",
                        "give one reference image, or one per latent in the batch")
    return latent.repeat_interleave(batch // latent.shape[0], dim=0)


def shape_fits(shape: tuple[int, ...], wanted: tuple[int | None, ...]) -> bool:
    """``shape`` is the ``wanted`` of a spec's ``conditioning_shapes``, where None is any length of at least 1."""
    return len(shape) == len(wanted) and all(d == w or (w is None and d > 0) for d, w in zip(shape, wanted))


def shape_text(shape: tuple[int | None, ...]) -> str:
    """A wanted shape for a message: [1, any, 2048]."""
    return "[" + ", ".join("any" if d is None else str(d) for d in shape) + "]"


class PerConditioning:
    """What a model derives from a conditioning tensor with its own weights (LTX-2's connected texts, MiniMax-H3's
    refined text), computed once per tensor. A generation calls the model with the same tensors at every step; where
    cond and uncond (or guidance passes) run as calls of their own they alternate, so a single kept entry would be
    computed again at every call. Keyed by identity, each entry holding its tensor, so no identity is reused while it
    is kept; the last ``keep`` are kept (a generation's two sides), and a later generation's tensors replace them.
    (``derive`` is passed at each call: a bound method kept here would tie the model in a cycle, which would hold its
    memory after an unload until the garbage collector ran.)"""

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._kept: list[tuple[torch.Tensor, object]] = []

    def get(self, tensor: torch.Tensor, derive):
        for kept, value in self._kept:
            if kept is tensor:
                return value
        value = derive(tensor)
        self._kept = [*self._kept, (tensor, value)][-self._keep:]
        return value


class DiffusionModel(ABC):
    """A loaded transformer (whole, or one PipeFusion stage of it) and its family's spec.

    ``predict_x0`` is ComfyUI's model call: scale the input, run the transformer at the model
    sampling's timestep, and turn its output into a denoised estimate. A family implements
    ``output`` (the transformer's raw prediction in latent shape).
    """

    def __init__(self, transformer, name: str, spec, patches=None, compute_dtype: torch.dtype | None = None,
                 storage_dtype: str | None = None):
        self.transformer = transformer.eval().requires_grad_(False)
        self.name = name
        self.spec = spec
        self.patches = patches  # the LoRAs it carries (lora.Patches)
        self.lora_reports: list[dict] = []  # per LoRA file carried: modules patched, unmatched keys
        self.compiled_blocks: dict | None = None  # compile.py: {"on": bool} once its blocks are compiled
        # What it computes in, and what its Linear weights are stored in (models/storage.py:
        # "float8_e4m3fn", "float8_e4m3fn scaled", "gguf Q4_K", or the compute dtype's name).
        # diffusers' transformer.dtype would name the first parameter's, float8 for an fp8 file.
        self.compute_dtype = compute_dtype or transformer.dtype
        self.storage_dtype = storage_dtype or str(self.compute_dtype).removeprefix("torch.")
        # the running generation's controls, in order (the executor's): model patches and ControlNets (model_patch.py)
        self.model_patches: list = []

    @property
    def controlnets(self) -> list:
        """The running generation's ControlNets (they run under the model's own sequence split: parallel/denoiser)."""
        from .controlnet import AppliedControlNet

        return [control for control in self.model_patches if isinstance(control, AppliedControlNet)]

    @property
    def latent_format(self):
        return self.spec.latent_format

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        """Where its weights are: the first parameter's device not ``meta`` (a PipeFusion stage keeps the other
        stages' blocks there). diffusers' ``transformer.device`` walks every module looking for group offloading
        first: a fifth of a small model's call, as often as the family's code asks."""
        for tensor in itertools.chain(self.transformer.parameters(), self.transformer.buffers()):
            if tensor.device.type != "meta":
                return tensor.device
        return self.transformer.device

    @property
    def width(self) -> int:
        """The blocks' hidden size D (what PipeFusion's stages send per token)."""
        config = self.transformer.config
        return config.num_attention_heads * config.attention_head_dim

    def concat(self, shape: tuple[int, ...], cond: dict) -> torch.Tensor | None:
        """The channels concatenated to the model input of a latent of ``shape`` [B, C, (T,) h, w]
        (FamilySpec.concat_channels) [B, concat_channels, (T,) h, w], made from ``cond`` as ComfyUI's model makes
        them; None for a family without."""
        return None

    def image_in(self, image: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Latents ComfyUI's nodes put on a conditioning (raw VAE space, [B, C·k, (T,) h', w']) as its models'
        ``concat_cond`` take them in: resized to the latent's h × w (bilinear, centre crop) and each latent's C
        channels shifted into model space."""
        image = upscale(image.to(self.device, torch.float32), h, w)
        fmt = self.latent_format
        return torch.cat([fmt.process_in(part) for part in image.split(fmt.channels, dim=1)], dim=1)

    def with_concat(self, x: torch.Tensor, cond: dict) -> torch.Tensor:
        """The model input: ``x`` with the concatenated channels where x is the latent alone."""
        extra = self.concat(tuple(x.shape), cond) if x.shape[1] == self.spec.latent_format.channels else None
        return x if extra is None else torch.cat([x, extra.to(x)], dim=1)  # [B, C + concat_channels, ...]

    @contextmanager
    def guidance_pass(self, kind: str | None, passes):
        """Calls in the block run ``kind``'s pass of LTX-2's guidance (sampling/guidance.py: "perturbed", "isolated";
        None: the model as it is): a family with ``guidance_passes`` implements it."""
        if kind is not None:
            raise NotImplementedError(f"{self.spec.family} runs no {kind} guidance pass")
        yield

    def predict_x0(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict, gen) -> torch.Tensor:
        """x0 for ``x`` (model space) at noise levels ``sigma`` [B]; a latent of parts (``gen.parts``: LTX-2's or
        MiniMax-H3's video and audio) is packed [B, K] here and given to ``output`` as its parts, whose outputs are packed back."""
        sampling = gen.sampling
        model_input = sampling.calculate_input(sigma, x).to(self.dtype)
        parts = getattr(gen, "parts", None)
        out = self.output(parts.unpack(model_input) if parts else model_input, sampling.timestep(sigma),
                          cond, gen.guidance)
        return sampling.calculate_denoised(sigma, (parts.pack(out) if parts else out).float(), x)

    @abstractmethod
    def output(self, x: torch.Tensor, timestep: torch.Tensor, cond: dict,
               guidance: float | torch.Tensor | None) -> torch.Tensor:
        """The transformer's raw prediction for the whole latent ``x``, in latent shape. Under sequence
        parallelism the same call runs: the plan's hooks cut the tokens inside (parallel/sequence.py).
        ``guidance``: one scale for every row (the whole-loop path), or [B] (a model call from ComfyUI's
        sampler: parallel/evaluation.py), for a family with a guidance embedding."""

    # PipeFusion (parallel/pipefusion.py): a patch is a band of token rows, [B, C, (T,) rows, w] in
    # the latent; ``tokens`` [n] are its tokens' indices in the whole image sequence (frames × rows ×
    # columns, row-major), so positions are always those of the whole latent.

    def positions(self, shape: tuple[int, ...]):
        """The position table of the whole latent ``shape`` (absolute embeddings or RoPE), once per generation."""
        raise NotImplementedError

    def step_inputs(self, shape: tuple[int, ...], timestep: torch.Tensor, cond: dict, guidance) -> dict:
        """What every stage needs at this step besides the tokens (time embedding, projected text, masks)."""
        raise NotImplementedError

    def embed(self, x: torch.Tensor, tokens: torch.Tensor, inputs: dict, positions) -> torch.Tensor:
        """Stage 0: the patch x [B, C, (T,) rows, w] (model input) → its tokens [B, n, D], positions added."""
        raise NotImplementedError

    def stage_references(self, cond: dict, positions):
        """The reference latents of ``cond`` (edits) as model-input tokens [B, R, C_in] (None without), and
        ``positions`` extended over them: the references follow the image sequence, at indices [N, N + R). Under
        PipeFusion they travel with each step's first chunk, replicated on the sequence ranks (stale_kv.py keeps
        their K/V in a region of their own)."""
        return None, positions

    def embed_references(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stage 0: the reference tokens [B, R, C_in] of ``stage_references`` → [B, R, D]."""
        raise NotImplementedError

    def joint_text_tokens(self, cond: dict) -> int:
        """How many text tokens ``embed_text`` gives for ``cond`` (StagePlan.joint_text): the context's, unless
        the family joins several texts (HunyuanVideo 1.5: byT5 and Qwen2.5-VL) or drops padding."""
        return cond["context"].shape[1]

    def embed_text(self, inputs: dict) -> torch.Tensor | None:
        """Stage 0: the text tokens [B, L, D] that travel through the blocks (StagePlan.joint_text), else None."""
        return None

    def block_kwargs(self, inputs: dict, positions, tokens: torch.Tensor, text_tokens: int) -> dict:
        """Per patch and stage: the keyword inputs of its blocks (RoPE for [text (L = text_tokens); tokens])."""
        raise NotImplementedError

    def run_block(self, block, image: torch.Tensor, text: torch.Tensor | None, kwargs: dict):
        """One block on [B, n, D] image tokens (and [B, L, D] text tokens or None) → (image, text)."""
        raise NotImplementedError

    def carried(self, block) -> int:
        """StagePlan.carries: how many per-patch tensors [B, n, D] are on the patch's carry list when
        ``block`` runs (what the previous stage sends with the activations when ``block`` starts a stage)."""
        return 0

    def head(self, image: torch.Tensor, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
        """Last stage: the output layers, per token: [B, n, D] → [B, n, patch values]; ``tokens`` [n]: their indices
        in the image sequence (a per-token modulation: Wan 2.2 TI2V under a noise mask), None from a family's own
        whole forward."""
        raise NotImplementedError

    def unpatchify(self, tokens: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """[B, n, patch values] of a band → the raw output in latent shape ``shape`` [B, C, (T,) rows, w]."""
        raise NotImplementedError


@dataclass(frozen=True)
class Cut:
    """One tensor that sequence parallelism cuts to this rank's share of the tokens.

    module: the module's name in the transformer ("" is the transformer itself; "blocks.*" each block of a list);
    arg:    a keyword or positional input of that module's forward, or None for its output
            (each tensor of a tuple output: RoPE's cos and sin);
    dim:    the sequence dimension of that tensor;
    text:   a text tensor (a joint model's text tokens are cut too): the text length must divide.
    optional: cut it only when it comes with that dimension.
    """

    module: str
    arg: str | int | None
    dim: int
    text: bool = False
    optional: bool = False  # cut only when the tensor has ``dim`` (Wan's timestep: [B, N] per token is cut, [B] not)


@dataclass(frozen=True)
class SequencePlan:
    """Where sequence parallelism cuts a family's tokens and gathers them back, by module name:
    attached from outside with forward hooks and attention processors, removed after the request
    (diffusers' ``_cp_plan`` is the precedent).

    cuts:      the tensors cut to this rank's share, each where it enters or leaves a module. Every
               rank holds 1/P of the image tokens and, for a joint model, 1/P of the text tokens.
    gather:    the module whose output [B, N/P, C] is gathered into [B, N, C] (before unpatchify); None: nothing
               is gathered (a ControlNet's residuals, which each rank adds to its own tokens).
    attention: (attribute name, processor class): attention modules that get a sequence-parallel
               processor, named by attribute ("attn") or by path without block indices ("transformer_blocks.attn1":
               not the same attribute of LTX-2's text connectors). The class is the family's (defined in its
               module; SD3's and PixArt's plain diffusers ``Attention`` share
               joint_attention.JointAttentionProcessor): ``Processor(core)`` computes the module's
               projections and hands the attention itself to
               ``core(q, k, v, text_tokens=L)`` on q, k, v [B, S, H, D] laid out [text share (L
               tokens); image share], returning [B, S, H, D] (parallel/sequence.USPAttention).
               Cross-attention to the whole text is left alone: its queries are this rank's tokens
               and its keys the whole text, so it is already exact.
    """

    cuts: tuple[Cut, ...]
    attention: tuple[tuple[str, type], ...]
    gather: str | None = "proj_out"

    @property
    def cuts_text(self) -> bool:
        """Whether the text tokens are split across the sequence ranks (joint models)."""
        return any(cut.text for cut in self.cuts)


@dataclass(frozen=True)
class StagePlan:
    """How PipeFusion (parallel/pipefusion.py) cuts a family into pipeline stages, by module name.

    block_lists: the transformer's ModuleLists of blocks, in execution order; a stage is a
                 contiguous run of their concatenation (Flux: double-, then single-stream blocks).
    attention:   (attribute name, processor class, sees_text): the attention modules that keep every
                 token's K/V and let a patch attend to the other patches' one-step-stale K/V. The
                 processor class is the one the SequencePlan names (its core here: parallel/stale_kv.
                 StaleKV); ``sees_text``: the module also attends to the text tokens (MM-DiT joint
                 attention). Cross-attention to the text is not listed: its
                 keys are the whole text, the same at every step, so it needs no stale K/V.
    joint_text:  the text's hidden states change from block to block (MM-DiT), so they travel
                 between stages with the first patch of each step; otherwise every stage takes the
                 projected text from ``step_inputs`` itself.
    carries:     a block's output feeds a later block besides the next (HunyuanDiT's long skips):
                 the kwargs ``run_block`` gets hold ``"carry"``, the patch's list of such tensors
                 [B, n, D] (this rank's tokens), which ``run_block`` pops and pushes; what is on it
                 at a stage's end travels to the next stage with the patch (``carried`` says how many).
    A patch enters a stage through the family's ``embed``/``embed_text`` (stage 0) or as the
    previous stage's activations, and leaves through ``head``/``unpatchify`` (last stage).
    """

    block_lists: tuple[str, ...]
    attention: tuple[tuple[str, type, bool], ...]
    joint_text: bool = False
    carries: bool = False

    def stale_modules(self, transformer) -> list[tuple[str, object, type, bool]]:
        """(name, module, processor class, sees text) of every attention module ``attention`` lists. It names a
        module by its attribute ("attn1") or by its path without block indices ("layers.attention": the main
        blocks' attention of Z-Image, not its refiners')."""
        listed = {name: (processor, sees_text) for name, processor, sees_text in self.attention}
        found = []
        for name, module in transformer.named_modules():
            path = ".".join(part for part in name.split(".") if not part.isdigit())  # "layers.attention"
            entry = listed.get(name.rsplit(".", 1)[-1], listed.get(path))
            if entry is not None:
                found.append((name, module, *entry))
        return found

    def buffers_per_block(self, transformer) -> int:
        """The most of those modules one block holds (SD3.5's dual-attention blocks: 2): the K/V buffers a block
        keeps under PipeFusion, for the memory model."""
        counts: dict[str, int] = {}
        for name, *_ in self.stale_modules(transformer):
            block = ".".join(name.split(".")[:2])  # "transformer_blocks.3"
            if block.split(".")[0] in self.block_lists:
                counts[block] = counts.get(block, 0) + 1
        return max(counts.values(), default=0)


@dataclass(frozen=True)
class CachePlan:
    """Which blocks the step cache (parallel/step_cache.py) runs as one span, and how it reads them.

    blocks:  the ModuleLists of the span, in execution order: the first block always runs, the rest are
             skipped on a reused step. The image stream keeps its shape from the first block's output
             to the last block's (Flux.2's span is its single-stream blocks: the streams join before them).
    returns: per ModuleList, the block's returned tensors named by the forward argument each one
             continues, in return order (one name: the block returns a bare tensor). A skipped block
             returns its inputs so.
    image:   the argument (and returned tensor) of the image stream whose residual is cached.
    probe:   teacache's indicator: the first block's timestep-modulation argument (its rows are the
             batch rows), whose relative change between steps the fitted polynomial rescales.
    teacache: that polynomial's coefficients, highest power first (numpy.polyval), fitted per family
             (docs/step-cache.md: the data and the fit).
    """

    blocks: tuple[str, ...]
    returns: dict[str, tuple[str, ...]]
    probe: str
    teacache: tuple[float, ...]
    image: str = "hidden_states"

