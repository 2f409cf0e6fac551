"""Sequence parallelism (USP: Ulysses × Ring) for joint text+image attention.

Image tokens are split across the ``ring × ulysses`` ranks; text tokens are replicated on every
rank. Attention of the local [text; image slice] queries is exact:

- image keys: Ulysses all-to-all (yunchang ``SeqAllToAll4D``) swaps the sequence split for a head
  split, then yunchang's ring passes K/V blocks around the ring, merging with our kernel's LSE;
- text keys: every rank has them, so each rank attends to them locally (for its heads);
- the two partial results are merged by their log-sum-exp, then Ulysses swaps back.

yunchang's ``LongContextAttention`` (0.6.4) takes no joint (text) tensors and reads its groups
from yunchang's module globals, so its two building blocks are composed here with our groups.
The model runs on its token slice unchanged; only each attention module's processor is replaced
(``attach``), and its output slice is gathered once per step (``TokenSlices.gather``).

Flux slices its own tokens and positions (models/flux.py). The other families are cut where
their spec's ``SequencePlan`` says, by forward hooks: after the patch embedding (absolute
position embeddings already added: SD3, PixArt) or before the first block with the 3-D RoPE
table cut alongside (Wan), and gathered after the output projection.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import attention
from ..models import flux


class JointUSPAttention:
    """Attention over [text (replicated) ; image (this rank's slice)] tokens, exact across ranks."""

    def __init__(self, ulysses_group, ring_group, kernel: attention.Kernel):
        self.ulysses_group = ulysses_group  # None when ulysses = 1
        self.ring_group = ring_group  # None when ring = 1
        self.kernel = kernel

    def __call__(self, q, k, v, text_tokens: int):
        """q, k, v: [B, L + N/P, H, D], the first ``text_tokens`` = L being text; returns the same shape."""
        from yunchang.comm.all_to_all import SeqAllToAll4D

        L = text_tokens
        tq, tk, tv = q[:, :L], k[:, :L], v[:, :L]  # [B, L, H, D]
        iq, ik, iv = q[:, L:], k[:, L:], v[:, L:]  # [B, N/P, H, D]
        ug = self.ulysses_group
        if ug is not None:
            # scatter heads (dim 2), gather sequence (dim 1): [B, N/P, H, D] → [B, N/R, H/U, D]
            iq, ik, iv = (SeqAllToAll4D.apply(ug, t.contiguous(), 2, 1, False) for t in (iq, ik, iv))
            heads = q.shape[2] // dist.get_world_size(ug)
            mine = slice(dist.get_rank(ug) * heads, (dist.get_rank(ug) + 1) * heads)
            tq, tk, tv = tq[:, :, mine], tk[:, :, mine], tv[:, :, mine]  # [B, L, H/U, D]

        queries = torch.cat([tq, iq], dim=1)  # [B, L + N/R, H/U, D]
        if self.ring_group is not None:
            from yunchang.ring import ring_flash_attn_func

            out, lse, _ = ring_flash_attn_func(queries, ik.contiguous(), iv.contiguous(), causal=False,
                                               return_attn_probs=True, group=self.ring_group,
                                               attn_type=None, attn_processor=self.kernel)
        else:
            out, lse = self.kernel(queries, ik, iv)  # [B, L + N/R, H/U, D], [B, H/U, L + N/R]
        if L:
            out_text_keys, lse_text_keys = self.kernel(queries, tk, tv)
            out, _ = attention.merge(out, lse, out_text_keys, lse_text_keys)
        out = out.to(q.dtype)

        text_out, image_out = out[:, :L], out[:, L:]
        if ug is not None:
            # scatter sequence (dim 1), gather heads (dim 2): [B, N/R, H/U, D] → [B, N/P, H, D]
            image_out = SeqAllToAll4D.apply(ug, image_out.contiguous(), 1, 2, False)
        if not L:
            return image_out  # [B, N/P, H, D]
        if ug is not None:
            parts = [torch.empty_like(text_out) for _ in range(dist.get_world_size(ug))]
            dist.all_gather(parts, text_out.contiguous(), group=ug)  # U × [B, L, H/U, D]
            text_out = torch.cat(parts, dim=2)  # [B, L, H, D]
        return torch.cat([text_out, image_out], dim=1)  # [B, L + N/P, H, D]


class FluxUSPProcessor:
    """A Flux attention processor whose attention is JointUSPAttention (set ``text_tokens`` per call)."""

    def __init__(self, usp: JointUSPAttention):
        self.usp = usp
        self.text_tokens = 0  # single-stream blocks see text and image as one sequence

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("sequence parallel Flux attention does not take an attention mask")
        # RoPE comes from this rank's token ids, so it matches its tokens. q, k, v: [B, S, H, D]
        query, key, value = flux.attention_inputs(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        text_tokens = encoder_hidden_states.shape[1] if encoder_hidden_states is not None else self.text_tokens
        out = self.usp(query, key, value, text_tokens).to(query.dtype)
        return flux.attention_outputs(attn, out, encoder_hidden_states)


class TokenSlices:
    """This rank's contiguous slice of the image tokens, and the gather that undoes the split."""

    def __init__(self, group, index: int, parts: int):
        self.group, self.index, self.parts = group, index, parts

    def split(self, tokens: torch.Tensor, dim: int) -> torch.Tensor:
        """[..., N, ...] → [..., N/P, ...] along ``dim``: the slice at this rank's sequence index."""
        return tokens.chunk(self.parts, dim=dim)[self.index]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[B, N/P, C] on every rank → [B, N, C] on every rank (slices in sequence-index order)."""
        parts = [torch.empty_like(local) for _ in range(self.parts)]
        dist.all_gather(parts, local.contiguous(), group=self.group)  # P × [B, N/P, C]
        return torch.cat(parts, dim=1)


class AttentionUSPProcessor:
    """A diffusers ``Attention`` processor (SD3, PixArt) whose attention is JointUSPAttention: the
    module's own tokens, plus the text's replicated tokens when it is given them (SD3's joint blocks)."""

    def __init__(self, usp: JointUSPAttention):
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("sequence parallel attention does not take an attention mask")
        residual = hidden_states

        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))  # [B, S, H·D] → [B, S, H, D]

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query, key = attn.norm_q(query), attn.norm_k(key)  # over D: the same in either layout
        text_tokens = 0
        if encoder_hidden_states is not None:  # joint: [text; image], the text first as JointUSPAttention wants it
            text = [heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            if attn.norm_added_q is not None:
                text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, (query, key, value)))
            text_tokens = encoder_hidden_states.shape[1]
        out = self.usp(query, key, value, text_tokens).flatten(2, 3).to(query.dtype)  # [B, L + N/P, H·D]
        text_out, image_out = out[:, :text_tokens], out[:, text_tokens:]
        image_out = attn.to_out[1](attn.to_out[0](image_out))
        if attn.residual_connection:
            image_out = image_out + residual
        image_out = image_out / attn.rescale_output_factor
        if encoder_hidden_states is None:
            return image_out
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return image_out, text_out


class WanUSPProcessor:
    """Wan's self-attention with JointUSPAttention; RoPE comes from this rank's slice of the table."""

    def __init__(self, usp: JointUSPAttention):
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("WanUSPProcessor is for Wan's self-attention only")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, N/P, H, D]
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out = self.usp(query, key, value, 0).flatten(2, 3).type_as(query)  # [B, N/P, H·D]
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, S, H, D], cos and sin [1, S, 1, D]."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)  # [B, S, H, D]


