"""CogVideoX (2B, 5B, 1.5-5B; text to video, and 1.5-5B-I2V): diffusers ``CogVideoXTransformer3DModel``.

Fed as ComfyUI's current source feeds its own CogVideoX (newer than the 0.3.64 snapshot; constants
cited where they are defined), with the positions diffusers' pipeline computes:

- Latents [B, 16, T, h, w] (ComfyUI's video layout; the transformer takes [B, T, C, h, w]), from a
  VAE with 8× space and 4× time compression. The model space is the raw VAE latent times the
  VAE's scaling factor: 1.15258426, or 0.7 from 48 heads up (5B, 1.5-5B) (Comfy-Org/ComfyUI
  comfy/latent_formats.py CogVideoX, CogVideoX1_5; THUDM's sat/configs ``scale_factor`` agree).
- Model sampling: ComfyUI's for CogVideoX (comfy/supported_models.py CogVideoX_T2V, comfy/model_base.py
  CogVideoX): V_PREDICTION_DDPM over 1000 discrete "linear" betas 0.00085 … 0.012 with zero terminal
  SNR, no SNR shift: sampling/v_prediction.py. The timestep is the discrete index, as ComfyUI's
  discrete sampling gives.
- Text: T5-XXL hidden states [B, L, 4096]. Text and video tokens attend jointly in every block;
  the text carries no position. 2B adds fixed 3-D sin-cos position embeddings to the video tokens
  in its patch embedding (a table of exactly ``max_text_seq_length`` = 226 text slots, so its text
  is that long); 5B and 1.5 rotate the video's queries and keys with a 3-D RoPE, which diffusers'
  pipeline computes outside the transformer: here the ``rope`` child module (``CogVideoXRope``).
- 1.5 patches time too (patch_size_t = 2): its latent frames must be even.
- Image to video (CogVideoX1.5-5B-I2V: 32 input channels), as Comfy-Org/ComfyUI comfy/model_base.py
  ``CogVideoX.concat_cond`` and ``extra_conds`` (094c74c) read it: ``concat_latent_image`` (the start image's
  latent, raw) resized to the latent, its frames padded with zeros or cut to the latent's, shifted into model
  space per 16 channels and repeated to fill the extra channels; the ofs embedding at ofs = 2.0 (ComfyUI's
  default, the diffusers pipeline's value) added to the time embedding. The channels travel with their tokens.

Sequence parallelism cuts the video and text tokens where they enter the first block (after the
patch embedding has added 2B's positions) and the RoPE table where it is made, and gathers after
``proj_out``. ``CogVideoXProcessor`` is the joint attention with a pluggable core.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..sampling.v_prediction import ZeroSNRVSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan

BETAS = (0.00085, 0.012)  # linear_start, linear_end (Comfy-Org/ComfyUI comfy/supported_models.py CogVideoX_T2V)
FIVE_B_HEADS = 48  # ComfyUI picks the 5B-class latent format (0.7) from 48 heads up (CogVideoX_T2V.__init__)


class CogVideoXProcessor:
    """CogVideoX's joint attention over [text; video] whose attention itself is ``core(q, k, v,
    text_tokens=L)`` (USPAttention, StaleKV): the same projections, per-head LayerNorm and RoPE on the
    video part as diffusers' CogVideoXAttnProcessor2_0."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if attention_mask is not None:
            raise NotImplementedError("CogVideoXProcessor does not take an attention mask")
        text_tokens = encoder_hidden_states.shape[1]
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # [B, L + n, D]
        query, key, value = (proj(joint).unflatten(-1, (attn.heads, -1))  # [B, L + n, H, Dh]
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)  # LayerNorm over Dh: the same in either layout
        if image_rotary_emb is not None:  # (cos, sin) [n, Dh] each, this share's video tokens
            query = torch.cat([query[:, :text_tokens],
                               apply_rotary_emb(query[:, text_tokens:], image_rotary_emb, sequence_dim=1)], dim=1)
            key = torch.cat([key[:, :text_tokens],
                             apply_rotary_emb(key[:, text_tokens:], image_rotary_emb, sequence_dim=1)], dim=1)
        out = self.core(query, key, value, text_tokens=text_tokens).flatten(2, 3).to(query.dtype)  # [B, L + n, H·Dh]
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text_tokens:], out[:, :text_tokens]  # video, text


