"""LTX-2 (Lightricks' LTX-2.0 and LTX-2.3): video with audio, diffusers ``LTX2VideoTransformer3DModel`` run the way
ComfyUI runs its LTXAV model (Comfy-Org/ComfyUI 0a29ddae comfy/ldm/lightricks/av_model.py ``LTXAVModel``,
``BasicAVTransformerBlock``; comfy/model_base.py ``LTXAV``; comfy/supported_models.py ``LTXAV``).

One generation makes two latents, sampled together (sampling/packed.py: ComfyUI's NestedTensor, packed for its
samplers): the video's [B, 128, F, H/32, W/32] (F = (frames − 1)/8 + 1) and the audio's [B, 8, T, 16], 25 latent
frames per second (comfy_extras/nodes_lt_audio.py ``LTXVEmptyLatentAudio``: T = round(frames / frame_rate · 25)).
Every block runs video self-attention, video–text cross-attention, the same for the audio, then audio-to-video
(queries video, keys audio) and video-to-audio (queries audio, keys the video after the audio-to-video update, as
ComfyUI's current block does) cross-attention, then each stream's feed-forward. The model is ComfyUI's: σ per
batch row, or per token under a noise mask (LTXVImgToVideo: mask·σ, the fixed frames clean); the cross-modal
scale/shift from each stream's own timestep and the gates from the other stream's largest; q/k RMSNorm eps 1e-5;
the text through the model's two connectors (registers fill the prompt to 1024 tokens), once per conditioning;
positions in pixels, time in seconds at the conditioning's frame rate (LTXVConditioning; 25 without one).

Sequence parallelism cuts the video tokens, their positions and their per-token timesteps, and gathers after
``proj_out``; the audio stays whole on every rank (replicated: at 720p × 121 frames it is 126 tokens beside 14 080
video ones, so computing it on every rank costs less than moving it). Video self-attention runs through the
sequence-parallel kernel; audio-to-video needs nothing (this rank's video queries, the whole audio's keys);
video-to-audio gives every rank the whole audio's queries over its share of the video keys, and the ranks merge
their partial attentions by their log-sum-exp (``AudioQueryProcessor``): audio-sized traffic, where splitting the
audio too would move the video's keys and values. PipeFusion is refused (every block's video-to-audio attention
reads all the video, so a patch's stale keys would change the audio at every step), as is the step cache (its
audio stream is not cached yet). Its guidance beyond CFG (sampling/guidance.py: STG's pass, the self-attention of some
blocks a value passthrough; modality guidance's, no audio↔video attention) runs through ``guidance_pass``.
"""

from __future__ import annotations

import math
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import UserError
from ..sampling.guidance import ISOLATED, PERTURBED
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, PerConditioning, SequencePlan, StagePlan

DEFAULT_SHIFT = 2.37  # supported_models.LTXV sampling_settings (LTXAV inherits them)
DEFAULT_FRAME_RATE = 25.0  # model_base.LTXAV.extra_conds: kwargs.get("frame_rate", 25)
AUDIO_LATENTS_PER_SECOND = 25  # the audio VAE: 16 000 Hz / hop 160 / 4 (nodes_lt_audio.LTXVEmptyLatentAudio)
AUDIO_CHANNELS, AUDIO_BINS = 8, 16  # the audio latent [B, 8, T, 16]; patchified b c t f → b t (c f)
TEXT_TOKENS = 1024  # the connectors' sequence: the prompt, then registers up to 1024 (Gemma's padded length)
PIXELS_PER_CELL = (8, 32, 32)  # frames, rows, columns per latent cell (the video VAE)
QK_NORM_EPS = 1e-5  # ComfyUI's CrossAttention q_norm / k_norm (diffusers' LTX2Attention: 1e-6)
RMS_EPS = 1e-6  # comfy.ldm.common_dit.rms_norm


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=RMS_EPS)


def ada(table: torch.Tensor, temb: torch.Tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, ...]:
    """ComfyUI's get_ada_values: ``table`` [k, D] plus the timestep's modulation [B, n, k·D], rows ``rows`` → each
    [B, n, D]."""
    b, n = temb.shape[:2]
    values = table[rows][None, None].to(temb) + temb.reshape(b, n, table.shape[0], -1)[:, :, rows]
    return values.unbind(dim=2)


