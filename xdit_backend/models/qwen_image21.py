"""Qwen-Image 2.1: diffusers ``QwenImage21Transformer2DModel`` run the way ComfyUI runs it (Comfy-Org/ComfyUI
comfy/ldm/qwen_image21/model.py 08f68f09 ``QwenImage21Transformer2DModel``; comfy/model_base.py 094c74c1
``QwenImage21``; comfy_extras/nodes_qwen.py ed26919d ``TextEncodeQwenImage21``).

One stream of single blocks over [prefix | target image]. The prefix is the text (Qwen3-VL's states through
``txt_in``) with, for an edit, each reference image spliced in at its place in the text (the text encoder's
``image_slots``). Attention is block-causal: a text token sees the tokens up to itself, an image (reference or target)
everything before it and its own block. The prefix is modulated at t = 0 (the shared modulation at [t; 0]: its last
row), so it depends on neither the latent nor the step: its keys and values in every block are computed once per
prompt (ComfyUI's prefix cache does the same) and each step runs the target's tokens alone, attending over [prefix;
image].

Sequence parallelism therefore cuts the target's tokens only (and their positions); the prefix's keys and values are
whole on every rank (``USPAttention``'s ``prefix``: each rank's Ulysses heads of them, joined to its own K/V block),
and the output is gathered after ``proj_out``. The latent is ComfyUI's [B, 64, H/16, W/16] (no patches: a token per
latent cell). PipeFusion carries the prefix as a joint text with each step's first chunk (the stage methods
below). The step cache is refused (it says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan, reference_rows, references

ROPE_THETA = 10000  # model.py's EmbedND
DEFAULT_SHIFT = 0.69  # supported_models.QwenImage21 sampling_settings (01f03bbd): ModelSamplingFlux, multiplier 1
PREFIX_CACHE = 2  # prompts whose prefix keys and values a generation keeps (its positive and negative)


def rope_angles(positions: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """Each token's rotation [S, D/2] (complex64) for its (frame, row, column) ``positions`` [S, 3]: per axis the
    position times 1/θ^(2k/d), in float64 as ComfyUI's flux rope computes it."""
    parts = []
    for axis, dim in enumerate(axes):
        omega = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [d/2]
        parts.append(positions[:, axis:axis + 1].double() * omega)  # [S, d/2]
    angle = torch.cat(parts, dim=1)
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


