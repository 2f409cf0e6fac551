"""Sequence parallelism (USP: Ulysses × Ring), attached to a model from its family's SequencePlan.

Every rank of a ``ring × ulysses`` group holds 1/P of the sequence: of the image tokens and, for
a joint text+image (MM-DiT) model, of the text tokens too, so no rank carries the whole text
through every block. Attention over the local [text share; image share] tokens is exact:

- Ulysses all-to-all (yunchang ``SeqAllToAll4D``) swaps the sequence split for a head split;
- yunchang's ring passes K/V blocks around the ring, merging with our kernel's log-sum-exp;
- Ulysses swaps back. Attention is not causal, so the order in which the ranks' shares are laid
  side by side does not matter, as long as queries, keys and values agree (they come from the
  same all-to-all) and each token's position (RoPE, absolute embedding) is its own.

yunchang's ``LongContextAttention`` (0.6.4) reads its groups from yunchang's module globals, so
its two building blocks are composed here with our groups. The model runs unchanged on its share:
``attach`` cuts the tensors the plan names with forward hooks, gathers the output once per model
call, and gives each attention module the plan names a processor whose attention is USPAttention.
Everything is undone by ``Attached.detach``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import attention
from ..models import flux
from ..models.base import Cut, SequencePlan


class USPAttention:
    """Attention over this rank's share of one sequence, exact across the ring × ulysses ranks."""

    def __init__(self, ulysses_group, ring_group, kernel: attention.Kernel):
        from yunchang.comm.all_to_all import SeqAllToAll4D  # once per request, not per attention call
        from yunchang.ring import ring_flash_attn_func

        self.ulysses_group = ulysses_group  # None when ulysses = 1
        self.ring_group = ring_group  # None when ring = 1
        self.kernel = kernel
        self.all_to_all, self.ring_attention = SeqAllToAll4D.apply, ring_flash_attn_func

    def __call__(self, q, k, v, text_tokens: int = 0):
        """q, k, v: [B, S/P, H, D], this rank's share of the sequence; returns the same shape.
        ``text_tokens``: the share's leading text tokens (the processor-class interface passes it)."""
        ug = self.ulysses_group
        if ug is not None:
            # scatter heads (dim 2), gather sequence (dim 1): [B, S/P, H, D] → [B, S/R, H/U, D]
            q, k, v = (self.all_to_all(ug, t.contiguous(), 2, 1, False) for t in (q, k, v))
        if self.ring_group is not None:
            out, _, _ = self.ring_attention(q, k, v, causal=False, return_attn_probs=True, group=self.ring_group,
                                             attn_type=None, attn_processor=self.kernel)  # [B, S/R, H/U, D]
        else:
            out, _ = self.kernel(q, k, v)  # [B, S/R, H/U, D]
        out = out.to(q.dtype)
        if ug is not None:
            # scatter sequence (dim 1), gather heads (dim 2): [B, S/R, H/U, D] → [B, S/P, H, D]
            out = self.all_to_all(ug, out.contiguous(), 1, 2, False)
        return out


class FluxUSPProcessor:
    """A Flux attention processor (double- and single-stream blocks) whose attention is USPAttention."""

    def __init__(self, usp: USPAttention):
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if attention_mask is not None:
            raise NotImplementedError("sequence parallel Flux attention does not take an attention mask")
        # RoPE comes from this rank's token ids, so it matches its tokens. q, k, v: [B, S/P, H, D], text first
        query, key, value = flux.attention_inputs(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        out = self.usp(query, key, value).to(query.dtype)
        return flux.attention_outputs(attn, out, encoder_hidden_states)


class AttentionUSPProcessor:
    """A diffusers ``Attention`` processor (SD3, PixArt) whose attention is USPAttention: the module's
    own tokens, plus this rank's share of the text when it is given it (SD3's joint blocks)."""

    def __init__(self, usp: USPAttention):
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
        if encoder_hidden_states is not None:  # joint: [text share; image share]
            text = [heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            if attn.norm_added_q is not None:
                text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, (query, key, value)))
            text_tokens = encoder_hidden_states.shape[1]
        out = self.usp(query, key, value).flatten(2, 3).to(query.dtype)  # [B, (L + N)/P, H·D]
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
    """Wan's self-attention with USPAttention; RoPE comes from this rank's share of the table."""

    def __init__(self, usp: USPAttention):
        self.usp = usp

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("WanUSPProcessor is for Wan's self-attention only")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, N/P, H, D]
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out = self.usp(query, key, value).flatten(2, 3).type_as(query)  # [B, N/P, H·D]
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, S, H, D], cos and sin [1, S, 1, D]."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)  # [B, S, H, D]


