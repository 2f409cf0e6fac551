"""Chroma (lodestones' Chroma1-HD and -Base): diffusers ``ChromaTransformer2DModel`` run the way ComfyUI runs its
Chroma (shared snapshot v0.3.64: comfy/ldm/chroma/model.py, comfy/model_base.py ``Chroma``,
comfy/supported_models.py ``Chroma``).

Flux.1-schnell's blocks without their modulation layers: one network, the ``distilled_guidance_layer`` (an
approximator: in_proj, residual MLPs under RMSNorm, out_proj), makes 344 modulation vectors from the time (16
sinusoid channels of 1000·σ), the guidance (16 more; ComfyUI puts 0 on the conditioning unless FluxGuidance sets
one) and each vector's index (32): single block j takes vectors 3j … 3j + 2 (shift, scale, gate), double block i
the image's 3S + 6i … and the text's 3S + 6D + 6i … (S single, D double blocks), the final layer the last two
(shift, scale). 344 is the released model's count (38 single, 19 double: 3·38 + 12·19 + 2); ComfyUI makes 344
whatever the blocks, and so does this wrapper (diffusers sizes them from the config, which agrees at the released
size only). T5-XXL text alone (no pooled vector); ComfyUI's PixArt tokenizer does not pad it: no attention mask.

The model runs from ChromaModel's own loop over diffusers' modules (ComfyUI's modulation count and final layer).
Sequence parallelism cuts the image tokens and their positions, and the text tokens and theirs, where they enter
the blocks (pass-through modules the sequence plan names), runs every block's attention through the
sequence-parallel kernel (diffusers' Flux attention modules: flux.FluxProcessor) and gathers after ``proj_out``.
PipeFusion runs the double then the single blocks with the text travelling with each step's first patch, as
Flux's; the step cache spans the single blocks (the streams join before them).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan
from .flux import FLUX_DEFAULT_SHIFT, FluxProcessor, image_ids, per_row
from .patch_embed import pack, unpack

MODULATIONS = 344  # ComfyUI's mod_index_length: the vectors the approximator makes, whatever the blocks
SINUSOID = 16  # channels of the time's and of the guidance's embedding (the index's: twice that)
DEFAULT_GUIDANCE = 0.0  # comfy/model_base.py Chroma.extra_conds: kwargs.get("guidance", 0)

# teacache: the polynomial that maps the relative change of the first single block's modulation between steps to the
# change of the model's output: fitted on chroma-tiny (random weights), tools/fit_teacache.py, data and fit in
# docs/step-cache.md. Refit on a trained file.
TEACACHE = (0.3656, 0.1631, 0.05667)


@dataclass(frozen=True)
class ChromaSpec(FamilySpec):
    """What a Chroma model takes and allows, read from its config."""

    context_dim: int  # T5-XXL's 4096
    heads: int
    blocks: int  # double-stream plus single-stream, as PipeFusion counts them

    family = "chroma"
    # comfy/ldm/chroma/model.py Chroma.forward(x, timestep, context, guidance, …)
    comfy_model_inputs = {"guidance": "guidance"}
    latent_format = latent_formats.FLUX  # supported_models.Chroma.latent_format = latent_formats.Flux
    default_guidance = DEFAULT_GUIDANCE
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    # the image's tokens and positions, the text's, as the blocks get them (ChromaModel.output)
    sequence_plan = SequencePlan(
        cuts=(Cut("image_tokens", None, 1), Cut("image_ids", None, 0),  # [B, N, D], [N, 3]
              Cut("text_tokens", None, 1, text=True), Cut("text_ids", None, 0, text=True)),  # [B, L, D], [L, 3]
        attention=(("attn", FluxProcessor),))
    stage_plan = StagePlan(block_lists=("transformer_blocks", "single_transformer_blocks"),
                           attention=(("attn", FluxProcessor, True),), joint_text=True)
    cache_plan = CachePlan(blocks=("single_transformer_blocks",),
                           returns={"single_transformer_blocks": ("hidden_states",)},
                           probe="temb", teacache=TEACACHE)

    @classmethod
    def from_config(cls, config) -> ChromaSpec:
        def get(key: str):
            return config.get(key) if isinstance(config, dict) else getattr(config, key)

        return cls(get("joint_attention_dim"), get("num_attention_heads"),
                   get("num_layers") + get("num_single_layers"))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """ComfyUI's ModelSamplingFlux (Chroma is a Flux model there; multiplier 1: timestep = σ)."""
        return FlowSampling(FLUX_DEFAULT_SHIFT if shift is None else shift, flux=True)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """T5-XXL's hidden states, as CLIPTextEncode with Chroma's CLIP gives them."""
        return {"context": (batch, text_tokens, self.context_dim)}


def build_transformer(**config):
    """diffusers' ChromaTransformer2DModel, without the FutureWarning diffusers 0.42 prints on every load (its class
    builds the FluxPosEmbed it deprecates: not ours to fix, and a user's console should not show it)."""
    from diffusers import ChromaTransformer2DModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ChromaTransformer2DModel(**config)


def sinusoid(values: torch.Tensor, channels: int) -> torch.Tensor:
    """ComfyUI's flux timestep_embedding: [cos, sin] of 1000·values at 10000^(−k/half), in float32: [len, channels]."""
    from diffusers.models.embeddings import get_timestep_embedding

    return get_timestep_embedding(values.float() * 1000, channels, flip_sin_to_cos=True, downscale_freq_shift=0)