def rotated(attn, x: torch.Tensor, rope) -> torch.Tensor:
    """diffusers' RoPE of ``attn``'s kind on x [B, S, H·D]."""
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

    if rope is None:
        return x
    return (apply_interleaved_rotary_emb if attn.rope_type == "interleaved" else apply_split_rotary_emb)(x, rope)


def projected(attn, queries: torch.Tensor, keys: torch.Tensor, query_rope, key_rope):
    """q, k, v [B, S, H, D] of an LTX2Attention, normed and rotated as diffusers' processor does."""
    q = rotated(attn, attn.norm_q(attn.to_q(queries)), query_rope).unflatten(2, (attn.heads, -1))
    k = rotated(attn, attn.norm_k(attn.to_k(keys)), key_rope if key_rope is not None else query_rope)
    return q, k.unflatten(2, (attn.heads, -1)), attn.to_v(keys).unflatten(2, (attn.heads, -1))


def finished(attn, queries: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The attention output [B, S, H, D] through the module's per-head gate (2.3) and out projection."""
    if attn.to_gate_logits is not None:
        out = out * (2.0 * torch.sigmoid(attn.to_gate_logits(queries))).unsqueeze(-1)  # [B, S, H] gates
    return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(queries)))


class VideoProcessor:
    """The video self-attention (``attn1``) on this rank's share of the video tokens, through the sequence-parallel
    core ``core(q, k, v, text_tokens=0)``."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("the sequence-parallel LTX-2 processor is for the video self-attention")
        q, k, v = projected(attn, hidden_states, hidden_states, query_rotary_emb, None)  # [B, n, H, D] each
        return finished(attn, hidden_states, self.core(q, k, v, text_tokens=0))


class AudioQueryProcessor:
    """Video-to-audio attention with the video split: the whole audio's queries attend to this rank's share of the
    video keys (its real ones: a padded share's padding left out), and the ranks' partial results merge by their
    log-sum-exp into the attention over every video key (exact)."""

    def __init__(self, core):
        self.kernel, self.shard = core.kernel, core.shard

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
                 key_rotary_emb=None):
        shard = self.shard
        q, k, v = projected(attn, hidden_states, encoder_hidden_states, query_rotary_emb, key_rotary_emb)
        real = shard.counts(shard.lengths["image"])[shard.index]  # this share's real video tokens
        out, lse = self.kernel(q, k[:, :real], v[:, :real])  # [B, Na, H, D], [B, H, Na]
        outs = [torch.empty_like(out) for _ in range(shard.parts)]
        lses = [torch.empty_like(lse) for _ in range(shard.parts)]
        dist.all_gather(outs, out.contiguous(), group=shard.group)  # P × [B, Na, H, D]
        dist.all_gather(lses, lse.contiguous(), group=shard.group)  # P × [B, H, Na]
        lse_all = torch.stack(lses).float()  # [P, B, H, Na]
        weights = torch.exp(lse_all - torch.logsumexp(lse_all, dim=0)).permute(0, 1, 3, 2)  # [P, B, Na, H]
        merged = (torch.stack(outs).float() * weights.unsqueeze(-1)).sum(dim=0)  # [B, Na, H, D]
        return finished(attn, hidden_states, merged.to(q.dtype))


@dataclass(frozen=True)
class LTX2Spec(FamilySpec):
    """What an LTX-2 model takes and allows, read from its config."""

    context_dim: int  # the text encoder's features: 3840 (2.0), 4096 + 2048 (2.3: video's and audio's side by side)
    heads: int  # the video's attention heads (Ulysses splits them)
    audio_heads: int
    blocks: int
    causal_positions: bool = True  # ComfyUI's causal_temporal_positioning (the file's metadata)
    middle_positions: bool = True  # use_middle_indices_grid: a token's position is its cell's middle, not its start

    family = "ltx2"
    latent_format = latent_formats.LTXV
    video = True
    vae_factor = 32
    patch = (1, 1, 1)
    time_factor = 8
    audio_part = (AUDIO_CHANNELS, None, AUDIO_BINS)  # FamilySpec.audio_part: an audio part [B, 8, T, 16]
    # model_base.LTXAV.process_timestep: under a noise mask a timestep per token (mask·σ), and its
    # scale_latent_inpaint keeps the fixed region clean
    masked_timesteps_per_frame = True
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    optional_conditioning = ("frame_rate", "keyframe_idxs")
    # LTXVConditioning's frame rate; LTXVAddGuide's guide frames' pixel positions [B, 3, Ng, 2] (the frames appended to
    # the video latent, their noise mask 1 − strength: model.LTXVModel._process_input)
    comfy_conditioning: ClassVar[dict[str, str]] = {"frame_rate": "frame_rate", "keyframe_idxs": "keyframe_idxs"}
    comfy_flags: ClassVar[dict[str, tuple[str, str]]] = {"unprocessed_ltxav_embeds": (
        "holds LTX-2 text features already through the text connectors (an older ComfyUI's LTX-2 text encoder)",
        "encode the prompt with the current LTXAVTextEncoderLoader / CLIP Text Encode: the connectors run on the "
        "backend, inside the model")}
    step_cache_refusal: ClassVar[str] = "its audio stream is not cached yet"
    guidance_passes: ClassVar[bool] = True  # STG, modality guidance, the audio's own CFG scale (sampling/guidance.py)
    method_refusals: ClassVar[dict[str, str]] = {
        "pipefusion": "every block's video-to-audio attention reads all of the video, so PipeFusion's one-step-stale "
                      "video keys would change the audio at every step; use ulysses or ring (the audio stays whole on "
                      "each rank), or cfg"}
    sequence_plan = SequencePlan(
        cuts=(Cut("video_tokens", 0, 1), Cut("video_coords", 0, 2),  # [B, N, 128], [B, 3, N, 2]
              Cut("video_timestep", 0, 1, optional=True)),  # [B, N] under a noise mask, else [B]
        attention=(("transformer_blocks.attn1", VideoProcessor),  # not the text connectors' attn1
                   ("transformer_blocks.video_to_audio_attn", AudioQueryProcessor)))
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=())
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("hidden_states", "audio_hidden_states")},
                           probe="temb", teacache=(1.0, 0.0))  # refused (step_cache_refusal)

    @classmethod
    def from_config(cls, config) -> LTX2Spec:
        def get(key: str, default=None):
            return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)

        two_three = not get("use_prompt_embeddings", True)  # 2.3: the connectors give the blocks' widths
        width = get("num_attention_heads") * get("attention_head_dim")
        audio_width = get("audio_num_attention_heads") * get("audio_attention_head_dim")
        positions = get("positions", {}) or {}
        return cls(width + audio_width if two_three else get("caption_channels"),
                   get("num_attention_heads"), get("audio_num_attention_heads"), get("num_layers"),
                   positions.get("causal", True), positions.get("middle", True))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """ComfyUI's LTXAV: ModelSamplingFlux (timestep = σ), shift 2.37 (ModelSamplingLTXV sets another)."""
        return FlowSampling(DEFAULT_SHIFT if shift is None else shift, flux=True)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """Gemma 3's features as ComfyUI's LTX-2 text encoder gives them (comfy/text_encoders/lt.py: the prompt's
        tokens, normalised and projected), LTXVConditioning's frame rate per row and LTXVAddGuide's guide positions."""
        return {"context": (batch, text_tokens, self.context_dim), "frame_rate": (batch,),
                "keyframe_idxs": (batch, 3, None, 2)}

    def drawn_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}  # a built-in: the default frame rate, no guides

    def audio_frames(self, frames: int, frame_rate: float = DEFAULT_FRAME_RATE) -> int:
        """The audio latent's length for ``frames`` video frames (LTXVEmptyLatentAudio)."""
        return round(frames / frame_rate * AUDIO_LATENTS_PER_SECOND)


