"""MiniMax-H3: video with audio from one packed sequence, diffusers ``MiniMaxH3Transformer3DModel`` run the way
ComfyUI runs it (Comfy-Org/ComfyUI comfy/ldm/minimax/model.py 01a56b76 ``MiniMaxH3Model``; comfy/model_base.py
094c74c1 ``MiniMaxH3``; comfy/model_sampling.py 2fd20839 ``ModelSamplingAV``; comfy/supported_models.py 01f03bbd;
comfy_extras/nodes_minimax_h3.py 13a83ce7).

The latent has two parts, sampled as one (sampling/packed.py): the video's [B, 24, T, H/16, W/16] (T = 2 + 5k for
5 + 17k frames: the VAE groups 1, 4, 4, 4, 4 frames) and the stereo audio's [B, 32, 2, Ta] (40 latent frames a
second at 24 fps). Every model call packs one sequence: the text's rows (Qwen3-VL's, through the model's token
refiner once per conditioning), the keyframes' rows (image to video: MiniMaxH3ImageToVideo's first and last frame,
tagged video), the audio's 2·Ta rows (channel by channel), then the video's rows (1×2×2 patches);
each row is tagged with its modality (video 0, text 1, audio 2) and a timestep (t = 1 − σ), and one stack of blocks
attends over all of it, modulated per row by the (timestep, modality) pair. Positions are (t, h, w): text row i at
(i, 0, 0); from the text's end, the video's frames at 5/3 per pixel frame over a centred grid, the audio's frames one
apart on the grid's left (channel 0) and right (channel 1) edges.

The sampler walks the video's σ (ModelSamplingAV: discrete flow, shift 12). The audio runs at its own σa, shift 3 on
the same base time, carried in the sampler as y = (σv/σa)·x_a, whose clean value is k·a0 (k = 12/3: ComfyUI's
process_latent_in scales the audio part by k, here LatentParts.scales); the model takes x_a = y·σa/σv back and gives
the velocity of y: (1 − k)·x_a + (1 + (k − 1)·σa)·out_a. The network predicts the velocity toward the data, which
ComfyUI negates for its sampler's x0 = x − σ·out; so does this wrapper.

Sequence parallelism cuts the packed sequence (text, audio and video rows alike, one segment) and every per-row
tensor with it: positions, AdaLN rows, the output layer's timestep rows; the blocks' attention runs through the
sequence-parallel kernel; the two output heads run on each rank's rows and their outputs (24·4 + 32 channels a row)
are gathered. PipeFusion and the step cache are refused (each says why).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, PerConditioning, SequencePlan, StagePlan

SHIFT_VIDEO, SHIFT_AUDIO = 12.0, 3.0  # supported_models.MiniMaxH3 sampling_settings (shift, audio_shift)
FRAMES_PER_LATENT = (1, 4, 4, 4, 4)  # pixel frames each latent frame holds, cycling (model.py FRAME_PER_TOKEN)
TIME_PER_FRAME = 5 / 3  # RoPE time per pixel frame (FRAME_RESCALE)
FPS, AUDIO_LATENTS_PER_SECOND = 24, 40  # nodes_minimax_h3: the video's frame rate, the audio latent's
AUDIO_CHANNELS, STEREO = 32, 2
VIDEO, TEXT, AUDIO = 0, 1, 2  # the rows' modality tags (and their AdaLN row within a timestep's three)
GRID_SCALE = 32.0  # the spatial positions' span (model.py _frame_grid)
KEYFRAME_AUG = 0.999  # a keyframe's rows: 0.999·latent + 0.001·noise, at timestep max(t, 0.999) (VISUAL_COND_TIMESTEP)


def time_shift_sigma(sigma: torch.Tensor, shift_from: float, shift_to: float) -> torch.Tensor:
    """σ of a discrete-flow shift ``shift_from`` → the σ of shift ``shift_to`` at the same base time (model.py)."""
    base = sigma / (shift_from + sigma * (1 - shift_from))
    return shift_to * base / (1 + (shift_to - 1) * base)


def latent_frames(frames: int) -> int:
    """The video latent's frames for ``frames`` pixel frames (EmptyMiniMaxH3LatentAV: 5 + 17k frames)."""
    return 2 if frames <= 5 else (frames - 5) // 17 * 5 + 2


def frame_times(count: int) -> torch.Tensor:
    """Each latent frame's RoPE time: 5/3 per pixel frame before it, [count] float64."""
    frames = torch.tensor([FRAMES_PER_LATENT[k % 5] for k in range(count)], dtype=torch.float64)
    return torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(frames * TIME_PER_FRAME, 0)[:-1]])