class CogVideoXRope(nn.Module):
    """The 3-D RoPE (cos, sin) [N, head_dim] each of a latent's video tokens, as diffusers' CogVideoX
    pipeline computes it (``_prepare_rotary_positional_embeddings``): 1.0 crops a grid resized to the
    training size, 1.5 slices a table of the training size. A parameterless child of the transformer,
    so the sequence plan can cut its output."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = config.attention_head_dim
        self.patch, self.patch_t = config.patch_size, config.patch_size_t
        self.base = (config.sample_height // config.patch_size, config.sample_width // config.patch_size)

    def forward(self, frames: int, height: int, width: int, device: torch.device):
        """frames, height, width: the latent's; the tokens are (frames / patch_t) × rows × columns."""
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        rows, columns = height // self.patch, width // self.patch
        if self.patch_t is None:
            crop = resize_crop_region((rows, columns), *self.base)
            return get_3d_rotary_pos_embed(self.head_dim, crop, (rows, columns), frames, device=device)
        # 1.5's "slice" table: integer positions 0 … max − 1 per axis, cut to the grid; a grid beyond the training
        # size (sample_height / width) takes the positions past it, the rows within it unchanged
        table = (max(self.base[0], rows), max(self.base[1], columns))
        return get_3d_rotary_pos_embed(self.head_dim, None, (rows, columns), frames // self.patch_t,
                                       grid_type="slice", max_size=table, device=device)


def resize_crop_region(grid: tuple[int, int], base_height: int, base_width: int):
    """Where a grid of (rows, columns) sits when resized to fit (base_height, base_width), centred:
    ((top, left), (bottom, right)) in the base grid's coordinates (diffusers' CogVideoX pipeline's
    crop for its RoPE)."""
    rows, columns = grid
    if rows / columns > base_height / base_width:
        height, width = base_height, int(round(base_height / rows * columns))
    else:
        height, width = int(round(base_width / columns * rows)), base_width
    top, left = int(round((base_height - height) / 2.0)), int(round((base_width - width) / 2.0))
    return (top, left), (top + height, left + width)


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on cogvideox-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.0131, 0.06364, 0.01255)