PROCESSORS = {"joint": AttentionUSPProcessor, "wan": WanUSPProcessor}


def attach(transformer, spec, layout, slices: TokenSlices, kernel: attention.Kernel) -> tuple[list, list]:
    """Make ``transformer`` sequence parallel for a request: returns the processors that need
    ``text_tokens`` set per call (Flux's single-stream blocks) and the hooks to remove.

    Undo with the hooks' ``remove()`` and ``transformer.set_attn_processor(saved)``,
    ``saved = transformer.attn_processors`` taken before.
    """
    usp = JointUSPAttention(layout.group("ulysses"), layout.group("ring"), kernel)
    plan = getattr(spec, "sequence_plan", None)
    if plan is None:  # Flux: the model wrapper slices tokens and positions itself
        from diffusers.models.transformers.transformer_flux import FluxAttention

        processors = []
        for module in transformer.modules():
            if isinstance(module, FluxAttention):
                processor = FluxUSPProcessor(usp)
                module.set_processor(processor)
                processors.append(processor)
        return processors, []
    modules = dict(transformer.named_modules())
    hooks = []
    for name, dim in plan.split_outputs:
        hooks.append(modules[name].register_forward_hook(
            lambda module, args, out, dim=dim: _split(slices, out, dim)))
    for name, dim in plan.split_inputs:
        hooks.append(modules[name].register_forward_pre_hook(
            lambda module, args, dim=dim: (slices.split(args[0], dim), *args[1:])))
    hooks.append(modules[plan.gather_output].register_forward_hook(
        lambda module, args, out: slices.gather(out)))  # [B, N/P, C] → [B, N, C]
    kinds = dict(plan.attention)
    for name, module in modules.items():
        kind = kinds.get(name.rsplit(".", 1)[-1])
        if kind is not None:
            module.set_processor(PROCESSORS[kind](usp))
    return [], hooks


def _split(slices: TokenSlices, out, dim: int):
    """This rank's slice of a module output, or of each tensor of a tuple output (RoPE's cos, sin)."""
    if isinstance(out, tuple):
        return tuple(slices.split(t, dim) for t in out)
    return slices.split(out, dim)