def frame_grid(rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (h, w) positions of one latent frame's tokens along each axis, centred and scaled by the frame's aspect
    (model.py _frame_grid: rows and columns in latent cells, a token per 2 cells)."""
    side = math.sqrt(rows * columns)

    def axis(cells: int) -> torch.Tensor:
        ratio, n = cells / side, cells // 2
        return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1 - ratio) / 2) * GRID_SCALE

    return axis(rows), axis(columns)


class PackedProcessor:
    """The blocks' attention over this rank's share of the packed sequence, through the sequence-parallel core
    ``core(q, k, v, text_tokens=0)`` (the sequence is one segment)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

        if attention_mask is not None:
            raise NotImplementedError("MiniMax-H3's packed sequence is one document: no attention mask")
        q, k, v = (proj(hidden_states).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)  # [B, n, H, D] each
        if rotary_emb is not None:
            q, k = _apply_rotary_emb(q, *rotary_emb), _apply_rotary_emb(k, *rotary_emb)
        out = self.core(q, k, v, text_tokens=0).flatten(2, 3).type_as(q)  # [B, n, H·D]
        return attn.to_out[1](attn.to_out[0](out))


class CurveTable(torch.nn.Module):
    """A pruned (curve-form) file's time embedding: ``adaln_t_table`` [grid, k], rows over t in [0, 1], read by linear
    interpolation (model.py's use_adaln_curves: the full time embedder and AdaLN widths folded into a rank-k basis)."""

    def __init__(self, grid: int, width: int):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(grid, width))  # a built-in's: drawn from its seed

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        table = self.table.float()
        position = t.float().clamp(0.0, 1.0) * (table.shape[0] - 1)
        lower = position.floor().long().clamp(max=table.shape[0] - 2)
        return torch.lerp(table[lower], table[lower + 1], (position - lower).unsqueeze(1))  # [M, k]