@dataclass(frozen=True)
class CogVideoXSpec(FamilySpec):
    context_dim: int  # T5-XXL (4096)
    heads: int
    blocks: int
    rotary: bool  # 5B and 1.5: 3-D RoPE; 2B: sin-cos position embeddings
    patch_t: int  # 1 (1.0) or 2 (1.5)
    text_slots: int  # max_text_seq_length: 2B's text must be this long (its position table's text part)
    in_channels: int = 16  # 32: image to video (1.5-I2V), the start image's latent concatenated
    ofs: bool = False  # 1.5-I2V's ofs embedding

    family = "cogvideox"
    # the start image's latent (model_base.CogVideoX.concat_cond); a text-to-video file takes none of it, as ComfyUI's
    comfy_conditioning = {"concat_latent_image": "concat_latent_image"}
    video = True
    takes_shift = False  # discrete noise levels: no flow shift
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=(("attn1", CogVideoXProcessor, True),),
                           joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("hidden_states", "encoder_hidden_states")},
                           probe="temb", teacache=TEACACHE)

    @property
    def sequence_plan(self) -> SequencePlan:
        tokens = (Cut("transformer_blocks.0", "hidden_states", 1),  # [B, N, D], 2B's positions added
                  Cut("transformer_blocks.0", "encoder_hidden_states", 1, text=True))  # [B, L, D]
        rope = (Cut("rope", None, 0),) if self.rotary else ()  # (cos, sin) [N, Dh] each
        return SequencePlan(cuts=rope + tokens, attention=(("attn1", CogVideoXProcessor),))

    @property
    def latent_format(self):
        return latent_formats.COGVIDEOX_5B if self.heads >= FIVE_B_HEADS else latent_formats.COGVIDEOX_2B

    @property
    def patch(self) -> tuple[int, int, int]:
        return (self.patch_t, 2, 2)

    @classmethod
    def from_config(cls, config: dict) -> CogVideoXSpec:
        return cls(config.get("text_embed_dim", 4096), config["num_attention_heads"], config["num_layers"],
                   bool(config.get("use_rotary_positional_embeddings")), config.get("patch_size_t") or 1,
                   config.get("max_text_seq_length", 226), config.get("in_channels", 16),
                   bool(config.get("ofs_embed_dim")))

    @property
    def concat_channels(self) -> int:
        return self.in_channels - self.latent_format.channels

    @property
    def optional_conditioning(self) -> tuple[str, ...]:
        return ("concat_latent_image",) if self.concat_channels else ()


    def model_sampling(self, shift: float | None) -> ZeroSNRVSampling:
        return ZeroSNRVSampling(*BETAS)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        """5B and 1.5 take any text length; 2B exactly its ``text_slots``; 1.5-I2V its start image's latent."""
        shapes = {"context": (batch, text_tokens if self.rotary else self.text_slots, self.context_dim)}
        if self.concat_channels:
            # [B, 16, T', h', w']: the start image's latent, raw
            shapes["concat_latent_image"] = (batch, self.latent_format.channels, None, None, None)
        return shapes

    def check_size(self, width: int, height: int, frames: int) -> None:
        super().check_size(width, height, frames)
        latent = self.latent_frames(frames)
        if latent % self.patch_t:
            nearest = [n for n in (frames - self.time_factor, frames + self.time_factor) if n >= 1]
            raise UserError(f"frames {frames} make {latent} latent frames, which CogVideoX 1.5's temporal "
                            f"patches of {self.patch_t} do not divide",
                            f"use frames {' or '.join(map(str, nearest))}")