PROCESSORS = {"flux": FluxUSPProcessor, "joint": AttentionUSPProcessor, "wan": WanUSPProcessor}


def processor_class(kind):
    """The processor class a plan's attention ``kind`` names: one of PROCESSORS by name, or a family's own
    class (its module defines it: ``Processor(core)``, whose attention is ``core(q, k, v, text_tokens=L)``
    on q, k, v [B, S, H, D] laid out [text (L tokens); image], returning [B, S, H, D])."""
    return PROCESSORS[kind] if isinstance(kind, str) else kind


class Shard:
    """This rank's contiguous share of a sequence, and the gather that undoes the cut."""

    def __init__(self, group, index: int, parts: int):
        self.group, self.index, self.parts = group, index, parts

    def cut(self, tensor: torch.Tensor, dim: int, what: str) -> torch.Tensor:
        """[..., S, ...] → [..., S/P, ...] along ``dim``: the share at this rank's sequence index."""
        if tensor.shape[dim] % self.parts:  # validation refuses such requests first (config.py)
            raise ValueError(f"{what}: {tensor.shape[dim]} tokens do not split into ring × ulysses = {self.parts} "
                             "equal shares")
        return tensor.chunk(self.parts, dim=dim)[self.index]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[B, N/P, C] on every rank → [B, N, C] on every rank (shares in sequence-index order)."""
        parts = [torch.empty_like(local) for _ in range(self.parts)]
        dist.all_gather(parts, local.contiguous(), group=self.group)  # P × [B, N/P, C]
        return torch.cat(parts, dim=1)


class Attached:
    """The hooks and processors a plan put on a transformer; ``detach`` restores it as it was."""

    def __init__(self, transformer, hooks: list):
        self.transformer, self.hooks = transformer, hooks
        self.saved = transformer.attn_processors  # taken before any processor is replaced

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.transformer.set_attn_processor(self.saved)


def attach(transformer, plan: SequencePlan, layout, kernel: attention.Kernel) -> Attached:
    """Make ``transformer`` sequence parallel under ``layout`` as ``plan`` says, until ``detach``."""
    shard = Shard(layout.sequence_group, layout.sequence_index, layout.config.sequence)
    modules = dict(transformer.named_modules())
    attached = Attached(transformer, [])
    for name in dict.fromkeys(cut.module for cut in plan.cuts):  # one hook per module, in plan order
        cuts = [cut for cut in plan.cuts if cut.module == name]
        inputs = [cut for cut in cuts if cut.arg is not None]
        outputs = [cut for cut in cuts if cut.arg is None]
        if inputs:
            attached.hooks.append(modules[name].register_forward_pre_hook(
                lambda module, args, kwargs, inputs=inputs: _cut_inputs(shard, inputs, args, kwargs), with_kwargs=True))
        for cut in outputs:
            attached.hooks.append(modules[name].register_forward_hook(
                lambda module, args, out, cut=cut: _cut_output(shard, cut, out)))
    attached.hooks.append(modules[plan.gather].register_forward_hook(
        lambda module, args, out: shard.gather(out)))  # [B, N/P, C] → [B, N, C]
    usp = USPAttention(layout.group("ulysses"), layout.group("ring"), kernel)
    kinds = dict(plan.attention)
    for name, module in modules.items():
        kind = kinds.get(name.rsplit(".", 1)[-1])
        if kind is not None:
            module.set_processor(processor_class(kind)(usp))
    return attached


def _cut_inputs(shard: Shard, cuts: list[Cut], args: tuple, kwargs: dict):
    """A module's inputs with the planned ones cut to this rank's share (by position or keyword)."""
    args = list(args)
    for cut in cuts:
        where = f"{cut.module or 'the transformer'}'s input {cut.arg!r}"
        if isinstance(cut.arg, int) and cut.arg < len(args):
            args[cut.arg] = shard.cut(args[cut.arg], cut.dim, where)
        elif isinstance(cut.arg, str) and kwargs.get(cut.arg) is not None:
            kwargs[cut.arg] = shard.cut(kwargs[cut.arg], cut.dim, where)
        else:
            raise RuntimeError(f"the sequence plan cuts {where}, but the forward call did not pass it "
                               f"(positional {len(args)}, keywords {sorted(kwargs)})")
    return tuple(args), kwargs


def _cut_output(shard: Shard, cut: Cut, out):
    """This rank's share of a module output, or of each tensor of a tuple output (RoPE's cos, sin)."""
    where = f"{cut.module}'s output"
    if isinstance(out, tuple):
        return tuple(shard.cut(t, cut.dim, where) for t in out)
    return shard.cut(out, cut.dim, where)