@dataclass
class Layout:
    """One call's sequence (model.py build_sequence): the text cut at each reference image's slot with the image put
    there, the target image last. ``positions`` (frame, row, column) [Lp + N, 3]: text token i at (p, p, p) for a
    running p, an image at frame p on a grid centred on the target's (half a token off where its parity differs),
    after which p moves on by its longer side; ``allowed`` [Lp, Lp]: which prefix keys each prefix token sees (the text
    causally, an image its own block, both all that comes before)."""

    positions: torch.Tensor
    allowed: torch.Tensor
    parts: list[tuple[str, int, int]]  # ("text", start, stop) of the text, ("reference", index, tokens)

    @property
    def prefix(self) -> int:
        return self.allowed.shape[0]

    @classmethod
    def of(cls, text: int, slots: list[int], references: list[tuple[int, int]], target: tuple[int, int]) -> Layout:
        bounds = [0, *slots, text]
        positions, parts, blocks = [], [], []  # blocks: (start, stop, causal) in the prefix
        p, length = 0.0, 0
        for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
            if stop > start:
                positions.append(torch.arange(p, p + stop - start, dtype=torch.float64)[:, None].expand(-1, 3))
                parts.append(("text", start, stop))
                blocks.append((length, length + stop - start, True))
                p, length = p + stop - start, length + stop - start
            h, w = references[index] if index < len(references) else target
            rows = torch.arange(h, dtype=torch.float64) - (h - h // 2) + 0.5 * (h % 2 - target[0] % 2)
            cols = torch.arange(w, dtype=torch.float64) - (w - w // 2) + 0.5 * (w % 2 - target[1] % 2)
            grid_r, grid_c = torch.meshgrid(rows, cols, indexing="ij")
            positions.append(torch.stack([torch.full_like(grid_r, p), grid_r, grid_c], dim=-1).reshape(-1, 3))
            if index < len(references):
                parts.append(("reference", index, h * w))
                blocks.append((length, length + h * w, False))
                length += h * w
            p += max(h, w)
        allowed = torch.zeros(length, length, dtype=torch.bool)
        for start, stop, causal in blocks:
            allowed[start:stop, :stop] = True
            if causal:
                allowed[start:stop, start:stop] = torch.ones(stop - start, stop - start, dtype=torch.bool).tril()
        return cls(torch.cat(positions), allowed, parts)


class PrefixCache:
    """One prompt's prefix: what it was made from (``key``: the call's conditioning tensors, the same objects at every
    step of a generation, compared by identity, so a lookup costs no device work; then the batch and target size),
    its layout, and its keys and values, one (k, v) [B, Lp, H, D] per block, filled by the prefix pass."""

    def __init__(self, key: tuple, layout: Layout):
        self.key, self.layout = key, layout
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []

    def made_from(self, key: tuple) -> bool:
        return len(key) == len(self.key) and all(
            a is b if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
            for a, b in zip(key, self.key))


class PrefixedAttention:
    """The blocks' attention (a diffusers processor for their ``attn`` modules). In the prefix pass (``layer_cache``
    the PrefixCache being filled) the prefix's tokens attend as its layout allows, whole on every rank, and their keys
    and values are kept; in a step (``layer_cache`` the block's kept pair) the image's tokens attend over [prefix;
    image] through ``core(q, k, v, prefix=(k, v))`` (USPAttention, PipeFusion's StaleKV, or one device's attention)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, rotary_emb=None, layer_cache=None, **unused):
        """``layer_cache``: the block's prefix (the diffusers block passes it through by that name)."""
        from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

        head_dim = attn.inner_dim // attn.heads
        q, k, v = (proj(hidden_states).unflatten(-1, (-1, head_dim)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q).to(v.dtype), attn.norm_k(k).to(v.dtype)  # [B, n, H, D] each
        q = apply_rotary_emb_qwen(q, rotary_emb, use_real=False)
        k = apply_rotary_emb_qwen(k, rotary_emb, use_real=False)
        if isinstance(layer_cache, PrefixCache):  # the prefix pass: block-causal, kept for the steps
            layer_cache.blocks.append((k, v))
            out = torch.nn.functional.scaled_dot_product_attention(  # allowed [Lp, Lp], on the device (_layout)
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=layer_cache.layout.allowed).transpose(1, 2)
        else:
            out = self.core(q, k, v, prefix=layer_cache)  # [B, n, H, D]
        out = out.flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out))


def local_attention(q, k, v, prefix=None):
    """One device's attention of q over [prefix; k, v] ([B, S, H, D] each)."""
    if prefix is not None:
        k, v = torch.cat([prefix[0], k], dim=1), torch.cat([prefix[1], v], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def build_transformer(fused_mlp: bool = True, **config):
    """diffusers' Qwen-Image 2.1 transformer (``fused_mlp`` says only how the file stores the feed-forward)."""
    from diffusers import QwenImage21Transformer2DModel

    return QwenImage21Transformer2DModel(**config)


@dataclass(frozen=True)
class QwenImage21Spec(FamilySpec):
    """What a Qwen-Image 2.1 model takes and allows, read from its config."""

    context_dim: int  # Qwen3-VL's 4096
    heads: int
    blocks: int

    family = "qwen_image21"
    latent_format = latent_formats.QWEN_IMAGE21
    vae_factor = 16
    patch = (1, 1, 1)  # a token per latent cell
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    # Text Encode Qwen Image 2.1's reference images (an edit): their latents (ComfyUI's reference_latents, in its raw
    # VAE space: the model applies process_in, as model_base.QwenImage does) and their places in the text
    takes_references: ClassVar[bool] = True
    optional_conditioning = ("image_slots",)
    comfy_conditioning: ClassVar[dict[str, str]] = {"image_slots": "image_slots"}
    step_cache_refusal: ClassVar[str] = "its blocks run from its own loop over the image's tokens, not cached yet"
    sequence_plan = SequencePlan(
        cuts=(Cut("image_tokens", None, 1), Cut("image_rope", None, 0)),  # [B, N, D], [N, D/2]
        attention=(("attn", PrefixedAttention),))
    # PipeFusion: the prefix travels as the joint text with each step's first chunk (the model's stage methods)
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=(("attn", PrefixedAttention, True),),
                           joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks",), returns={"transformer_blocks": ("hidden_states",)},
                           probe="modulation", teacache=(1.0, 0.0))  # refused (step_cache_refusal)

    @classmethod
    def from_config(cls, config) -> QwenImage21Spec:
        def get(key: str):
            return config.get(key) if isinstance(config, dict) else getattr(config, key)

        return cls(get("context_in_dim"), get("num_attention_heads"), get("num_layers"))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """ComfyUI's model sampling for Qwen-Image 2.1: ModelSamplingFlux at shift 0.69 (model_base 094c74c1:
        ModelType.FLUX), timestep = σ."""
        return FlowSampling(DEFAULT_SHIFT if shift is None else shift, flux=True)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """Qwen3-VL's hidden states as ComfyUI's Qwen-Image 2.1 text encoder gives them (no padding, the images'
        vision tokens taken out), and where each reference image goes in them (its ``image_slots``: a text index)."""
        return {"context": (batch, text_tokens, self.context_dim), "image_slots": (batch, None)}

    def drawn_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}

    def split_text_tokens(self, cond: dict) -> int:
        return 0  # the prefix is whole on every rank