class CogVideoXModel(DiffusionModel):
    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        if transformer.config.use_rotary_positional_embeddings:
            transformer.rope = CogVideoXRope(transformer.config)

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """v for x [B, C, T, h, w] at the discrete timestep [B] (float32 into the sinusoidal embedding)."""
        video = self.with_concat(x, cond).permute(0, 2, 1, 3, 4)  # [B, T, C (+ 16), h, w], the transformer's layout
        out = self.transformer(
            hidden_states=video,
            encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
            timestep=timestep.to(self.device, torch.float32),
            ofs=self._ofs(x.shape[0]),
            image_rotary_emb=self.positions(x.shape) if self.spec.rotary else None,
            return_dict=False,
        )[0]  # [B, T, C, h, w]
        return out.permute(0, 2, 1, 3, 4)

    def _ofs(self, batch: int) -> torch.Tensor | None:
        """1.5-I2V's ofs [B] at ComfyUI's default, 2.0 (model_base.CogVideoX.extra_conds); None without the
        embedding."""
        return torch.full((batch,), 2.0, device=self.device) if self.spec.ofs else None

    def concat(self, shape, cond) -> torch.Tensor | None:
        """ComfyUI's CogVideoX.concat_cond for a latent of ``shape`` [B, 16, T, h, w]: the start image's latent resized,
        its frames padded with zeros or cut to T, in model space per 16 channels, repeated (or cut) to the extra
        channels; zeros without one."""
        extra = self.spec.concat_channels
        if not extra:
            return None
        b, _, frames, h, w = shape
        image = cond.get("concat_latent_image")
        if image is None:
            return torch.zeros(b, extra, frames, h, w, device=self.device)
        image = self.image_in(image, h, w)  # [B, 16·k, T', h, w]: zeros stay zeros (a scale, no shift)
        image = F.pad(image, (0, 0, 0, 0, 0, max(0, frames - image.shape[2])))[:, :, :frames]  # [B, 16·k, T, h, w]
        repeats = -(-extra // image.shape[1])
        return image.repeat(1, repeats, 1, 1, 1)[:, :extra]  # [B, extra, T, h, w]

    # PipeFusion stages (base.DiffusionModel): text travels with the step's first patch; a patch is
    # the same band of token rows in every (temporal patch of) frame.

    def positions(self, shape):
        """The whole latent's positions: RoPE (cos, sin) [N, Dh] each, or 2B's sin-cos table [N, D]."""
        frames, height, width = shape[2], shape[-2], shape[-1]
        if self.spec.rotary:
            return self.transformer.rope(frames, height, width, self.device)
        embed = self.transformer.patch_embed
        pixel_frames = (frames - 1) * embed.temporal_compression_ratio + 1
        table = embed._get_positional_embeddings(height, width, pixel_frames, device=self.device)
        return table[0, embed.max_text_seq_length:]  # [N, D]: the text slots' rows are zeros

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        t = self.transformer
        frequencies = t.time_proj(timestep.to(self.device, torch.float32))  # [B, D] float32
        temb = t.time_embedding(frequencies.to(self.dtype))  # [B, E]
        ofs = self._ofs(timestep.shape[0])
        if ofs is not None:  # 1.5-I2V: as diffusers' forward adds it
            temb = temb + t.ofs_embedding(t.ofs_proj(ofs).to(self.dtype))
        return {"temb": temb, "context": cond["context"]}

    def embed(self, x, tokens, inputs, positions):
        image = patch_tokens(self.transformer.patch_embed, x.permute(0, 2, 1, 3, 4))  # [B, n, D]
        return image if self.spec.rotary else image + positions[tokens].to(image.dtype)

    def embed_text(self, inputs):
        return self.transformer.patch_embed.text_proj(inputs["context"].to(self.device, self.dtype))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        rope = (positions[0][tokens], positions[1][tokens]) if self.spec.rotary else None  # [n, Dh] each
        return {"temb": inputs["temb"], "image_rotary_emb": rope}

    def run_block(self, block, image, text, kwargs):
        return block(hidden_states=image, encoder_hidden_states=text, **kwargs)  # (video, text)

    def head(self, image, inputs, tokens):
        t = self.transformer
        return t.proj_out(t.norm_out(t.norm_final(image), temb=inputs["temb"]))  # [B, n, patch values]

    def unpatchify(self, tokens, shape):
        """[B, n, pt·p·p·C] of a band → [B, C, T, rows, w], as diffusers' forward ends."""
        b, _, frames, rows, columns = shape
        p, pt = self.transformer.config.patch_size, self.spec.patch_t
        cells = tokens.reshape(b, frames // pt, rows // p, columns // p, -1, pt, p, p)  # [B, T', r, c, C, pt, p, p]
        video = cells.permute(0, 1, 5, 4, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(1, 2)  # [B, T, C, rows, w]
        return video.permute(0, 2, 1, 3, 4)


def patch_tokens(embed, video: torch.Tensor) -> torch.Tensor:
    """The video tokens [B, N, D] (frames × rows × columns) of video [B, T, C, h, w], before
    positions: the image half of diffusers' CogVideoXPatchEmbed."""
    b, frames, channels, height, width = video.shape
    p, pt = embed.patch_size, embed.patch_size_t
    if pt is None:  # 1.0: a Conv2d per frame
        grid = embed.proj(video.reshape(-1, channels, height, width))  # [B·T, D, h/p, w/p]
        return grid.flatten(2).transpose(1, 2).reshape(b, -1, grid.shape[1])  # [B, T·h/p·w/p, D]
    cells = video.permute(0, 1, 3, 4, 2).reshape(b, frames // pt, pt, height // p, p, width // p, p, channels)
    cells = cells.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(4, 7).flatten(1, 3)  # [B, N, C·pt·p·p]
    return embed.proj(cells)  # 1.5: a Linear per cell
