"""Wan 2.1 / 2.2: diffusers ``WanTransformer3DModel`` fed as ComfyUI feeds Wan.

Video latents [B, C, T, h, w] in (1, 2, 2) patches; self-attention over frames × rows × columns
tokens with 3-D RoPE, cross-attention to the UMT5 text. Sequence parallelism cuts the tokens
before the first block and the RoPE table alongside them, and gathers after ``proj_out``;
cross-attention needs nothing (its keys are the whole text). Model sampling: discrete flow,
shift 8. Wan 2.2-A14B is two such models (high- and low-noise experts), run as two requests
over step ranges; Wan 2.2-TI2V-5B has a 48-channel latent from a 16× VAE.

Image to video (Wan 2.1 I2V / FLF2V / Fun InP, Wan 2.2 I2V A14B: 36 input channels; Wan 2.1 Fun Control: 48, the
control video's latent and the start image's, WanFunControlToVideo's, concatenated without a mask). As
ComfyUI's WanImageToVideo and WanFirstLastFrameToVideo put them on the conditioning (comfy_extras/nodes_wan.py) and
its WAN21 model reads them (comfy/model_base.py ``WAN21.concat_cond``, ``extra_conds``; comfy/ldm/wan/model.py
``MLPProj``, ``WanI2VCrossAttention``):
- ``concat_latent_image`` [B, 16·k, T', h', w'] (the start/end frames' VAE latents, raw) and ``concat_mask``
  [B, 1 or 4, T'', H, W] (1 where a frame is to be made): ``concat`` builds the 20 channels ComfyUI concatenates
  to the model input, the inverted mask (4) and the image (16) in model space, resized to the latent. They are
  channels of the input, so they travel with their tokens under every split.
- ``clip_vision_output`` [B, 257 (FLF2V: 514), 1280] (CLIPVisionEncode's penultimate hidden states): Wan 2.1
  I2V's image embedder turns them into tokens its cross-attention attends to beside the text, through its own
  keys and values (``WanCrossProcessor``). They are keys, whole on every rank, like the text. A model without an
  image embedder (Wan 2.2) ignores them, as ComfyUI's does.

Wan 2.2 TI2V-5B image to video (Wan22ImageToVideoLatent: the start image's latent in the first frame, a noise mask
0 there). ComfyUI's WAN22 (comfy/model_base.py ``process_timestep``, ``scale_latent_inpaint``) then gives the model
a timestep per latent frame, t times the mask's mean over the frame (0: the fixed frame), and keeps the fixed
region as the clean latent (sampling/inpaint.py ``clean``). The sampler puts the prepared mask on the conditioning
as ``denoise_mask`` (ComfyUI's extra cond), a model call from ComfyUI's sampler brings the timesteps [B, T]; either
way the transformer takes one per token [B, N] (diffusers' TI2V form) and modulates each token by its frame's.
Sequence parallelism cuts the per-token timesteps with the tokens; a PipeFusion chunk takes its tokens' frames'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan
from .resize import upscale

WAN_DEFAULT_SHIFT = 8.0  # ComfyUI's WAN21_T2V sampling_settings (WAN22_T2V inherits it)
CLIP_VISION_WIDTH = 1280  # CLIP-H's hidden states, what ComfyUI's Wan image embedder (MLPProj) takes


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


class ImageTokens:
    """The embedded CLIP image tokens [B, n, D] of the forward running now (None: none), which every block's
    cross-attention reads: set by the model wrapper around each forward or step."""

    tokens: torch.Tensor | None = None


class WanCrossProcessor:
    """Wan I2V's cross-attention, as ComfyUI's WanI2VCrossAttention: the queries attend to the text (the module's
    keys and values) and to the image tokens (its added keys and values), and the two results add. diffusers' own
    processor finds the image tokens by taking 512 text tokens off the end; ComfyUI's text can be longer."""

    def __init__(self, images: ImageTokens):
        self.images = images

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(2, (attn.heads, -1)).transpose(1, 2)  # [B, S, H·D] → [B, H, S, D]

        query = heads(attn.norm_q(attn.to_q(hidden_states)))
        key = heads(attn.norm_k(attn.to_k(encoder_hidden_states)))
        out = F.scaled_dot_product_attention(query, key, heads(attn.to_v(encoder_hidden_states)))  # [B, H, N, D]
        image = self.images.tokens
        if image is not None:
            key = heads(attn.norm_added_k(attn.add_k_proj(image)))
            out = out + F.scaled_dot_product_attention(query, key, heads(attn.add_v_proj(image)))
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)  # [B, N, H·D]
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
    channels: int  # the latent's: 16 (Wan 2.1, Wan 2.2-A14B) or 48 (Wan 2.2-TI2V-5B)
    in_channels: int = 0  # the model input's: the latent's and the 20 image-to-video concatenates (36); 0: the latent's

    family = "wan"
    # comfy/ldm/wan/model.py WanModel.forward(x, timestep, context, clip_fea, time_dim_concat, …); x comes with the
    # concatenated channels (model_base._apply_model concatenates c_concat)
    # (and WAN22's denoise_mask, which ComfyUI's process_timestep has turned into the timesteps per frame)
    comfy_model_inputs = {"clip_fea": "clip_vision_output", "denoise_mask": "timestep"}
    # comfy_extras/nodes_wan.py WanImageToVideo / WanFirstLastFrameToVideo's options; the CLIP output's hidden
    # states as model_base.WAN21.extra_conds reads them
    comfy_conditioning = {"concat_latent_image": "concat_latent_image", "concat_mask": "concat_mask",
                          "clip_vision_output.penultimate_hidden_states": "clip_vision_output"}
    video = True
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(cuts=(Cut("", "timestep", 1, optional=True),  # [B, N] per token (TI2V mask), or [B]
                                       Cut("rope", None, 1),  # (cos, sin) [1, N, 1, D] each
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

    @property
    def concat_channels(self) -> int:
        return max(0, self.in_channels - self.channels)

    @property
    def image_channels(self) -> int:
        """The latents ComfyUI's nodes put on the conditioning: 16 beside the 4 of the mask (I2V, FLF2V), or the
        control video's and the start image's, 32 (Wan 2.1 Fun Control, which takes no mask)."""
        return self.concat_channels - 4 if self.concat_channels % self.channels else self.concat_channels

    @property
    def model_reads_noise_mask(self) -> bool:
        # the 4 mask channels of I2V / FLF2V / Fun InP (WAN21.concat_cond: concat_mask, else denoise_mask)
        return self.masked_timesteps_per_frame or self.concat_channels % self.channels == 4

    @property
    def masked_timesteps_per_frame(self) -> bool:
        return self.channels == 48  # ComfyUI's WAN22 (TI2V-5B)

    @property
    def optional_conditioning(self) -> tuple[str, ...]:
        images = ("concat_latent_image", "concat_mask") if self.concat_channels else ()
        return (*images, "clip_vision_output")

    @classmethod
    def from_config(cls, config: dict) -> WanSpec:
        return cls(config["text_dim"], config["num_attention_heads"], config["num_layers"],
                   config.get("out_channels") or config["in_channels"], config["in_channels"])

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(WAN_DEFAULT_SHIFT if shift is None else shift)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        shapes = {"context": (batch, text_tokens, self.context_dim),
                  "clip_vision_output": (batch, None, CLIP_VISION_WIDTH)}  # [B, 257 or 514, 1280]
        if self.concat_channels:
            # [B, 16 (Fun Control: 32), T, h', w'], raw
            shapes["concat_latent_image"] = (batch, self.image_channels, None, None, None)
            shapes["concat_mask"] = (batch, None, None, None, None)  # [B, 1 or 4, T'', H, W], 1: to be made
        return shapes


class WanModel(DiffusionModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.images = ImageTokens()
        for block in self.transformer.blocks:
            if block.attn2.add_k_proj is not None:  # Wan 2.1 I2V / FLF2V: keys and values for the image tokens
                block.attn2.set_processor(WanCrossProcessor(self.images))

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, C, T, h, w] at timestep 1000·σ [B], float32 into the sinusoidal
        embedding as in ComfyUI (not rounded to the weights' dtype)."""
        self.images.tokens = self.image_tokens(cond)
        frames = self.frame_timesteps(timestep, cond)  # [B, T] under a TI2V noise mask, else None
        if frames is not None:  # one per token [B, N]: each frame's over its rows × columns (frame-major)
            timestep = frames.repeat_interleave(self._frame_tokens(x.shape), dim=1)
        try:
            return self.transformer(
                hidden_states=self.with_concat(x, cond),  # [B, C (+ 20), T, h, w]
                timestep=timestep.to(self.device, torch.float32),  # [B] or [B, N]
                encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
                return_dict=False,
                **self.extra_inputs(x, cond),
            )[0]
        finally:
            self.images.tokens = None

    def extra_inputs(self, x, cond) -> dict:
        """More keyword inputs of the transformer's forward (a variant's: VACE's control video)."""
        return {}

    def frame_timesteps(self, timestep: torch.Tensor, cond: dict) -> torch.Tensor | None:
        """The timesteps per latent frame [B, T] ComfyUI's WAN22 gives its model under a noise mask
        (``process_timestep``: t times the mean of ``denoise_mask`` [B, C, T, h, w] over each frame), or as a model
        call brings them; None: one timestep per row."""
        if timestep.dim() == 2:
            return timestep.to(self.device, torch.float32)
        mask = cond.get("denoise_mask")
        if mask is None:
            return None
        mask = mask.to(self.device, torch.float32)
        return mask.mean(dim=(1, 3, 4)) * timestep.to(self.device, torch.float32)[:, None]  # [B, T]

    def image_tokens(self, cond: dict) -> torch.Tensor | None:
        """The CLIP image tokens [B, n, D] through the image embedder, as ComfyUI's MLPProj (FLF2V: the position
        table added to the first and last frame's tokens); None without an embedder or an image."""
        clip = cond.get("clip_vision_output")
        embedder = self.transformer.condition_embedder.image_embedder
        if clip is None or embedder is None:
            return None
        clip = clip.to(self.device, self.dtype)  # [B, 257 or 514, 1280]
        if embedder.pos_embed is not None:
            clip = clip[:, :embedder.pos_embed.shape[1]] + embedder.pos_embed[:, :clip.shape[1]].to(clip.dtype)
        return embedder.norm2(embedder.ff(embedder.norm1(clip)))  # [B, n, D]

    def concat(self, shape, cond) -> torch.Tensor | None:
        """ComfyUI's WAN21.concat_cond for a latent of ``shape`` [B, 16, T, h, w]: the mask (inverted, 4 channels)
        and the image latents in model space, resized to the latent, [B, 20, T, h, w]; zeros without an image."""
        extra = self.spec.concat_channels
        if not extra:
            return None
        b, _, frames, h, w = shape
        image = cond.get("concat_latent_image")
        if image is None:
            return torch.zeros(b, extra, frames, h, w, device=self.device)
        if image.shape[2] != frames:
            raise UserError(f"concat_latent_image has {image.shape[2]} frames; the latent has {frames}",
                            "make the start image's latent as WanImageToVideo does: as many frames as the video's")
        image = self.image_in(image, h, w)  # [B, 16·k, T, h, w]
        if image.shape[1] == extra:  # as ComfyUI: an image that fills the channels goes without a mask
            return image
        image = image[:, :extra - 4]
        mask = cond.get("concat_mask", cond.get("denoise_mask"))  # as WAN21.concat_cond: the noise mask without one
        if mask is None:
            mask = torch.zeros(b, 4, frames, h, w, device=self.device)
        else:
            mask = mask.to(self.device, torch.float32)
            if mask.shape[1] != 4:
                mask = mask.mean(dim=1, keepdim=True)
            mask = upscale(1.0 - mask, h, w)
            if mask.shape[2] < frames:
                mask = F.pad(mask, (0, 0, 0, 0, 0, frames - mask.shape[2]))
            mask = mask.expand(-1, 4, -1, -1, -1) if mask.shape[1] == 1 else mask
        return torch.cat([mask, image], dim=1)  # [B, 4 + 16, T, h, w]

    # PipeFusion stages (base.DiffusionModel): a patch is the same band of rows in every frame, so
    # it is a [B, C, T, rows, w] slice of the latent and its tokens are frames × rows × columns.

    def positions(self, shape):
        """The 3-D RoPE (cos, sin) [1, N, 1, D] of the whole latent (the module reads only the shape)."""
        return self.transformer.rope(torch.empty(shape, device="meta"))

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time embedding and its projection (per row, or per latent frame under a TI2V noise mask) and the
        projected text."""
        self.images.tokens = self.image_tokens(cond)  # the same for every chunk of the generation
        frames = self.frame_timesteps(timestep, cond)  # [B, T] or None
        flat = timestep.to(self.device, torch.float32) if frames is None else frames.flatten()  # [B] or [B·T]
        temb, projection, context, _ = self.transformer.condition_embedder(
            flat, cond["context"].to(self.device, self.dtype), None,
            timestep_seq_len=None if frames is None else frames.shape[1])
        # temb [B, D] or [B, T, D]; projection [B, 6·D] → [B, 6, D], or [B, T, 6·D] → [B, T, 6, D]; context [B, L, D]
        inputs = {"temb": temb, "projection": projection.unflatten(-1, (6, -1)), "context": context}
        if frames is not None:
            inputs["frame_tokens"] = self._frame_tokens(shape)
        return inputs

    def _frame_tokens(self, shape) -> int:
        """Tokens per latent frame of a latent of ``shape`` [B, C, T, h, w] (Wan's temporal patch is 1)."""
        _, ph, pw = self.spec.patch
        return shape[-2] // ph * (shape[-1] // pw)

    @staticmethod
    def _per_token(embedding: torch.Tensor, inputs: dict, tokens: torch.Tensor) -> torch.Tensor:
        """A per-frame embedding [B, T, ...] at ``tokens`` [n] (indices in the frame-major sequence) → [B, n, ...];
        a per-row one [B, ...] as it is."""
        frame_tokens = inputs.get("frame_tokens")
        return embedding if frame_tokens is None else embedding[:, tokens // frame_tokens]

    def embed(self, x, tokens, inputs, positions):
        patches = self.transformer.patch_embedding(x)  # [B, D, T/pt, rows/ph, w/pw]
        return patches.flatten(2).transpose(1, 2).contiguous()  # [B, n, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        cos, sin = positions
        return {"encoder_hidden_states": inputs["context"],
                "temb": self._per_token(inputs["projection"], inputs, tokens),  # [B, 6, D] or [B, n, 6, D]
                "rotary_emb": (cos[:, tokens], sin[:, tokens])}  # [1, n, 1, D] each

    def run_block(self, block, image, text, kwargs):
        return block(image, **kwargs), text

    def head(self, image, inputs, tokens):
        t = self.transformer
        temb = self._per_token(inputs["temb"], inputs, tokens)  # [B, D] or [B, n, D]
        if temb.dim() == 3:  # [1, 1, 2, D] + [B, n, 1, D] → [B, n, D] each
            shift, scale = (t.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).unbind(2)
        else:
            shift, scale = (t.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)  # [B, 1, D] each
        image = (t.norm_out(image.float()) * (1 + scale) + shift).type_as(image)
        return t.proj_out(image)  # [B, n, pt·ph·pw·C]

    def unpatchify(self, tokens, shape):
        """As diffusers' forward ends, for a band of rows in every frame."""
        pt, ph, pw = self.transformer.config.patch_size
        b, _, frames, rows, columns = shape
        patches = tokens.reshape(b, frames // pt, rows // ph, columns // pw, pt, ph, pw, -1)
        return patches.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)  # [B, C, T, rows, w]