def build_transformer(connector: dict | None = None, positions: dict | None = None, **config):
    """diffusers' LTX-2 transformer with the two text connectors ComfyUI's LTX-2 model holds (diffusers keeps them in
    its pipeline, ``LTX2TextConnectors``: the connector modules are its ``LTX2ConnectorTransformer1d``)."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2.connectors import LTX2ConnectorTransformer1d

    if connector is None:
        raise UserError("an LTX-2 diffusers folder keeps its text connectors apart from the transformer",
                        "load the LTX-2 single file (Lightricks' or Comfy-Org's) instead")
    transformer = LTX2VideoTransformer3DModel(**config)
    transformer.video_embeddings_connector = LTX2ConnectorTransformer1d(**connector["video"])
    transformer.audio_embeddings_connector = LTX2ConnectorTransformer1d(**connector["audio"])
    return transformer


@dataclass
class Modulation:
    """One model call's inputs to every block: the timesteps' modulations, positions and texts."""

    v_temb: torch.Tensor  # [B, n | 1, 6·D or 9·D]
    a_temb: torch.Tensor  # [B, T | 1, 6·Da or 9·Da]
    v_cross: torch.Tensor  # [B, n | 1, 4·D]: the cross-modal scale/shift (own timestep)
    a_cross: torch.Tensor  # [B, T | 1, 4·Da]
    v_gate: torch.Tensor  # [B, n | 1, D]: the audio-to-video gate (the audio's largest timestep)
    a_gate: torch.Tensor  # [B, T | 1, Da]
    v_prompt: torch.Tensor | None  # [B, 1, 2·D] (2.3: the text's modulation), None without
    a_prompt: torch.Tensor | None
    v_rope: tuple
    a_rope: tuple | None  # None without audio
    v_cross_rope: tuple
    a_cross_rope: tuple | None
    v_text: torch.Tensor  # [B, L', D]
    a_text: torch.Tensor  # [B, L', Da]
    v_embedded: torch.Tensor  # [B, n | 1, D]: the output layer's timestep
    a_embedded: torch.Tensor  # [B, T | 1, Da]
    perturbed: frozenset = frozenset()  # STG's blocks: their self-attention a value passthrough (guidance.PERTURBED)
    isolated: bool = False  # the audio↔video attention cut (guidance.ISOLATED)


def av_block(block, vx: torch.Tensor, ax: torch.Tensor, m: Modulation):
    """ComfyUI's BasicAVTransformerBlock on diffusers' block modules: the forward of each of the model's blocks
    (LTX2Model), so FSDP2's gathers and compile see a block call."""
    perturbed = block.ltx_index in m.perturbed  # ComfyUI's stg_skip_self_attn, on both streams' self-attention
    shift, scale, gate = ada(block.scale_shift_table, m.v_temb, slice(0, 3))
    vx = vx + self_attention(block.attn1, rms(vx) * (1 + scale) + shift, m.v_rope, perturbed) * gate
    vx = vx + text_attention(vx, m.v_text, block.attn2, block.scale_shift_table, m.v_temb,
                             getattr(block, "prompt_scale_shift_table", None), m.v_prompt)
    if ax.shape[1] == 0:  # a video without audio (ComfyUI's model given a video latent alone): the video's stream
        return _feed_forward(block, vx, ax, m)
    shift, scale, gate = ada(block.audio_scale_shift_table, m.a_temb, slice(0, 3))
    ax = ax + self_attention(block.audio_attn1, rms(ax) * (1 + scale) + shift, m.a_rope, perturbed) * gate
    ax = ax + text_attention(ax, m.a_text, block.audio_attn2, block.audio_scale_shift_table, m.a_temb,
                             getattr(block, "audio_prompt_scale_shift_table", None), m.a_prompt)
    if m.isolated:  # LTXVModalityGuidance's pass: no audio↔video attention
        return _feed_forward(block, vx, ax, m)
    # audio to video (queries video, keys audio), then video to audio (keys: the video after that update)
    a_norm = rms(ax)
    a_scale, a_shift, a_scale2, a_shift2 = ada(block.audio_a2v_cross_attn_scale_shift_table[:4], m.a_cross)
    v_scale, v_shift, v_scale2, v_shift2 = ada(block.video_a2v_cross_attn_scale_shift_table[:4], m.v_cross)
    a2v = block.audio_to_video_attn(rms(vx) * (1 + v_scale) + v_shift, a_norm * (1 + a_scale) + a_shift,
                                    query_rotary_emb=m.v_cross_rope, key_rotary_emb=m.a_cross_rope)
    vx = vx + a2v * ada(block.video_a2v_cross_attn_scale_shift_table[4:], m.v_gate)[0]
    v2a = block.video_to_audio_attn(a_norm * (1 + a_scale2) + a_shift2, rms(vx) * (1 + v_scale2) + v_shift2,
                                    query_rotary_emb=m.a_cross_rope, key_rotary_emb=m.v_cross_rope)
    ax = ax + v2a * ada(block.audio_a2v_cross_attn_scale_shift_table[4:], m.a_gate)[0]
    return _feed_forward(block, vx, ax, m)


