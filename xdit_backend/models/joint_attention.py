"""The attention processor of diffusers' plain ``Attention`` modules (SD3, PixArt) with a pluggable core.

Not one family's: SD3's joint blocks and PixArt's self-attention are the same diffusers module, so
their plans name this one class. The projections, QK norms and output layers are the module's own;
the attention itself is ``core(q, k, v, text_tokens=L)`` (USPAttention, or PipeFusion's StaleKV).
"""

from __future__ import annotations

import torch


class JointAttentionProcessor:
    """A diffusers ``Attention`` processor: the module's own tokens, plus the text when it is given it
    (SD3's joint blocks: [text; image], the text first)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        if attention_mask is not None:
            raise NotImplementedError("parallel attention does not take an attention mask")
        residual = hidden_states

        def heads(t):
            return t.unflatten(-1, (attn.heads, -1))  # [B, S, H·D] → [B, S, H, D]

        query, key, value = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            query, key = attn.norm_q(query), attn.norm_k(key)  # over D: the same in either layout
        text_tokens = 0
        if encoder_hidden_states is not None:  # joint: [text; image]
            text = [heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            if attn.norm_added_q is not None:
                text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, (query, key, value)))
            text_tokens = encoder_hidden_states.shape[1]
        out = self.core(query, key, value, text_tokens=text_tokens).flatten(2, 3).to(query.dtype)  # [B, L + N, H·D]
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
