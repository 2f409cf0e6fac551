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
(``attach``), and its velocity slice is gathered once per step (``TokenSlices.gather``).
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


def attach(transformer, layout, kernel: attention.Kernel) -> list[FluxUSPProcessor]:
    """Give every attention module of a Flux transformer a USP processor; returns them (to set text_tokens).

    Undo with ``transformer.set_attn_processor(saved)``, ``saved = transformer.attn_processors`` taken before.
    """
    from diffusers.models.transformers.transformer_flux import FluxAttention

    usp = JointUSPAttention(layout.group("ulysses"), layout.group("ring"), kernel)
    processors = []
    for module in transformer.modules():
        if isinstance(module, FluxAttention):
            processor = FluxUSPProcessor(usp)
            module.set_processor(processor)
            processors.append(processor)
    return processors