def _curve_modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A block's AdaLN projection of a curve-form model: linear on the interpolated basis, no SiLU (model.py's
    apply_silu off for curves)."""
    return self.linear(temb.to(self.linear.weight.dtype)).view(-1, 6 * self.hidden_size).chunk(6, dim=-1)


def _curve_norm_out(self, hidden_states: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor):
    """The final norm of a curve-form model: its shift and scale without SiLU."""
    shift, scale = self.linear(temb.to(self.linear.weight.dtype)).chunk(2, dim=-1)
    hidden_states = self.norm(hidden_states)
    return hidden_states * (1.0 + scale.index_select(0, timestep_indices)) + shift.index_select(0, timestep_indices)


def build_transformer(adaln_curve_grid: int | None = None, **config):
    """diffusers' MiniMax-H3 transformer; a pruned (curve-form) file's with its curve table for the time embedder and
    its AdaLN projections run without SiLU, as ComfyUI runs such files."""
    from diffusers import MiniMaxH3Transformer3DModel

    transformer = MiniMaxH3Transformer3DModel(**config)
    if adaln_curve_grid is not None:
        transformer.time_embedder = CurveTable(adaln_curve_grid, transformer.config.time_embed_dim)
        for block in transformer.transformer_blocks:
            block.adaln_proj.forward = types.MethodType(_curve_modulation, block.adaln_proj)
        transformer.norm_out.forward = types.MethodType(_curve_norm_out, transformer.norm_out)
    return transformer


@dataclass(frozen=True)
class MiniMaxH3Spec(FamilySpec):
    """What a MiniMax-H3 model takes and allows, read from its config."""

    context_dim: int  # Qwen3-VL-32B's 5120
    heads: int
    blocks: int

    family = "minimax_h3"
    latent_format = latent_formats.MINIMAX_H3
    video = True
    vae_factor = 16
    patch = (1, 2, 2)
    audio_part = (AUDIO_CHANNELS, STEREO, None)  # [B, 32, 2, Ta]
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    method_refusals: ClassVar[dict[str, str]] = {
        "pipefusion": "its one sequence holds the text, the audio and the video, and every block attends over all "
                      "of it; use ulysses or ring, or cfg"}
    step_cache_refusal: ClassVar[str] = "its packed sequence's audio and text rows are not cached yet"
    optional_conditioning = ("text_token_tags", "keyframe_latents", "keyframe_frames")
    # CLIP Text Encode with MiniMax-H3's Qwen3-VL tags each text token (1 text, 0 an image's vision tokens);
    # MiniMaxH3ImageToVideo's first / last frame: their latents [B, 24, K, h, w] and pixel frame indices [B, K]
    comfy_conditioning: ClassVar[dict[str, str]] = {"minimax_token_tags": "text_token_tags",
                                                    "minimax_keyframes": "keyframe_latents"}
    sequence_plan = SequencePlan(
        cuts=(Cut("packed_tokens", 0, 1), Cut("packed_positions", 0, 0),  # [B, S, D], [S, 3]
              Cut("adaln_rows", 0, 0), Cut("timestep_rows", 0, 0)),  # [S], [S]
        attention=(("transformer_blocks.attn", PackedProcessor),),  # not the token refiner's
        gather="packed_output")
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=())
    cache_plan = CachePlan(blocks=("transformer_blocks",), returns={"transformer_blocks": ("hidden_states",)},
                           probe="temb", teacache=(1.0, 0.0))  # refused (step_cache_refusal)

    @classmethod
    def from_config(cls, config) -> MiniMaxH3Spec:
        def get(key: str):
            return config.get(key) if isinstance(config, dict) else getattr(config, key)

        return cls(get("text_dim"), get("num_attention_heads"), get("num_layers"))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """ComfyUI's ModelSamplingAV for the video's σ: discrete flow, shift 12, timestep 1000·σ."""
        return FlowSampling(SHIFT_VIDEO if shift is None else shift)

    def part_scales(self, shift: float | None) -> tuple[float, ...]:
        """The audio carried at k = shift / audio shift times its value (model_base.MiniMaxH3 process_latent_in)."""
        return (1.0, (SHIFT_VIDEO if shift is None else shift) / SHIFT_AUDIO)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """Qwen3-VL-32B's 50th layer as ComfyUI's MiniMax-H3 text encoder gives it (no template, no padding), and its
        per-token modality tags."""
        return {"context": (batch, text_tokens, self.context_dim), "text_token_tags": (batch, text_tokens),
                "keyframe_latents": (batch, 24, None, None, None), "keyframe_frames": (batch, None)}

    def drawn_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}

    def latent_frames(self, frames: int) -> int:
        return latent_frames(frames)

    def pixel_frames(self, latent_frames: int) -> int:
        return 5 + 17 * max(0, (latent_frames - 2) // 5)

    def check_size(self, width: int, height: int, frames: int) -> None:
        for name, side in (("width", width), ("height", height)):
            if side % 32:
                raise UserError(f"{name} {side} is not a multiple of 32 for MiniMax-H3 (16 per latent cell × 2 per "
                                "patch)", f"use {name} {side // 32 * 32 or 32} or {(side // 32 + 1) * 32}")
        if frames < 5 or (frames - 5) % 17:
            low = max(5, 5 + (frames - 5) // 17 * 17)
            raise UserError(f"frames {frames} is not 5 + a multiple of 17 (the MiniMax-H3 VAE's frame groups)",
                            f"use frames {low} or {low + 17}")

    def audio_frames(self, frames: int, frame_rate: float = FPS) -> int:
        """The audio latent's length for ``frames`` video frames at 24 fps (EmptyMiniMaxH3LatentAV)."""
        return round(frames / FPS * AUDIO_LATENTS_PER_SECOND)


@dataclass
class Layout:
    """One model call's packed sequence: [text (L rows) | keyframes (K·n rows) | audio (2·Ta rows) | video (N rows)]."""

    text: int
    keyframes: int
    audio: int
    video: int