def _feed_forward(block, vx, ax, m: Modulation):
    """Each stream's modulated feed-forward, the block's last step."""
    shift, scale, gate = ada(block.scale_shift_table, m.v_temb, slice(3, 6))
    vx = vx + block.ff(rms(vx) * (1 + scale) + shift) * gate
    shift, scale, gate = ada(block.audio_scale_shift_table, m.a_temb, slice(3, 6))
    ax = ax + block.audio_ff(rms(ax) * (1 + scale) + shift) * gate
    return vx, ax


def self_attention(attn, x: torch.Tensor, rope, perturbed: bool) -> torch.Tensor:
    """A stream's self-attention; perturbed (STG's pass), the value projection gated and projected out, without
    queries, keys or softmax (ComfyUI's CrossAttention under stg_skip_self_attn)."""
    if perturbed:
        return finished(attn, x, attn.to_v(x).unflatten(2, (attn.heads, -1)))
    return attn(x, query_rotary_emb=rope)


def text_attention(x, text, attn, table, temb, prompt_table, prompt_temb):
    """A stream's cross-attention to its text: plain (2.0), or modulated on both sides (2.3's cross_attention_adaln:
    the queries by the timestep's rows 6–8, the text by the prompt table and timestep)."""
    if prompt_table is None:
        return attn(rms(x), encoder_hidden_states=text)
    shift_q, scale_q, gate = ada(table, temb, slice(6, 9))
    if prompt_temb is None:  # a static text modulation (use_prompt_adaln_single off)
        shift_kv, scale_kv = prompt_table[None, None].to(x).unbind(dim=2)
    else:
        shift_kv, scale_kv = ada(prompt_table, prompt_temb)
    return attn(rms(x) * (1 + scale_q) + shift_q, encoder_hidden_states=text * (1 + scale_kv) + shift_kv) * gate


