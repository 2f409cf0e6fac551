"""Wan 2.1 / 2.2 (text to video): diffusers ``WanTransformer3DModel`` fed as ComfyUI feeds Wan.

Video latents [B, C, T, h, w] in (1, 2, 2) patches; self-attention over frames × rows × columns
tokens with 3-D RoPE, cross-attention to the UMT5 text. Sequence parallelism cuts the tokens
before the first block and the RoPE table alongside them, and gathers after ``proj_out``;
cross-attention needs nothing (its keys are the whole text). Model sampling: discrete flow,
shift 8. Wan 2.2-A14B is two such models (high- and low-noise experts), run as two requests
over step ranges; Wan 2.2-TI2V-5B has a 48-channel latent from a 16× VAE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan

WAN_DEFAULT_SHIFT = 8.0  # ComfyUI's WAN21_T2V sampling_settings (WAN22_T2V inherits it)


class WanProcessor:
    """Wan's self-attention with a pluggable core ``core(q, k, v, text_tokens=0)`` on [B, N, H, D]; RoPE
    from the table the module is given (under sequence parallelism: this rank's share of it)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("WanProcessor is for Wan's self-attention only")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, N, H, D]
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        out = self.core(query, key, value, text_tokens=0).flatten(2, 3).type_as(query)  # [B, N, H·D]
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on interleaved pairs: x [B, S, H, D], cos and sin [1, S, 1, D]."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H, D/2] each
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2).type_as(x)  # [B, S, H, D]


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on wan-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.3263, 0.6525, -0.02391)


@dataclass(frozen=True)
class WanSpec(FamilySpec):
    context_dim: int  # UMT5 (4096)
    heads: int
    blocks: int
    channels: int  # 16 (Wan 2.1, Wan 2.2-A14B) or 48 (Wan 2.2-TI2V-5B)

    family = "wan"
    # comfy/ldm/wan/model.py WanModel.forward(x, timestep, context, clip_fea, time_dim_concat, …): text to video
    comfy_model_inputs = {}
    video = True
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(cuts=(Cut("rope", None, 1),  # (cos, sin) [1, N, 1, D] each
                                       Cut("blocks.0", 0, 1)),  # the patch tokens [B, N, D]
                                 attention=(("attn1", WanProcessor),))
    stage_plan = StagePlan(block_lists=("blocks",), attention=(("attn1", WanProcessor, False),))
    cache_plan = CachePlan(blocks=("blocks",),
                           returns={"blocks": ("hidden_states",)},
                           probe="temb", teacache=TEACACHE)

    @property
    def latent_format(self):
        return latent_formats.WAN22 if self.channels == 48 else latent_formats.WAN21

    @property
    def vae_factor(self) -> int:
        return 16 if self.channels == 48 else 8

    @classmethod
    def from_config(cls, config: dict) -> WanSpec:
        return cls(config["text_dim"], config["num_attention_heads"], config["num_layers"], config["in_channels"])

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(WAN_DEFAULT_SHIFT if shift is None else shift)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}


class WanModel(DiffusionModel):
    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, C, T, h, w] at timestep 1000·σ [B], float32 into the sinusoidal
        embedding as in ComfyUI (not rounded to the weights' dtype)."""
        return self.transformer(
            hidden_states=x,
            timestep=timestep.to(self.device, torch.float32),
            encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
            return_dict=False,
        )[0]

    # PipeFusion stages (base.DiffusionModel): a patch is the same band of rows in every frame, so
    # it is a [B, C, T, rows, w] slice of the latent and its tokens are frames × rows × columns.

    def positions(self, shape):
        """The 3-D RoPE (cos, sin) [1, N, 1, D] of the whole latent (the module reads only the shape)."""
        return self.transformer.rope(torch.empty(shape, device="meta"))

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        temb, projection, context, _ = self.transformer.condition_embedder(
            timestep.to(self.device, torch.float32), cond["context"].to(self.device, self.dtype), None,
            timestep_seq_len=None)
        # temb [B, D]; projection [B, 6·D] → [B, 6, D]; context [B, L, D]
        return {"temb": temb, "projection": projection.unflatten(1, (6, -1)), "context": context}

    def embed(self, x, tokens, inputs, positions):
        patches = self.transformer.patch_embedding(x)  # [B, D, T/pt, rows/ph, w/pw]
        return patches.flatten(2).transpose(1, 2).contiguous()  # [B, n, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        cos, sin = positions
        return {"encoder_hidden_states": inputs["context"], "temb": inputs["projection"],
                "rotary_emb": (cos[:, tokens], sin[:, tokens])}  # [1, n, 1, D] each

    def run_block(self, block, image, text, kwargs):
        return block(image, **kwargs), text

    def head(self, image, inputs):
        t = self.transformer
        shift, scale = (t.scale_shift_table + inputs["temb"].unsqueeze(1)).chunk(2, dim=1)  # [B, 1, D] each
        image = (t.norm_out(image.float()) * (1 + scale) + shift).type_as(image)
        return t.proj_out(image)  # [B, n, pt·ph·pw·C]

    def unpatchify(self, tokens, shape):
        """As diffusers' forward ends, for a band of rows in every frame."""
        pt, ph, pw = self.transformer.config.patch_size
        b, _, frames, rows, columns = shape
        patches = tokens.reshape(b, frames // pt, rows // ph, columns // pw, pt, ph, pw, -1)
        return patches.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # [B, C, T, rows, w]