class QwenImage21Model(DiffusionModel):
    """A loaded Qwen-Image 2.1 transformer."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # where sequence parallelism cuts the image's tokens and their rotations (the sequence plan)
        for name in ("image_tokens", "image_rope"):
            setattr(transformer, name, torch.nn.Identity())
        for block in transformer.transformer_blocks:
            block.attn.set_processor(PrefixedAttention(local_attention))  # sequence parallelism swaps the core
        self._generation = None  # the running generation: prefixes are kept within it only (a LoRA may change)
        self._prefixes: list[PrefixCache] = []

    def predict_x0(self, x, sigma, cond, gen):
        if gen is not self._generation:
            self._generation, self._prefixes = gen, []
        return super().predict_x0(x, sigma, cond, gen)

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 64, h, w] at σ = ``timestep`` [B], as ComfyUI's Qwen-Image 2.1 computes it."""
        t = self.transformer
        b, channels, h, w = x.shape
        temb = self._time_embedding(timestep)  # [B + 1, D]: [t; 0]
        modulation = t.modulation(temb)  # [B + 1, 4·D]: scale1, gate1, scale2, gate2 of each row
        prefix = self._prefix(cond, b, (h, w), modulation[-1:].expand(b, -1))
        tokens = x.flatten(2).transpose(1, 2).to(self.device, self.dtype)  # [B, N, 64]
        image = t.image_tokens(t.img_in(tokens))  # [B, n, D]: this rank's tokens
        target = prefix.layout.positions[prefix.layout.prefix:]  # [N, 3]
        rope = t.image_rope(rope_angles(target, self._axes).to(self.device))  # [n, D/2]
        for block, kept in zip(t.transformer_blocks, prefix.blocks):
            image = block(hidden_states=image, modulation=modulation[:-1], rotary_emb=rope, layer_cache=kept)
        out = t.proj_out(t.norm_out(image, temb[:-1]))  # [B, N, 64]: gathered under sequence parallelism
        return out.transpose(1, 2).reshape(b, channels, h, w)

    def _time_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """[B + 1, D]: σ = ``timestep`` [B] rounded as model.py rounds it, then a t = 0 row (the prefix's), embedded
        in the compute dtype."""
        sigma = ((timestep.to(self.device) * 1000).to(self.dtype) / 1000).to(self.dtype)
        return self.transformer.time_text_embed(torch.cat([sigma, sigma.new_zeros(1)]), sigma.new_empty(0))

    @property
    def _axes(self) -> tuple[int, ...]:
        return tuple(self.transformer.config.axes_dims_rope)

    def _prefix(self, cond: dict, batch: int, target: tuple[int, int], zero_modulation: torch.Tensor) -> PrefixCache:
        """The prompt's prefix (its text, and its reference images at their slots) through every block at t = 0,
        whole on every rank: its keys and values, computed once per prompt, references and target size in a
        generation (the references' positions are centred on the target's)."""
        context = cond["context"]
        key = (context, cond.get("image_slots"), *references(cond), batch, target)
        for kept in self._prefixes:
            if kept.made_from(key):
                return kept
        if not torch.isfinite(context).all():
            raise UserError("the prompt's conditioning holds NaN or infinite values",
                            "re-encode the prompt with the Qwen-Image 2.1 text encoder (Text Encode Qwen Image 2.1)")
        t = self.transformer
        refs, layout = self._layout(cond, batch, target)
        hidden = self._prefix_tokens(context, refs, layout)  # [B, Lp, D]
        rope = rope_angles(layout.positions[:layout.prefix], self._axes).to(self.device)  # [Lp, D/2]
        kept = PrefixCache(key, layout)
        for block in t.transformer_blocks:
            hidden = block(hidden_states=hidden, modulation=zero_modulation, rotary_emb=rope, layer_cache=kept)
        self._prefixes = [kept, *self._prefixes][:PREFIX_CACHE]
        return kept

    def _prefix_tokens(self, context: torch.Tensor, refs: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        """The prefix's input [B, Lp, D]: the text's pieces (Qwen3-VL's states through ``txt_in``) and the references
        (in model space, through ``img_in``) in the layout's order."""
        t = self.transformer
        text = t.txt_in(context.to(self.device, self.dtype))  # [B, L, D]
        return torch.cat([text[:, start:stop] if kind == "text" else
                          t.img_in(self.latent_format.process_in(refs[start].to(self.device, torch.float32))
                                   .flatten(2).transpose(1, 2).to(self.dtype))  # [B, h'·w', D]
                          for kind, start, stop in layout.parts], dim=1)

    def _layout(self, cond: dict, batch: int, target: tuple[int, int]) -> tuple[list[torch.Tensor], Layout]:
        """The call's reference latents [B, 64, h', w'] each, and its sequence's layout (its mask on the device)."""
        text = cond["context"].shape[1]
        refs = [reference_rows(latent, batch, i) for i, latent in enumerate(references(cond))]
        layout = Layout.of(text, self._slots(cond.get("image_slots"), text, len(refs)),
                           [tuple(r.shape[-2:]) for r in refs], target)
        layout.allowed = layout.allowed.to(self.device)  # once: every block's prefix pass reads it
        return refs, layout

    @staticmethod
    def _slots(slots: torch.Tensor | None, text: int, count: int) -> list[int]:
        """Each reference's place in the text (the text encoder's image_slots; one missing: the text's end)."""
        given = [] if slots is None else slots[0].round().long().tolist()
        if slots is not None and (bool((slots != slots[:1]).any()) or any(not 0 <= s <= text for s in given)
                                  or given != sorted(given)):
            raise UserError(f"image_slots {given} are not ascending places in a text of {text} tokens (or differ "
                            "between the rows)", "encode the prompt and its images with Text Encode Qwen Image 2.1")
        return (given + [text] * count)[:count]

    # PipeFusion's stage methods (base.DiffusionModel): the prefix (text and references) is the joint text, travelling
    # with each step's first chunk through every stage's blocks (computed again each step: it is the same every step);
    # each chunk of the target attends over [prefix; every patch, stale or fresh] (stale_kv.StaleKV's prefix)

    def positions(self, shape):
        return None  # the target's positions follow the prefix's layout (step_inputs)

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time embedding and shared modulation ([t; 0]), the sequence's layout and every token's rotation."""
        t = self.transformer
        temb = self._time_embedding(timestep)  # [B + 1, D]: [t; 0]
        context = cond["context"]
        refs, layout = self._layout(cond, context.shape[0], tuple(shape[-2:]))
        return {"temb": temb, "modulation": t.modulation(temb), "layout": layout, "context": context, "refs": refs,
                "rope": rope_angles(layout.positions, self._axes).to(self.device)}  # [Lp + N, D/2]

    def joint_text_tokens(self, cond) -> int:
        return cond["context"].shape[1] + sum(r.shape[-2] * r.shape[-1] for r in references(cond))

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.img_in(x.flatten(2).transpose(1, 2).to(self.device, self.dtype))  # [B, n, D]

    def embed_text(self, inputs):
        return self._prefix_tokens(inputs["context"], inputs["refs"], inputs["layout"])  # [B, Lp, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        prefix = inputs["layout"].prefix
        return {"modulation": inputs["modulation"], "layout": inputs["layout"], "prefix_rope": inputs["rope"][:prefix],
                "image_rope": inputs["rope"][prefix:][tokens]}  # [Lp, D/2], [n, D/2]

    def run_block(self, block, image, text, kwargs):
        """The prefix through the block when it travels with this chunk (its keys and values then join the chunk's),
        then the chunk's tokens."""
        modulation, kept = kwargs["modulation"], None
        if text.shape[1]:
            pass_ = PrefixCache((), kwargs["layout"])
            text = block(hidden_states=text, modulation=modulation[-1:].expand(text.shape[0], -1),
                         rotary_emb=kwargs["prefix_rope"], layer_cache=pass_)
            kept = pass_.blocks[0]
        image = block(hidden_states=image, modulation=modulation[:-1], rotary_emb=kwargs["image_rope"],
                      layer_cache=kept)
        return image, text

    def head(self, image, inputs, tokens):
        t = self.transformer
        return t.proj_out(t.norm_out(image, inputs["temb"][:-1]))  # [B, n, 64]

    def unpatchify(self, tokens, shape):
        return tokens.transpose(1, 2).reshape(shape)  # [B, n, 64] → [B, 64, rows, w]
