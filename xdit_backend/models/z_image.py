"""Z-Image (Turbo, Base): diffusers ``ZImageTransformer2DModel`` fed the way ComfyUI feeds its
Lumina2/NextDiT model for Z-Image (comfy/ldm/lumina/model.py, comfy/supported_models.py ``ZImage``).

A single-stream DiT: the image tokens (2×2 patches, padded to a multiple of 32 with a learned
``x_pad_token``) pass through noise-refiner blocks, the Qwen3-4B caption tokens (padded to a
multiple of 32 with a learned ``cap_pad_token``) through context-refiner blocks, then both run as
one unified sequence through the main blocks, with 3-D RoPE over (caption index or image time,
row, column). The pad tokens are real tokens: neither ComfyUI nor diffusers masks them (a batch's
sequences all have the same length), so attention over the unified sequence is plain, unmasked.

The model runs from ZImageModel's own loop over diffusers' modules (``output``: the same modules and
arithmetic as diffusers' forward), so that a control network can run between its blocks. The main
blocks' sequence is two segments, each with its RoPE table: the image's real tokens, and the rest
(the image's pad tokens and the padded caption), laid out [rest; image]. Sequence parallelism cuts
both where they enter the main blocks (``image_tokens``, ``text_tokens``: pass-through modules),
each rank taking its share of each (a share padded where ring × ulysses does not divide a segment:
parallel/sequence.py leaves its padding out of attention), and gathers the image after the final
layer. A Fun ControlNet's tokens (one per real image token: z_image_controlnet.py) are cut as the
image's, so each rank controls its own tokens. Attention over the main sequence is plain and
unmasked, so the order of the tokens does not change it. The refiners run whole on every rank
(2 + 2 of Z-Image's 34 blocks, the noise refiner over the image tokens only).

PipeFusion runs the three block lists in order as one pipeline. The padded caption is the joint
text that travels with each step's first patch: the context refiners (caption alone) run on it
wherever they sit, the noise refiners run on the image patch alone (stale K/V over the image),
the main blocks on [caption; patch] (stale K/V over both: attention is unmasked, so the order of
the keys does not matter). Its rule: the image tokens are a multiple of 32, so the unified
sequence has no image pad tokens: those attend to the whole image in the noise refiner and would
be a second, image-dependent text that no stage has while the patches pass (stale_kv's buffers
hold one text per module, the same for every module that sees text).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats, z_image_controlnet
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan

# comfy/supported_models.py, class ZImage(Lumina2): sampling_settings {"multiplier": 1.0, "shift": 3.0}
# (ModelSamplingDiscreteFlow: timestep = σ); its latent_format is Lumina2's, latent_formats.Flux.
Z_IMAGE_DEFAULT_SHIFT = 3.0
Z_IMAGE_MULTIPLIER = 1.0
FINAL_LAYER = "all_final_layer.2-1"  # diffusers' name of the output layer for patch 2 × 2, 1 frame
REFINERS = ("noise_refiner", "context_refiner")  # blocks over the image alone and the caption alone, not cut
REFINER_MARK = "runs_whole"  # set on the refiners' attention modules by ZImageModel
SEQUENCE_MULTIPLE = 32  # diffusers' SEQ_MULTI_OF (ComfyUI's pad_tokens_multiple): image and caption padded to it


class ZImageAttention:
    """Z-Image's attention module (diffusers ``Attention`` run by ``ZSingleStreamAttnProcessor``)
    whose attention itself is ``core(q, k, v, text_tokens=0)`` on this rank's share of one sequence
    (USPAttention under sequence parallelism): the same projections, q/k RMS norms and RoPE. The
    refiners' attention modules have the same name but are not cut (their whole sequence is on every
    rank): they attend locally, as diffusers does."""

    runs_whole_refiners = True  # the refiners attend locally (sequence parallelism does not cut them)

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("Z-Image's parallel attention is self-attention over sequences of one length "
                                      "(no mask): a batch's captions all have the same length")
        query, key, value = (proj(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, S/P, H, D]
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if freqs_cis is not None:  # [B, S/P, D/2] complex: this rank's share of the table
            query, key = rotate(query, freqs_cis), rotate(key, freqs_cis)
        if self.runs_whole_refiners and getattr(attn, REFINER_MARK, False):  # a refiner: its whole sequence
            out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (query, key, value))).transpose(1, 2)
        else:
            out = self.core(query, key, value, text_tokens=0)  # [B, S/P, H, D]
        return attn.to_out[0](out.flatten(2, 3).to(query.dtype))  # [B, S/P, H·D] → [B, S/P, D]


class ZImagePatchAttention(ZImageAttention):
    """The noise refiners' attention under PipeFusion: the patch's image tokens attend through the
    core (stale K/V over the whole image), like the main blocks' without the caption."""

    runs_whole_refiners = False


def rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Z-Image's RoPE on interleaved pairs, in float32 as diffusers' processor (and ComfyUI's
    apply_rope) compute it: x [B, S, H, D], freqs_cis [B, S, D/2] complex."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))  # [B, S, H, D/2]
    return torch.view_as_real(pairs * freqs_cis.unsqueeze(2)).flatten(3).type_as(x)  # [B, S, H, D]


@contextmanager
def time_embedded_in(t_embedder, dtype: torch.dtype):
    """For one forward: the time embedding's sinusoid (float32) goes into its MLP in ``dtype``, the
    compute dtype, as ComfyUI's TimestepEmbedder does (``.to(dtype)``). diffusers casts it to the
    first Linear's weight dtype instead, which is float8 for an fp8 file (stored weights: storage.py)."""

    def embed(t):  # t [B] float32: 1000·(1 − σ)
        sinusoid = t_embedder.timestep_embedding(t, t_embedder.frequency_embedding_size)  # [B, 256] float32
        return t_embedder.mlp(sinusoid.to(dtype))  # [B, min(dim, 256)]

    t_embedder.forward = embed  # an instance attribute: shadows the class's forward, hooks still run
    try:
        yield
    finally:
        del t_embedder.forward


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on z-image-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (0.2067, -0.1538, 0.2343)


@dataclass(frozen=True)
class ZImageSpec(FamilySpec):
    """What a Z-Image model takes and allows, read from its config."""

    context_dim: int  # Qwen3-4B's hidden size (2560)
    heads: int
    blocks: int  # noise refiner + context refiner + main blocks, as the stage plan lists them
    layers: int  # main blocks: each takes the cut RoPE table

    family = "z_image"
    latent_format = latent_formats.FLUX  # comfy/supported_models.py: Lumina2.latent_format = latent_formats.Flux
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses", "pipefusion"})
    takes_controlnets = True  # alibaba-pai's Fun ControlNet (models/z_image_controlnet.py), run between the blocks
    # the context refiners' attention (caption alone, whole on the first stage that holds them) keeps diffusers'
    stage_plan = StagePlan(block_lists=("noise_refiner", "context_refiner", "layers"),
                           attention=(("noise_refiner.attention", ZImagePatchAttention, False),
                                      ("layers.attention", ZImageAttention, True)), joint_text=True)
    cache_plan = CachePlan(blocks=("layers",),
                           returns={"layers": ("x",)},
                           probe="adaln_input", teacache=TEACACHE, image="x")

    # the main blocks' two segments as they enter them (ZImageModel.output), each (tokens [B, S, D], RoPE [B, S, D/2])
    sequence_plan = SequencePlan(cuts=(Cut("image_tokens", None, 1), Cut("text_tokens", None, 1, text=True)),
                                 attention=(("attention", ZImageAttention),), gather=FINAL_LAYER)
    # a Fun ControlNet: its tokens cut as the image's real tokens after its refiner stage (the model's gives it the
    # image's tokens and positions already cut); its control layers attend through the same kernel
    control_plan = SequencePlan(cuts=(Cut("control_tokens", None, 1),), attention=(("attention", ZImageAttention),),
                                gather=None)

    @classmethod
    def from_config(cls, config) -> ZImageSpec:
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key)
        refiners = get("n_refiner_layers")
        return cls(get("cap_feat_dim"), get("n_heads"), 2 * refiners + get("n_layers"), get("n_layers"))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(Z_IMAGE_DEFAULT_SHIFT if shift is None else shift, multiplier=Z_IMAGE_MULTIPLIER)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        """Qwen3-4B's hidden states, as CLIPTextEncode with the qwen_3_4b CLIP gives them."""
        return {"context": (batch, text_tokens, self.context_dim)}


@functools.cache
def with_processor_access(cls: type) -> type:
    """``cls`` with diffusers' AttentionMixin (``attn_processors``, ``set_attn_processor``), which
    every other family's transformer has and ZImageTransformer2DModel (diffusers 0.42) lacks: the
    sequence-parallel and PipeFusion attach/detach read and restore processors through it."""
    from diffusers.models.attention import AttentionMixin

    return cls if issubclass(cls, AttentionMixin) else type(cls.__name__, (cls, AttentionMixin), {})