class MiniMaxH3Model(DiffusionModel):
    """A loaded MiniMax-H3 transformer."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # where sequence parallelism cuts the packed sequence and gathers the heads' outputs (the sequence plan)
        for name in ("packed_tokens", "packed_positions", "adaln_rows", "timestep_rows", "packed_output"):
            setattr(transformer, name, torch.nn.Identity())
        self.shift = SHIFT_VIDEO  # the running generation's video shift (predict_x0): the audio's σ and k follow
        self.seed = 0  # and its seed: the keyframes' noise's
        self._refined = PerConditioning()  # context → its refined text (self._refine), once per tensor

    @property
    def width(self) -> int:
        return self.transformer.config.hidden_size

    def predict_x0(self, x, sigma, cond, gen):
        self.shift, self.seed = gen.sampling.shift, gen.seed  # the keyframes' noise is seeded by the generation's
        return super().predict_x0(x, sigma, cond, gen)

    def output(self, x, timestep, cond, guidance):
        """The velocities of (video [B, 24, T, h, w], carried audio y [B, 32, 2, Ta]) at σ = ``timestep`` / 1000 [B]
        (one σ for every row), as ComfyUI's MiniMax-H3 model computes them."""
        t = self.transformer
        video, carried = x
        b, channels, frames, h, w = video.shape
        sigma_v = timestep.to(self.device, torch.float32) / 1000
        if bool((sigma_v != sigma_v[0]).any()):
            raise UserError("MiniMax-H3 packs one sequence for every row: its rows must share one noise level",
                            "sample the rows of a batch together")
        sigma_v = sigma_v[0].clamp(min=1e-6)
        sigma_a = time_shift_sigma(sigma_v, self.shift, SHIFT_AUDIO)
        k = self.shift / SHIFT_AUDIO
        audio = carried.to(self.device, torch.float32) * (sigma_a / sigma_v)  # x_a = y·σa/σv, [B, 32, 2, Ta]
        text = self._refined.get(cond["context"], self._refine)  # [B, L, D]
        keyframes, keyframe_frames = self._keyframes(cond, h, w)  # [B, K·n, 96], [K]
        layout = Layout(text.shape[1], keyframes.shape[1], STEREO * audio.shape[3], frames * (h // 2) * (w // 2))
        tags = self._tags(cond.get("text_token_tags"), layout)  # [S]
        times = torch.stack([1 - sigma_v, 1 - sigma_a, (1 - sigma_v).clamp(min=KEYFRAME_AUG)])  # t_v, t_a, the keys'
        unique, time_index = torch.unique(times, sorted=True, return_inverse=True)  # [M], [3]
        row_time = torch.cat([time_index[0].repeat(layout.text), time_index[2].repeat(layout.keyframes),
                              time_index[1].repeat(layout.audio), time_index[0].repeat(layout.video)])  # [S]
        temb = self._time_embedding(unique)  # [M, Dt]
        video_rows = torch.cat([keyframes, self._patchify(video)], dim=1)  # [B, K·n + N, 24·4]
        audio_rows = audio.permute(0, 2, 3, 1).reshape(b, layout.audio, AUDIO_CHANNELS)  # [B, 2·Ta, 32]
        video_in = t.proj_in(video_rows.to(t.proj_in.weight.dtype)).to(self.dtype)
        packed = torch.cat([text, video_in[:, :layout.keyframes],
                            t.audio_proj_in(audio_rows.to(t.audio_proj_in.weight.dtype)).to(self.dtype),
                            video_in[:, layout.keyframes:]], dim=1)  # [B, S, D]
        hidden = t.packed_tokens(packed)  # [B, n, D]: this rank's rows
        positions = self._positions(layout, frames, h, w, keyframe_frames)
        rope = t.rope(t.packed_positions(positions))  # cos, sin [n, 2·3·f]
        rows = t.adaln_rows(row_time * 3 + tags)  # [n]
        for block in t.transformer_blocks:
            hidden = block(hidden, temb, rows, rope)
        out = t.norm_out(hidden, temb, t.timestep_rows(row_time)).float()  # [B, n, D]
        heads = t.packed_output(torch.cat([t.proj_out(out.to(t.proj_out.weight.dtype)).float(),
                                           t.audio_proj_out(out.to(t.audio_proj_out.weight.dtype)).float()], dim=-1))
        first_audio = layout.text + layout.keyframes
        video_out = -heads[:, first_audio + layout.audio:, :channels * 4]  # [B, N, 96]: the sampler's sign
        audio_out = -heads[:, first_audio:first_audio + layout.audio, channels * 4:]  # [B, 2·Ta, 32]
        audio_out = audio_out.reshape(b, STEREO, -1, AUDIO_CHANNELS).permute(0, 3, 1, 2)  # [B, 32, 2, Ta]
        carried_out = (1 - k) * audio + (1 + (k - 1) * sigma_a) * audio_out  # the velocity of y
        return self._unpatchify(video_out, video.shape), carried_out

    def _time_embedding(self, unique: torch.Tensor) -> torch.Tensor:
        """The distinct timesteps' embedding [M, Dt], cast to the model's dtype before the AdaLN's SiLU as ComfyUI casts
        it; a curve-form model's interpolated from its table, kept float32 (model.py never downcasts it)."""
        t = self.transformer
        if isinstance(t.time_embedder, CurveTable):
            return t.time_embedder(unique.to(self.device))
        return t.time_embedder(t.time_proj(unique).to(self.device, torch.float32)).to(self.dtype)

    def _refine(self, context: torch.Tensor) -> torch.Tensor:
        """The text's rows [B, L, D]: Qwen3-VL's states projected and refined (ComfyUI's preprocess_text_embeds);
        through ``self._refined``, once per conditioning tensor."""
        t = self.transformer
        text = t.token_refiner(t.context_embedder(context.to(self.device, t.context_embedder.weight.dtype)))
        return text.to(self.dtype)

    def _keyframes(self, cond: dict, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MiniMaxH3ImageToVideo's keyframes as conditioning rows: each one-frame latent [B, 24, 1, h, w] patchified,
        0.999·z + 0.001·noise with the noise drawn from the generation's seed, alike for every keyframe and call
        (model.py: a CPU generator seeded anew for each): [B, K·n, 96] and their pixel frame indices [K]."""
        latents = cond.get("keyframe_latents")
        if latents is None or latents.shape[2] == 0:
            return torch.zeros(cond["context"].shape[0], 0, 96, device=self.device), torch.zeros(0)
        frames = cond["keyframe_frames"]
        if tuple(latents.shape[3:]) != (h, w) or bool((frames != frames[:1]).any()):
            raise UserError(f"MiniMax-H3 keyframes of {latents.shape[3]}×{latents.shape[4]} latent cells for a "
                            f"{h}×{w} latent, or rows that put them at different frames",
                            "make the keyframes with MiniMaxH3ImageToVideo at the latent's size")
        rows = []
        for k in range(latents.shape[2]):
            z = self._patchify(latents[:, :, k:k + 1].to(self.device, torch.float32))  # [B, n, 96]
            noise = torch.randn(z.shape[1:], generator=torch.Generator().manual_seed(self.seed)).to(z)
            rows.append(KEYFRAME_AUG * z + (1 - KEYFRAME_AUG) * noise)
        return torch.cat(rows, dim=1), frames[0].float()

    def _tags(self, text_tags: torch.Tensor | None, layout: Layout) -> torch.Tensor:
        """Each row's modality [S]: the text's own tags (1, or 0 for an image's vision tokens), then the keyframes
        (video), the audio, the video."""
        if text_tags is None:
            text = torch.full((layout.text,), TEXT, device=self.device)
        else:
            if bool((text_tags != text_tags[:1]).any()):
                raise UserError("the rows of one MiniMax-H3 call carry different text token tags",
                                "sample prompts with different images apart")
            text = text_tags[0].to(self.device).round().long()
        return torch.cat([text, torch.full((layout.keyframes,), VIDEO, device=self.device),
                          torch.full((layout.audio,), AUDIO, device=self.device),
                          torch.full((layout.video,), VIDEO, device=self.device)]).long()

    def _positions(self, layout: Layout, frames: int, h: int, w: int, keyframe_frames: torch.Tensor) -> torch.Tensor:
        """Each row's (t, h, w) position [S, 3] (model.py PackedLayout, float64 then float32): a keyframe's rows on
        the frame grid at 5/3 per pixel frame of its index."""
        rows, columns = frame_grid(h, w)
        grid_rows, grid_columns = torch.meshgrid(rows, columns, indexing="ij")  # [h/2, w/2] each
        keys = [torch.stack([torch.full_like(grid_rows, layout.text + TIME_PER_FRAME * float(frame)), grid_rows,
                             grid_columns], dim=-1).reshape(-1, 3) for frame in keyframe_frames.tolist()]
        index = torch.arange(layout.text, dtype=torch.float64)
        text = torch.stack([index, torch.zeros_like(index), torch.zeros_like(index)], dim=1)  # (i, 0, 0)
        steps = layout.audio // STEREO
        audio_t = layout.text + torch.arange(steps, dtype=torch.float64).repeat(STEREO)  # channel 0's, then 1's
        audio_w = torch.cat([columns[:1].expand(steps), columns[-1:].expand(steps)])
        audio = torch.stack([audio_t, torch.zeros_like(audio_t), audio_w], dim=1)
        f, r, c = torch.meshgrid(layout.text + frame_times(frames), rows, columns, indexing="ij")
        video = torch.stack([f, r, c], dim=-1).reshape(-1, 3)
        return torch.cat([text, *keys, audio, video]).to(self.device, torch.float32)  # [S, 3]

    @staticmethod
    def _patchify(video: torch.Tensor) -> torch.Tensor:
        """[B, C, T, h, w] → [B, T·(h/2)·(w/2), C·1·2·2] (rows frame-major, features channel-major)."""
        b, c, frames, h, w = video.shape
        x = video.reshape(b, c, frames, 1, h // 2, 2, w // 2, 2)
        return torch.einsum("nctrhpwq->nthwcrpq", x).reshape(b, frames * (h // 2) * (w // 2), c * 4)

    @staticmethod
    def _unpatchify(rows: torch.Tensor, shape: tuple) -> torch.Tensor:
        b, c, frames, h, w = shape
        x = rows.reshape(b, frames, h // 2, w // 2, c, 1, 2, 2)
        return torch.einsum("nthwcrpq->nctrhpwq", x).reshape(b, c, frames, h, w)