class LTX2Model(DiffusionModel):
    """A loaded LTX-2 transformer with its text connectors."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        from diffusers.models.transformers.transformer_ltx2 import LTX2Attention

        # where sequence parallelism cuts the video (output; the sequence plan)
        for name in ("video_tokens", "video_coords", "video_timestep"):
            setattr(transformer, name, torch.nn.Identity())
        for index, block in enumerate(transformer.transformer_blocks):
            block.forward = types.MethodType(av_block, block)  # block(vx, ax, m): ComfyUI's block
            block.ltx_index = index  # STG names its blocks by index
        for module in transformer.modules():
            if isinstance(module, LTX2Attention):
                module.norm_q.eps = module.norm_k.eps = QK_NORM_EPS
        self._texts = PerConditioning()  # context → its connected texts (self._connect), once per tensor
        self._pass: tuple = (None, None)  # the guidance pass the calls run now (guidance_pass)

    @contextmanager
    def guidance_pass(self, kind: str | None, passes):
        """Calls in the block run ``kind``'s pass: "perturbed" (STG: ``passes.stg_blocks``' self-attention a value
        passthrough), "isolated" (no audio↔video attention), None (the model as it is)."""
        self._pass = (kind, passes)
        try:
            yield
        finally:
            self._pass = (None, None)

    def output(self, x, timestep, cond, guidance):
        """The velocities (video [B, 128, F, h, w], audio [B, 8, T, 16]) for x = (video, audio) at σ ``timestep``
        [B], as ComfyUI's LTXAV model computes them."""
        t = self.transformer
        video, audio = x
        b, channels, frames, h, w = video.shape
        m = self._modulation(video, audio, timestep, cond)
        vx = t.proj_in(t.video_tokens(video.flatten(2).transpose(1, 2)))  # b c f h w → b (f h w) c → [B, n, D]
        ax = t.audio_proj_in(audio.permute(0, 2, 1, 3).flatten(2))  # b c t f → b t (c f) → [B, T, Da]
        for block in t.transformer_blocks:
            vx, ax = block(vx, ax, m)
        v_out = self._final(vx, t.scale_shift_table, m.v_embedded, t.norm_out, t.proj_out)  # gathered: [B, N, 128]
        a_out = self._final(ax, t.audio_scale_shift_table, m.a_embedded, t.audio_norm_out, t.audio_proj_out)
        v_out = v_out.transpose(1, 2).reshape(b, channels, frames, h, w)
        a_out = a_out.unflatten(2, (AUDIO_CHANNELS, AUDIO_BINS)).permute(0, 2, 1, 3)  # [B, T, 8·16] → [B, 8, T, 16]
        return v_out, a_out

    @staticmethod
    def _final(x, table, embedded, norm, proj):
        """The output layer: the last shift and scale from the embedded timestep [B, n | 1, D], then the projection."""
        shift, scale = (table[None, None].to(embedded) + embedded[:, :, None]).unbind(dim=2)
        return proj(norm(x) * (1 + scale) + shift)

    def _modulation(self, video, audio, timestep, cond) -> Modulation:
        """ComfyUI's _prepare_timestep, _prepare_positional_embeddings and _prepare_context for one call."""
        t = self.transformer
        config = t.config
        b, _, frames, h, w = video.shape
        sigma = timestep.to(self.device, torch.float32)  # [B]: ModelSamplingFlux's timestep is σ
        v_ts, a_ts = self._timesteps(sigma, cond.get("denoise_mask"), video, audio)  # [B, N] or [B]; [B, T] or [B]
        v_ts, a_ts = v_ts * config.timestep_scale_multiplier, a_ts * config.timestep_scale_multiplier
        factor = config.cross_attn_timestep_scale_multiplier / config.timestep_scale_multiplier
        v_gate_ts, a_gate_ts = a_ts.max() * factor, v_ts.max() * factor  # the other stream's largest, all rows
        v_prompt = self._prompt(getattr(t, "prompt_adaln", None), v_ts, b)  # from every video token's timestep
        a_prompt = self._prompt(getattr(t, "audio_prompt_adaln", None), a_ts, b)
        v_ts = t.video_timestep(v_ts)  # [B, n] (this rank's tokens') or [B]

        def embed(module, ts):
            out, embedded = module(ts.flatten(), batch_size=b, hidden_dtype=self.dtype)
            return out.view(b, -1, out.shape[-1]), embedded.view(b, -1, embedded.shape[-1])

        v_temb, v_embedded = embed(t.time_embed, v_ts)
        a_temb, a_embedded = embed(t.audio_time_embed, a_ts)
        rate = cond.get("frame_rate")
        rate = torch.full((b,), DEFAULT_FRAME_RATE) if rate is None else rate.float()
        coords = self._video_coords(b, frames, h, w, rate.to(self.device), cond.get("keyframe_idxs"))
        coords = t.video_coords(coords)  # [B, 3, N, 2] → this rank's [B, 3, n, 2]
        a_coords = t.audio_rope.prepare_audio_coords(b, audio.shape[2], self.device)  # [B, 1, T, 2], seconds
        audio = audio.shape[2] > 0  # without audio its positions are never read (and RoPE takes no empty grid)
        v_text, a_text = self._texts.get(cond["context"], self._connect)
        m = Modulation(
            v_temb, a_temb, embed(t.av_cross_attn_video_scale_shift, v_ts)[0],
            embed(t.av_cross_attn_audio_scale_shift, a_ts)[0],
            embed(t.av_cross_attn_video_a2v_gate, v_gate_ts.expand_as(v_ts))[0],
            embed(t.av_cross_attn_audio_v2a_gate, a_gate_ts.expand_as(a_ts))[0], v_prompt, a_prompt,
            t.rope(self._positions(coords)), t.audio_rope(self._positions(a_coords)) if audio else None,
            t.cross_attn_rope(coords[:, 0:1]), t.cross_attn_audio_rope(a_coords[:, 0:1]) if audio else None,
            v_text, a_text,
            v_embedded, a_embedded)
        kind, passes = self._pass
        m.perturbed = passes.stg_blocks if kind == PERTURBED else frozenset()
        m.isolated = kind == ISOLATED
        return m

    def _positions(self, coords: torch.Tensor) -> torch.Tensor:
        """[B, axes, n, 2] (start, end) as the self-attention's RoPE reads them: diffusers' takes the middle, ComfyUI
        the middle only with use_middle_indices_grid (else the start: given as both ends)."""
        return coords if self.spec.middle_positions else coords[..., :1].expand_as(coords)

    def _video_coords(self, b: int, frames: int, h: int, w: int, rate: torch.Tensor,
                      keyframes: torch.Tensor | None = None) -> torch.Tensor:
        """Each video token's cell in pixels, (start, end) per axis, time in seconds at ``rate`` [B] frames per
        second: [B, 3, N, 2] (ComfyUI's latent_to_pixel_coords, its causal fix: the first frame is one pixel
        frame, so a frame's start is 8f − 7, not below 0). LTXVAddGuide's guide frames, appended to the latent, take
        their pixel positions from ``keyframes`` [B, 3, Ng, 2] (ComfyUI's keyframe_idxs: the last Ng tokens')."""
        grid = torch.stack(torch.meshgrid(*(torch.arange(n, device=self.device, dtype=torch.float32)
                                            for n in (frames, h, w)), indexing="ij")).flatten(1)  # [3, N]
        scale = torch.tensor(PIXELS_PER_CELL, device=self.device, dtype=torch.float32)[:, None, None]
        coords = torch.stack([grid, grid + 1], dim=-1) * scale  # [3, N, 2]
        if self.spec.causal_positions:
            coords[0] = (coords[0] + 1 - PIXELS_PER_CELL[0]).clamp(min=0)
        coords = coords[None].repeat(b, 1, 1, 1)
        if keyframes is not None and keyframes.shape[2]:
            if keyframes.shape[2] % (h * w) or keyframes.shape[2] > coords.shape[2]:
                raise UserError(f"keyframe_idxs holds {keyframes.shape[2]} tokens, not whole {h}×{w}-token latent "
                                f"frames of this {frames}-frame latent: the guides were added at another size",
                                "add the guides (LTXVAddGuide) to the latent being sampled, after any upscaling")
            coords[:, :, -keyframes.shape[2]:] = keyframes.to(coords)
        coords[:, 0] = coords[:, 0] / rate.view(b, 1, 1)
        return coords

    def _timesteps(self, sigma, mask, video, audio):
        """The video's and the audio's timesteps in [0, 1]: σ per row [B], or under a noise mask (the packed one,
        sampling/generate.py) mask·σ per token ([B, N], [B, T]: model_base.LTXAV.process_timestep)."""
        if mask is None:
            return sigma, sigma
        b = video.shape[0]
        v_mask, a_mask = mask.to(self.device, torch.float32).split([video[0].numel(), audio[0].numel()], dim=1)
        v_mask = v_mask.view(video.shape)[:, 0].reshape(b, -1)  # channel 0: [B, F·h·w]
        if audio.shape[2] == 0:  # no audio: its σ per row (never read)
            return v_mask * sigma[:, None], sigma
        a_mask = a_mask.view(audio.shape)[:, 0, :, 0]  # [B, T]
        return v_mask * sigma[:, None], a_mask * sigma[:, None]

    def _prompt(self, module, ts: torch.Tensor, b: int):
        """2.3's text modulation [B, 1, 2·D] from each row's largest timestep (compute_prompt_timestep), or None."""
        if module is None:
            return None
        largest = ts.max(dim=1).values if ts.dim() > 1 else ts
        out, _ = module(largest, batch_size=b, hidden_dtype=self.dtype)
        return out.view(b, 1, -1)

    def _connect(self, context: torch.Tensor):
        """The video's and the audio's texts [B, L', D], [B, L', Da] from the text encoder's features ``context``
        [B, L, 3840 | 6144] (LTXAVModel.preprocess_text_embeds, then _prepare_context); called through
        ``self._texts``, once per conditioning tensor."""
        t = self.transformer
        features = context.to(self.device, self.dtype)
        if t.config.use_prompt_embeddings:  # 2.0: one 3840 text for both connectors, projected after them
            video = t.caption_projection(self._connector(t.video_embeddings_connector, features))
            audio = t.audio_caption_projection(self._connector(t.audio_embeddings_connector, features))
        else:  # 2.3: each stream's own features, the connectors give the blocks' widths
            width = t.config.num_attention_heads * t.config.attention_head_dim
            video = self._connector(t.video_embeddings_connector, features[..., :width])
            audio = self._connector(t.audio_embeddings_connector, features[..., width:])
        return video, audio

    @staticmethod
    def _connector(connector, tokens: torch.Tensor) -> torch.Tensor:
        """ComfyUI's Embeddings1DConnector: the prompt's tokens, then the learned registers (tiled from position 0)
        up to 1024, through the 1-D blocks and a final RMS norm: [B, L, D] → [B, max(1024, L), D]."""
        b, length, width = tokens.shape
        total = max(TEXT_TOKENS, length)
        registers = connector.learnable_registers
        tiled = registers.repeat(math.ceil(total / registers.shape[0]), 1)[length:total]  # [total − L, D]
        hidden = torch.cat([tokens, tiled[None].expand(b, -1, -1).to(tokens)], dim=1)
        rope = connector.rope(b, total, device=tokens.device)
        for block in connector.transformer_blocks:
            hidden = block(hidden, attention_mask=None, rotary_emb=rope)
        return connector.norm_out(hidden)