class ZImageModel(DiffusionModel):
    """A loaded Z-Image transformer."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        transformer.__class__ = with_processor_access(type(transformer))  # same object, same parameters
        # where sequence parallelism cuts the main blocks' two segments (output; the sequence plan)
        transformer.image_tokens, transformer.text_tokens = torch.nn.Identity(), torch.nn.Identity()
        for name in REFINERS:
            for block in getattr(transformer, name):
                setattr(block.attention, REFINER_MARK, True)
        # each block's list, taken before a PipeFusion stage drops the others (it decides what a block runs on)
        self.kinds = {block: name for name in self.spec.stage_plan.block_lists for block in getattr(transformer, name)}

    @property
    def width(self) -> int:
        return self.transformer.config.dim

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The model's output for x [B, 16, h, w] at timestep σ [B], as ComfyUI's NextDiT returns it: the
        transformer at time t = 1 − σ (its embedder multiplies by 1000, in float32), run block by block as
        diffusers' forward runs it (the module docstring says why here), and the result negated."""
        t = self.transformer
        b, _, h, w = x.shape
        inputs = self.step_inputs(x.shape, timestep, cond, guidance)
        adaln = inputs["adaln"]  # [B, 256]
        image = self.embed(x, None, inputs, None)  # [B, n, D]
        n = image.shape[1]
        pad = t.x_pad_token.to(image.dtype).expand(b, -n % SEQUENCE_MULTIPLE, -1)  # [B, pads, D]
        image = torch.cat([image, pad], dim=1)  # [B, N, D], N = n + pads
        freqs = inputs["image_freqs"].expand(b, -1, -1)  # [B, N, D/2] complex (the pads' at position 0)
        controls = [c for c in self.controlnets if c.active(float(timestep[0]))]  # Fun ControlNets, in order
        states = [c.network(c.hint.expand(b, -1, -1), freqs[:, :n], adaln) for c in controls]  # [B, n, D] each
        embedded = image[:, :n]  # what the control refiners take
        for index, block in enumerate(t.noise_refiner):
            image = block(image, None, freqs, adaln)  # [B, N, D]
            for at, control in enumerate(controls):  # ComfyUI's noise_refiner patches, in order
                residual, states[at] = control.network.refiner_step(index, states[at], embedded, freqs[:, :n], adaln)
                if residual is not None:
                    image = torch.cat([image[:, :n] + residual * control.strength, image[:, n:]], dim=1)
        text = self.embed_text(inputs)  # [B, L, D]
        for block in t.context_refiner:
            text = block(text, None, inputs["caption_freqs"].expand(b, -1, -1))  # [B, L, D]
        # the two segments: the image's real tokens, and the rest (its pads, the caption); each cut here under SP
        real, real_freqs = t.image_tokens((image[:, :n], freqs[:, :n]))  # [B, n/P, D], [B, n/P, D/2]
        rest, rest_freqs = t.text_tokens((torch.cat([image[:, n:], text], dim=1),
                                          torch.cat([freqs[:, n:], inputs["caption_freqs"].expand(b, -1, -1)], dim=1)))
        rest_tokens = rest.shape[1]
        states = [control.network.control_tokens(state) for control, state in zip(controls, states)]  # [B, n/P, D]
        unified, unified_freqs = torch.cat([rest, real], dim=1), torch.cat([rest_freqs, real_freqs], dim=1)
        for index, block in enumerate(t.layers):
            unified = block(unified, None, unified_freqs, adaln)  # [B, S/P, D]
            for at, control in enumerate(controls):  # ComfyUI's double_block patches, in order
                layer = control.network.layer_at(index)
                if layer is not None:
                    residual, states[at] = z_image_controlnet.step(control.network.control_layers[layer], states[at],
                                                                   real, real_freqs, adaln)  # [B, n/P, D] each
                    controlled = unified[:, rest_tokens:] + residual * control.strength  # [B, n/P, D]
                    unified = torch.cat([unified[:, :rest_tokens], controlled], dim=1)
        out = t.all_final_layer["2-1"](unified[:, rest_tokens:], c=adaln)  # [B, n, 2·2·16], gathered under SP
        return self.unpatchify(out, x.shape)  # [B, 16, h, w], negated

    # PipeFusion's stage methods (base.DiffusionModel): the unified sequence as [caption (joint text); image]

    def positions(self, shape):
        """None: the image's RoPE positions follow the caption's length (step_inputs makes them). Refuses
        a latent whose image tokens need pad tokens (the module docstring says why)."""
        h, w = shape[-2:]
        tokens = (h // 2) * (w // 2)
        if tokens % SEQUENCE_MULTIPLE:
            raise UserError(f"PipeFusion runs Z-Image only when its image tokens are a multiple of "
                            f"{SEQUENCE_MULTIPLE}; "
                            f"{w * 8} × {h * 8} px has {tokens} ({h // 2} × {w // 2}), padded with "
                            f"{-tokens % SEQUENCE_MULTIPLE} pad tokens that attend to the whole image",
                            "use a size whose (width / 16) × (height / 16) is a multiple of 32 (1024 × 1024, "
                            "1024 × 768, 1280 × 768, …), or ulysses / ring / cfg instead of pipefusion")
        return None

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time embedding, the padded captions and the RoPE tables (diffusers' own patchify of a
        latent of this shape gives the position ids: caption 1…L, image from L + 1)."""
        t = self.transformer
        h, w = shape[-2:]
        captions = list(cond["context"].to(self.device, self.dtype).unbind(0))  # B × [L, 2560]
        latent = torch.zeros(shape[1], 1, h, w, device=self.device, dtype=self.dtype)  # [16, 1, h, w]
        _, padded, _, (image_ids, *_), (caption_ids, *_), _, caption_pads = t.patchify_and_embed(
            [latent] * len(captions), captions, 2, 1)  # image_ids [N, 3] (no pad: positions), caption_ids [≥ L, 3]
        with time_embedded_in(t.t_embedder, self.dtype):
            adaln = t.t_embedder((1.0 - timestep.to(self.device, torch.float32)) * t.t_scale).to(self.dtype)  # [B, 256]
        return {"adaln": adaln, "captions": torch.stack(padded), "caption_pads": torch.stack(caption_pads),
                "caption_freqs": t.rope_embedder(caption_ids)[None, :len(padded[0])],  # [1, L, D/2] complex
                "image_freqs": t.rope_embedder(image_ids)}  # [N, D/2] complex

    def joint_text_tokens(self, cond) -> int:
        length = cond["context"].shape[1]
        return length + (-length) % SEQUENCE_MULTIPLE

    def embed(self, x, tokens, inputs, positions):
        """The patch [B, 16, rows, w] → its tokens [B, n, D], as diffusers' patchify (2 × 2, C last)."""
        b, c, rows, w = x.shape
        patches = x.reshape(b, c, rows // 2, 2, w // 2, 2).permute(0, 2, 4, 3, 5, 1)  # [B, rows/2, w/2, 2, 2, C]
        return self.transformer.all_x_embedder["2-1"](patches.reshape(b, -1, 4 * c).to(self.device, self.dtype))

    def embed_text(self, inputs):
        """The padded captions embedded, their pad tokens the learned ``cap_pad_token``: [B, L, D]."""
        t = self.transformer
        embedded = t.cap_embedder(inputs["captions"])  # [B, L, D]
        return torch.where(inputs["caption_pads"].unsqueeze(-1), t.cap_pad_token.to(embedded.dtype), embedded)

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        image = inputs["image_freqs"][tokens][None]  # [1, n, D/2] complex
        joint = torch.cat([inputs["caption_freqs"][:, :text_tokens], image], dim=1)  # [1, L + n, D/2]
        return {"adaln": inputs["adaln"], "image": image, "joint": joint, "caption": inputs["caption_freqs"]}

    def run_block(self, block, image, text, kwargs):
        """A noise refiner on the patch, a context refiner on the caption (when it travels with this
        patch), a main block on [caption; patch]."""
        kind, L = self.kinds[block], text.shape[1]
        if kind == "noise_refiner":
            return block(image, None, kwargs["image"], kwargs["adaln"]), text
        if kind == "context_refiner":
            return image, (block(text, None, kwargs["caption"]) if L else text)
        unified = block(torch.cat([text, image], dim=1), None, kwargs["joint"], kwargs["adaln"])  # [B, L + n, D]
        return unified[:, L:], unified[:, :L]

    def head(self, image, inputs, tokens):
        return self.transformer.all_final_layer["2-1"](image, c=inputs["adaln"])  # [B, n, 2·2·16]

    def unpatchify(self, tokens, shape):
        """[B, n, 2·2·C] of a band → the model's output [B, C, rows, w], negated as ComfyUI's NextDiT returns it."""
        b, c, rows, w = shape
        patches = tokens.reshape(b, rows // 2, w // 2, 2, 2, c)  # [B, rows/2, w/2, 2, 2, C]
        return -patches.permute(0, 5, 1, 3, 2, 4).reshape(b, c, rows, w)