class ChromaModel(DiffusionModel):
    """A loaded Chroma transformer (whole, or one PipeFusion stage of it)."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # where sequence parallelism cuts the blocks' inputs (output; the sequence plan)
        for name in ("image_tokens", "image_ids", "text_tokens", "text_ids"):
            setattr(transformer, name, torch.nn.Identity())
        # each block's list and index, taken before a PipeFusion stage drops the others (its modulation's place)
        self.places = {block: (name, index) for name in self.spec.stage_plan.block_lists
                       for index, block in enumerate(getattr(transformer, name))}
        self.counts = {name: len(getattr(transformer, name)) for name in self.spec.stage_plan.block_lists}

    def modulations(self, timestep: torch.Tensor, guidance) -> torch.Tensor:
        """The approximator's 344 modulation vectors [B, 344, D] for σ ``timestep`` [B] and ``guidance`` (one value
        or [B]), its input made as ComfyUI's forward_orig makes it (in float32, then the model's dtype)."""
        b = timestep.shape[0]
        time = sinusoid(timestep.to(self.device, torch.float32), SINUSOID)  # [B, 16]
        scale = sinusoid(per_row(guidance if guidance is not None else DEFAULT_GUIDANCE, b, self.device), SINUSOID)
        index = sinusoid(torch.arange(MODULATIONS, device=self.device), 2 * SINUSOID)  # [344, 32]
        vector = torch.cat([torch.cat([time, scale], dim=1)[:, None].expand(b, MODULATIONS, -1),
                            index[None].expand(b, -1, -1)], dim=-1)  # [B, 344, 64]
        return self.transformer.distilled_guidance_layer(vector.to(self.dtype))  # [B, 344, D]

    def _temb(self, mods: torch.Tensor, block) -> torch.Tensor:
        """A block's modulation vectors, as ComfyUI's get_modulations places them: a single block's 3 [B, 3, D], a
        double block's image 6 then text 6 [B, 12, D]."""
        name, index = self.places[block]
        singles = self.counts["single_transformer_blocks"]
        if name == "single_transformer_blocks":
            return mods[:, 3 * index:3 * index + 3]
        image = 3 * singles + 6 * index
        text = image + 6 * self.counts["transformer_blocks"]
        return torch.cat([mods[:, image:image + 6], mods[:, text:text + 6]], dim=1)

    def _final(self, image: torch.Tensor, mods: torch.Tensor) -> torch.Tensor:
        """ComfyUI's LastLayer: the last two vectors (shift, scale) on the normed tokens, then proj_out."""
        t = self.transformer
        return t.proj_out(t.norm_out(image, mods[:, -2:]))  # [B, n, 64]

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 16, h, w] at σ ``timestep`` [B], as ComfyUI's Chroma computes it."""
        t = self.transformer
        b, _, h, w = x.shape
        mods = self.modulations(timestep, guidance)  # [B, 344, D]
        context = cond["context"].to(self.device, self.dtype)  # [B, L, 4096]
        image = t.image_tokens(t.x_embedder(pack(x).to(self.device, self.dtype)))  # [B, N/P, D]
        text = t.text_tokens(t.context_embedder(context))  # [B, L/P, D]
        ids = torch.cat([t.text_ids(torch.zeros(context.shape[1], 3, device=self.device)),
                         t.image_ids(image_ids(h, w, self.device))])  # [L/P + N/P, 3]
        rope = t.pos_embed(ids)  # cos, sin: this rank's tokens' own positions
        for block in t.transformer_blocks:
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=self._temb(mods, block),
                                image_rotary_emb=rope)
        joint = torch.cat([text, image], dim=1)  # [B, (L + N)/P, D]
        for block in t.single_transformer_blocks:
            joint = block(hidden_states=joint, temb=self._temb(mods, block), image_rotary_emb=rope)
        return unpack(self._final(joint[:, text.shape[1]:], mods), h, w)  # gathered at proj_out under SP

    # PipeFusion stages (base.DiffusionModel): text travels with the step's first patch, as Flux's.

    def positions(self, shape):
        return image_ids(shape[-2], shape[-1], self.device)  # [N, 3]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        return {"mods": self.modulations(timestep, guidance), "context": cond["context"]}

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.x_embedder(pack(x).to(self.device, self.dtype))  # [B, n, 64] → [B, n, D]

    def embed_text(self, inputs):
        return self.transformer.context_embedder(inputs["context"].to(self.device, self.dtype))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        ids = torch.cat([positions.new_zeros(text_tokens, 3), positions[tokens]])  # [L + n, 3]
        return {"mods": inputs["mods"], "image_rotary_emb": self.transformer.pos_embed(ids)}

    def run_block(self, block, image, text, kwargs):
        temb, rope = self._temb(kwargs["mods"], block), kwargs["image_rotary_emb"]
        if self.places[block][0] == "transformer_blocks":
            text, image = block(hidden_states=image, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
            return image, text
        joint = block(hidden_states=torch.cat([text, image], dim=1), temb=temb, image_rotary_emb=rope)
        return joint[:, text.shape[1]:], joint[:, :text.shape[1]]

    def head(self, image, inputs, tokens):
        return self._final(image, inputs["mods"])  # [B, n, 64]

    def unpatchify(self, tokens, shape):
        return unpack(tokens, shape[-2], shape[-1])  # [B, n, 64] → [B, 16, rows, w]
