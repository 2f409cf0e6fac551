"""LTX-2 (video with audio, ComfyUI's LTXAV on diffusers' modules): both outputs of every layout equal serial's,
the audio and the video really attend to each other, and image to video (LTXVImgToVideo's noise mask: a timestep
per token) keeps its fixed frame."""

import json
import math

import pytest
import torch
from parity import assert_parts_equal, bound, serial_parts

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

# 160 × 96 px × 17 frames: 3 × 3 × 5 = 45 video tokens (no degree below divides them: padded shares) and 17 audio
# latent frames (25 fps); cfg 3 with the built-in's seeded negative
LTX23 = {"model": "ltx2-tiny", "width": 160, "height": 96, "frames": 17, "steps": 3, "seed": 7, "cfg": 3.0}
EVEN = {**LTX23, "width": 128, "height": 128}  # 3 × 4 × 4 = 48 video tokens: every degree divides them
LTX20 = {**EVEN, "model": "ltx2.0-tiny"}
BATCH = {**EVEN, "batch": 2}


def image_to_video() -> dict:
    """LTXVImgToVideo's LATENT for EVEN: an encoded start image in the first latent frame, noise mask 0 there (strength
    1), 1 elsewhere: [1, 1, F, 1, 1]."""
    generator = torch.Generator().manual_seed(4)
    latent = torch.zeros(1, 128, 3, 4, 4)
    latent[:, :, :1] = torch.randn(1, 128, 1, 4, 4, generator=generator)
    mask = torch.ones(1, 1, 3, 1, 1)
    mask[:, :, :1] = 0.0
    return {"latent": latent, "noise_mask": mask}


ROWS = [
    *((LTX23, world, degrees) for world, degrees in [
        (2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (4, {"ulysses": 2, "ring": 2}), (4, {"ulysses": 4})]),
    (EVEN, 2, {"ulysses": 2}),
    (EVEN, 4, {"cfg": 2, "ring": 2}),
    (LTX20, 2, {"ring": 2}),
    (BATCH, 2, {"dp": 2}),
    (EVEN, 2, {"ulysses": 2, "shard_weights": True}),
]


@pytest.mark.parametrize("fields,world,degrees", [
    pytest.param(*row, id=f"{row[0]['model']}-{row[0]['width']}x{row[0]['height']}-b{row[0].get('batch', 1)}-world"
                 f"{row[1]}-" + "x".join(f"{k}{v}" for k, v in row[2].items())) for row in ROWS])
def test_video_and_audio_equal_serial(fields, world, degrees, backend):
    expected = serial_parts(fields)
    result, info = backend(world).sample({**fields, "parallel": degrees})
    assert info["world_size"] == world
    assert_parts_equal(result, expected)


def test_a_guide_frame_equals_serial(backend):
    """LTXVAddGuide's frame appended to the latent (a noise mask 0 on it), its positions from keyframe_idxs on both
    prompts: cut with the video tokens under Ulysses × Ring."""
    generator = torch.Generator().manual_seed(6)
    latent = torch.zeros(1, 128, 4, 4, 4)  # EVEN's 3 frames and the guide's
    latent[:, :, 3:] = torch.randn(1, 128, 1, 4, 4, generator=generator)
    mask = torch.ones(1, 1, 4, 1, 1)
    mask[:, :, 3:] = 0.0
    keyframes = guide_positions(frame=9, rows=4, columns=4)
    fields = {**EVEN, "frames": 25}  # the latent's 4 frames
    tensors = {"latent": latent, "noise_mask": mask, "keyframe_idxs": keyframes, "negative_keyframe_idxs": keyframes}
    g = torch.Generator().manual_seed(2)
    tensors.update(context=torch.randn(1, 8, 96, generator=g), negative_context=torch.randn(1, 8, 96, generator=g))
    expected = serial_parts(fields, tensors)
    without = serial_parts(fields, {k: v for k, v in tensors.items() if "keyframe" not in k})
    assert (expected["samples"] - without["samples"]).abs().max() > 1e-3  # the positions matter
    result, _ = backend(4).sample({**fields, "parallel": {"ulysses": 2, "ring": 2}}, tensors)
    assert_parts_equal(result, expected)


def test_image_to_video_equals_serial_and_keeps_its_frame(backend):
    """A timestep per video token (0 on the start frame) cut with the tokens; the start frame comes back as given."""
    tensors = image_to_video()
    expected = serial_parts(EVEN, tensors)
    assert (expected["samples"][:, :, :1] - tensors["latent"][:, :, :1]).abs().max() < 1e-5  # the sampler's rounding
    assert (expected["samples"][:, :, 1:] - tensors["latent"][:, :, 1:]).abs().max() > 0.1  # the rest is made
    result, _ = backend(2).sample({**EVEN, "parallel": {"ulysses": 2}}, tensors)
    assert_parts_equal(result, expected)


# ComfyUI's LTXAV forward restated (Comfy-Org/ComfyUI 0a29ddae comfy/ldm/lightricks/av_model.py, model.py e03185cf,
# embeddings_connector.py), written out here apart from models/ltx2.py on the same weights: split RoPE from pixel
# positions, q/k RMSNorm eps 1e-5, per-head gates, the connectors' registers, the cross-modal gates from the other
# stream's largest timestep, video-to-audio reading the video after audio-to-video.

def rms(x, weight=None, eps=1e-6):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def split_rope(grid: torch.Tensor, dim: int, max_pos: list, heads: int):
    """cos, sin [B, H, N, dim/(2H)] for positions ``grid`` [B, axes, N] (ComfyUI's generate_freqs, split_freqs_cis)."""
    fractions = torch.stack([grid[:, i] / max_pos[i] for i in range(len(max_pos))], dim=-1)  # [B, N, axes]
    indices = (10000.0 ** torch.linspace(0, 1, dim // (2 * len(max_pos)), dtype=torch.float64) * math.pi / 2).float()
    freqs = (indices * (fractions.unsqueeze(-1) * 2 - 1)).transpose(-1, -2).flatten(2)  # [B, N, axes · k]
    pad = dim // 2 - freqs.shape[-1]
    cos = torch.cat([torch.ones_like(freqs[..., :pad]), freqs.cos()], dim=-1)
    sin = torch.cat([torch.zeros_like(freqs[..., :pad]), freqs.sin()], dim=-1)
    return tuple(t.reshape(*t.shape[:2], heads, -1).transpose(1, 2) for t in (cos, sin))


def rotate(x: torch.Tensor, rope) -> torch.Tensor:
    cos, sin = rope  # [B, H, N, d/2]
    x = x.unflatten(2, (cos.shape[1], -1)).transpose(1, 2)  # [B, H, N, d]
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1).transpose(1, 2).flatten(2)


def attend(attn, x, context=None, pe=None, k_pe=None):
    """ComfyUI's CrossAttention: q/k RMSNorm (eps 1e-5), RoPE, attention, the optional per-head gate, out."""
    context = x if context is None else context
    q = rms(attn.to_q(x), attn.norm_q.weight, 1e-5)
    k = rms(attn.to_k(context), attn.norm_k.weight, 1e-5)
    if pe is not None:
        q, k = rotate(q, pe), rotate(k, pe if k_pe is None else k_pe)
    heads = attn.heads
    q, k, v = (t.unflatten(2, (heads, -1)).transpose(1, 2) for t in (q, k, attn.to_v(context)))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)  # [B, N, H, d]
    if attn.to_gate_logits is not None:
        out = out * (2 * torch.sigmoid(attn.to_gate_logits(x))).unsqueeze(-1)
    return attn.to_out[0](out.flatten(2))


def values(table, temb, rows):
    b, n = temb.shape[:2]
    return (table[rows][None, None] + temb.reshape(b, n, table.shape[0], -1)[:, :, rows]).unbind(2)


def connect(connector, x):
    b, length, width = x.shape
    total = max(1024, length)
    registers = connector.learnable_registers.repeat(total // 128 + 1, 1)[length:total]
    h = torch.cat([x, registers[None].expand(b, -1, -1)], dim=1)
    pe = split_rope(torch.arange(total, dtype=torch.float32)[None, None].expand(b, 1, -1), width, [4096],
                    connector.num_attention_heads)
    for block in connector.transformer_blocks:
        h = h + attend(block.attn1, rms(h), pe=pe)
        h = h + block.ff(rms(h))
    return rms(h)


def comfy_ltxav(t, video, audio, sigma, context, mask=None, rate=25.0, keyframes=None, stg_blocks=(), isolated=False):
    """ComfyUI's LTXAVModel forward for LTX-2.3 (split RoPE, gates, the text's modulation): (video, audio) velocity.
    ``stg_blocks``: their self-attention a value passthrough (stg_skip_self_attn); ``isolated``: no a2v / v2a."""
    b, channels, frames, h, w = video.shape
    T = audio.shape[2]
    if mask is None:
        v_t, a_t = sigma * 1000, sigma * 1000
    else:  # process_timestep: (mask · σ) per token
        v_t = (mask.expand(b, 1, frames, h, w) * sigma.view(b, 1, 1, 1, 1)).reshape(b, -1) * 1000
        a_t = (sigma.view(b, 1) * torch.ones(b, T)) * 1000
    f, rr, cc = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    grid = torch.stack([f, rr, cc]).flatten(1).float()  # [3, N]
    scale = torch.tensor([8.0, 32.0, 32.0])[:, None]
    start, end = grid * scale, (grid + 1) * scale
    start[0], end[0] = (start[0] - 7).clamp(min=0), (end[0] - 7).clamp(min=0)  # the causal fix
    if keyframes is not None:  # _process_input: the last tokens' pixel positions are the guides'
        start[:, -keyframes.shape[2]:], end[:, -keyframes.shape[2]:] = keyframes[0, ..., 0], keyframes[0, ..., 1]
    start[0], end[0] = start[0] / rate, end[0] / rate  # seconds
    v_mid = ((start + end) / 2)[None].expand(b, -1, -1)  # [B, 3, N]
    i = torch.arange(T).float()
    a_mid = ((((4 * i - 3).clamp(min=0) + (4 * i + 1).clamp(min=0)) / 2) * 0.01)[None, None].expand(b, 1, -1)
    c = t.config
    heads, a_heads = c.num_attention_heads, c.audio_num_attention_heads
    width, a_width = heads * c.attention_head_dim, a_heads * c.audio_attention_head_dim
    v_pe = split_rope(v_mid, width, [20, 2048, 2048], heads)
    a_pe = split_rope(a_mid, a_width, [20], a_heads)
    v_cross_pe = split_rope(v_mid[:, :1], c.audio_cross_attention_dim, [20], a_heads)
    a_cross_pe = split_rope(a_mid, c.audio_cross_attention_dim, [20], a_heads)

    def embed(module, ts):
        out, embedded = module(ts.flatten(), batch_size=b, hidden_dtype=torch.float32)
        return out.view(b, -1, out.shape[-1]), embedded.view(b, -1, embedded.shape[-1])

    v_temb, v_emb = embed(t.time_embed, v_t)
    a_temb, a_emb = embed(t.audio_time_embed, a_t)
    v_ss, a_ss = embed(t.av_cross_attn_video_scale_shift, v_t)[0], embed(t.av_cross_attn_audio_scale_shift, a_t)[0]
    factor = c.cross_attn_timestep_scale_multiplier / 1000
    v_gate = embed(t.av_cross_attn_video_a2v_gate, a_t.max().expand_as(v_t.flatten()) * factor)[0]
    a_gate = embed(t.av_cross_attn_audio_v2a_gate, v_t.max().expand_as(a_t.flatten()) * factor)[0]
    v_prompt = embed(t.prompt_adaln, v_t.max(dim=1).values if v_t.dim() > 1 else v_t)[0]
    a_prompt = embed(t.audio_prompt_adaln, a_t.max(dim=1).values if a_t.dim() > 1 else a_t)[0]
    v_ctx = connect(t.video_embeddings_connector, context[..., :width])
    a_ctx = connect(t.audio_embeddings_connector, context[..., width:])
    vx = t.proj_in(video.flatten(2).transpose(1, 2))
    ax = t.audio_proj_in(audio.permute(0, 2, 1, 3).flatten(2))

    def text(x, ctx, attn, table, temb, prompt_table, prompt_temb):
        shift_q, scale_q, gate = values(table, temb, slice(6, 9))
        shift_kv, scale_kv = values(prompt_table, prompt_temb, slice(None))
        return attend(attn, rms(x) * (1 + scale_q) + shift_q, ctx * (1 + scale_kv) + shift_kv) * gate

    def self_attend(attn, x, pe, index):
        if index not in stg_blocks:
            return attend(attn, x, pe=pe)
        v = attn.to_v(x).unflatten(2, (attn.heads, -1))  # [B, N, H, d]: the value passthrough
        if attn.to_gate_logits is not None:
            v = v * (2 * torch.sigmoid(attn.to_gate_logits(x))).unsqueeze(-1)
        return attn.to_out[0](v.flatten(2))

    for index, block in enumerate(t.transformer_blocks):
        shift, scale, gate = values(block.scale_shift_table, v_temb, slice(0, 3))
        vx = vx + self_attend(block.attn1, rms(vx) * (1 + scale) + shift, v_pe, index) * gate
        vx = vx + text(vx, v_ctx, block.attn2, block.scale_shift_table, v_temb, block.prompt_scale_shift_table,
                       v_prompt)
        shift, scale, gate = values(block.audio_scale_shift_table, a_temb, slice(0, 3))
        ax = ax + self_attend(block.audio_attn1, rms(ax) * (1 + scale) + shift, a_pe, index) * gate
        ax = ax + text(ax, a_ctx, block.audio_attn2, block.audio_scale_shift_table, a_temb,
                       block.audio_prompt_scale_shift_table, a_prompt)
        if not isolated:  # LTXVModalityGuidance's pass: transformer_options a2v_cross_attn = v2a_cross_attn = False
            a_norm = rms(ax)
            a_tab, v_tab = block.audio_a2v_cross_attn_scale_shift_table, block.video_a2v_cross_attn_scale_shift_table
            a_sc, a_sh = values(a_tab[:4], a_ss, slice(0, 2))
            v_sc, v_sh = values(v_tab[:4], v_ss, slice(0, 2))
            vx = vx + attend(block.audio_to_video_attn, rms(vx) * (1 + v_sc) + v_sh, a_norm * (1 + a_sc) + a_sh,
                             pe=v_cross_pe, k_pe=a_cross_pe) * values(v_tab[4:], v_gate, slice(None))[0]
            a_sc, a_sh = values(a_tab[:4], a_ss, slice(2, 4))
            v_sc, v_sh = values(v_tab[:4], v_ss, slice(2, 4))
            ax = ax + attend(block.video_to_audio_attn, a_norm * (1 + a_sc) + a_sh, rms(vx) * (1 + v_sc) + v_sh,
                             pe=a_cross_pe, k_pe=v_cross_pe) * values(a_tab[4:], a_gate, slice(None))[0]
        shift, scale, gate = values(block.scale_shift_table, v_temb, slice(3, 6))
        vx = vx + block.ff(rms(vx) * (1 + scale) + shift) * gate
        shift, scale, gate = values(block.audio_scale_shift_table, a_temb, slice(3, 6))
        ax = ax + block.audio_ff(rms(ax) * (1 + scale) + shift) * gate

    def out(x, table, emb, proj):
        shift, scale = (table[None, None] + emb[:, :, None]).unbind(2)
        return proj(torch.nn.functional.layer_norm(x, (x.shape[-1],), eps=1e-6) * (1 + scale) + shift)

    v = out(vx, t.scale_shift_table, v_emb, t.proj_out).transpose(1, 2).reshape(video.shape)
    a = out(ax, t.audio_scale_shift_table, a_emb, t.audio_proj_out).unflatten(2, (8, 16)).permute(0, 2, 1, 3)
    return v, a


@pytest.fixture(scope="module")
def ltx23():
    return registry.build("ltx2-tiny", torch.device("cpu"))


def guide_positions(frame: int = 17, rows: int = 2, columns: int = 3) -> torch.Tensor:
    """LTXVAddGuide's keyframe_idxs for one guide frame at pixel frame ``frame`` over a rows × columns latent:
    [1, 3, rows·columns, 2] (its add_keyframe_index: the cells' pixel bounds, time shifted to the frame)."""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    cells = torch.stack([torch.zeros_like(r), r, c]).flatten(1).float()  # [3, n]
    scale = torch.tensor([8.0, 32.0, 32.0])[:, None]
    start, end = cells * scale, (cells + 1) * scale
    start[0], end[0] = frame, frame + 1  # a one-frame guide (causal: one pixel frame)
    return torch.stack([start, end], dim=-1)[None]


@pytest.mark.parametrize("masked", [False, True, "guide"], ids=["text-to-video", "image-to-video", "guide"])
def test_the_model_is_comfyuis_ltxav(ltx23, masked):
    """The wrapper's forward equals ComfyUI's LTXAV restated, at a frame rate of 24, under LTXVImgToVideo's mask,
    and with an LTXVAddGuide guide frame appended (its positions from keyframe_idxs, its mask 0)."""
    generator = torch.Generator().manual_seed(1)
    video, audio = torch.randn(1, 128, 3, 2, 3, generator=generator), torch.randn(1, 8, 13, 16, generator=generator)
    context = torch.randn(1, 9, ltx23.spec.context_dim, generator=generator)
    sigma = torch.tensor([0.6])
    mask = torch.tensor([0.0, 1.0, 1.0] if masked is True else [1.0, 1.0, 0.0]).view(1, 1, 3, 1, 1) if masked else None
    keyframes = guide_positions() if masked == "guide" else None
    cond = {"context": context, "frame_rate": torch.tensor([24.0])}
    if keyframes is not None:
        cond["keyframe_idxs"] = keyframes
    if masked:  # the packed mask the sampler puts on the conditioning: the video's, then the audio's (ones)
        video_mask = mask.expand(1, 128, 3, 2, 3).reshape(1, -1)
        cond["denoise_mask"] = torch.cat([video_mask, torch.ones(1, audio[0].numel())], dim=1)
    with torch.no_grad():
        ours = ltx23.output((video, audio), sigma, cond, None)
        theirs = comfy_ltxav(ltx23.transformer, video, audio, sigma, context, mask, rate=24.0, keyframes=keyframes)
    for mine, want, name in zip(ours, theirs, ("video", "audio")):
        assert (mine - want).abs().max() < 1e-5, name


def test_the_streams_attend_to_each_other(ltx23):
    """Joint for real: another audio input changes the video's output, and another video the audio's."""
    generator = torch.Generator().manual_seed(2)
    video, audio = torch.randn(1, 128, 3, 2, 2, generator=generator), torch.randn(1, 8, 9, 16, generator=generator)
    cond = {"context": torch.randn(1, 5, ltx23.spec.context_dim, generator=generator)}
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        v, a = ltx23.output((video, audio), sigma, cond, None)
        v_other_audio, _ = ltx23.output((video, audio.flip(2)), sigma, cond, None)
        _, a_other_video = ltx23.output((video.flip(2), audio), sigma, cond, None)
    assert (v - v_other_audio).abs().max() > 1e-3
    assert (a - a_other_video).abs().max() > 1e-3


def test_noise_is_drawn_part_by_part_as_comfyui_draws_it():
    """comfy/sample.py prepare_noise on a NestedTensor: one generator seeded once, video noise then audio."""
    from xdit_backend.sampling.packed import LatentParts

    parts = LatentParts(((128, 2, 3, 4), (8, 5, 16)))
    generator = torch.manual_seed(11)  # ComfyUI reseeds the global generator
    video, audio = torch.randn(1, 128, 2, 3, 4, generator=generator), torch.randn(1, 8, 5, 16, generator=generator)
    assert torch.equal(parts.noise(1, 11), parts.pack([video, audio]))


# A file as Lightricks writes it: their module names (patchify_proj, adaln_single, av_ca_*_adaln_single, q_norm, the
# connectors' transformer_1d_blocks, …) and the config ComfyUI reads from its metadata (comfy/model_detection.py).
LTX23_METADATA = {"cross_attention_adaln": True, "apply_gated_attention": True, "caption_proj_before_connector": True,
                  "caption_projection_first_linear": False, "rope_type": "split", "frequencies_precision": "float64",
                  "use_middle_indices_grid": True, "causal_temporal_positioning": True,
                  "av_ca_timestep_scale_multiplier": 1000.0, "num_attention_heads": 4, "attention_head_dim": 16,
                  "audio_num_attention_heads": 4, "audio_attention_head_dim": 8,
                  "connector_num_layers": 2, "connector_apply_gated_attention": True,
                  "connector_num_attention_heads": 4, "connector_attention_head_dim": 16,
                  "audio_connector_num_attention_heads": 4, "audio_connector_attention_head_dim": 8}
RENAMED = [("proj_in.", "patchify_proj."), ("audio_proj_in.", "audio_patchify_proj."),
           ("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single."),
           ("prompt_adaln.", "prompt_adaln_single."), ("audio_prompt_adaln.", "audio_prompt_adaln_single."),
           ("av_cross_attn_video_scale_shift.", "av_ca_video_scale_shift_adaln_single."),
           ("av_cross_attn_video_a2v_gate.", "av_ca_a2v_gate_adaln_single."),
           ("av_cross_attn_audio_scale_shift.", "av_ca_audio_scale_shift_adaln_single."),
           ("av_cross_attn_audio_v2a_gate.", "av_ca_v2a_gate_adaln_single.")]


def lightricks_state_dict(transformer) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in transformer.state_dict().items():
        for ours, theirs in RENAMED:
            if key.startswith(ours):
                key = theirs + key[len(ours):]
                break
        key = (key.replace("video_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_video")
               .replace("audio_a2v_cross_attn_scale_shift_table", "scale_shift_table_a2v_ca_audio")
               .replace(".norm_q.", ".q_norm.").replace(".norm_k.", ".k_norm.")
               .replace("connector.transformer_blocks.", "connector.transformer_1d_blocks."))
        out["model.diffusion_model." + key] = value.contiguous()
    return out


def test_the_lightricks_names_are_those_diffusers_converts(ltx23):
    """diffusers' own single-file converter takes the written file's transformer keys back to its names (it drops
    the connectors, which its pipeline holds; its 2.3 prompt_adaln renames are its LoRA converter's)."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    theirs = {k: v for k, v in lightricks_state_dict(ltx23.transformer).items() if "embeddings_connector" not in k
              and "prompt_adaln_single" not in k}
    converted = convert_ltx2_transformer_to_diffusers(dict(theirs))
    ours = {k for k in ltx23.transformer.state_dict() if "embeddings_connector" not in k and "prompt_adaln" not in k}
    assert set(converted) == ours


@pytest.mark.parametrize("stored", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_a_lightricks_file_loads_as_the_built_in(ltx23, tmp_path, stored):
    """Its config from the shapes and the embedded metadata, the built-in's exactly; its latents the built-in's (in
    fp8: every Linear weight stored so, each tensor the fp8-rounded one)."""
    from safetensors.torch import save_file

    path = tmp_path / "ltx-2.3-tiny.safetensors"
    weights = {key: value.to(stored) if value.dim() == 2 and "embeddings_connector.learnable" not in key else value
               for key, value in lightricks_state_dict(ltx23.transformer).items()}
    save_file(weights, str(path), metadata={"config": json.dumps({"transformer": LTX23_METADATA})})
    source = registry.resolve(str(path))
    assert source.family == "ltx2" and source.prefix == "model.diffusion_model."
    built_in = registry.BUILTINS["ltx2-tiny"].config
    for key, value in built_in.items():
        assert source.config[key] == value or key == "connector", key
    for stream in ("video", "audio"):
        assert built_in["connector"][stream].items() <= source.config["connector"][stream].items(), stream
    if stored == torch.float32:
        fields, g = {**EVEN, "steps": 2}, torch.Generator().manual_seed(2)
        tensors = {"context": torch.randn(1, 8, 96, generator=g),
                   "negative_context": torch.randn(1, 8, 96, generator=g)}
        assert torch.equal(serial_latent({**fields, "model": str(path)}, tensors), serial_latent(fields, tensors))
        return
    loaded = registry.build(str(path), torch.device("cpu")).transformer.state_dict()
    for key, value in ltx23.transformer.state_dict().items():
        want = value.to(stored).float() if value.dim() == 2 and "learnable" not in key else value
        assert torch.equal(loaded[key].float(), want), key


def test_a_file_without_metadata_gets_comfyuis_defaults(ltx23, tmp_path):
    """As ComfyUI gives it: positions from cell starts, not causal; the cross-modal gates' scale 1; interleaved RoPE.
    A 2.3 file (gated attention) without it is refused by name: its RoPE layout and positions are only there."""
    from safetensors.torch import save_file

    from xdit_backend.models.registry import ModelError

    path = tmp_path / "bare.safetensors"
    save_file(lightricks_state_dict(registry.build("ltx2.0-tiny", torch.device("cpu")).transformer), str(path))
    config = registry.resolve(str(path)).config
    assert config["positions"] == {"causal": False, "middle": False}
    assert (config["cross_attn_timestep_scale_multiplier"], config["rope_type"]) == (1.0, "interleaved")
    assert (config["num_attention_heads"], config["attention_head_dim"]) == (32, 2)  # 64 wide: 32 heads of 2
    save_file(lightricks_state_dict(ltx23.transformer), str(tmp_path / "bare-2.3.safetensors"))
    with pytest.raises(ModelError, match="LTX-2.3 file .gated attention. without the config"):
        registry.resolve(str(tmp_path / "bare-2.3.safetensors"))


def test_a_gguf_file_reads_its_config_and_matches_the_dequantized_model(ltx23, tmp_path):
    """A Q8_0 GGUF of LTX-2.3 in city96's layout with the config in its metadata (as ComfyUI-GGUF reads it since
    city96/ComfyUI-GGUF#399): the built-in's config, and the latent of the same values dequantized."""
    pytest.importorskip("gguf")  # the optional extra "gguf" (installed in CI)
    from safetensors.torch import save_file

    from xdit_backend.selftest.files import gguf_file

    config = json.dumps({"transformer": LTX23_METADATA})
    reference = gguf_file(lightricks_state_dict(ltx23.transformer), tmp_path / "ltx-2.3-q8_0.gguf", "Q8_0",
                          plain=lambda key, value: value.dim() < 2 or "_embeddings_connector." in key,
                          metadata={"config": config})
    save_file(reference, str(tmp_path / "reference.safetensors"), metadata={"config": config})
    source = registry.resolve(str(tmp_path / "ltx-2.3-q8_0.gguf"))
    assert source.gguf and (source.config["gated_attn"], source.config["rope_type"]) == (True, "split")
    fields, g = {**EVEN, "steps": 2}, torch.Generator().manual_seed(2)
    tensors = {"context": torch.randn(1, 8, 96, generator=g), "negative_context": torch.randn(1, 8, 96, generator=g)}
    out = serial_latent({**fields, "model": source.ref}, tensors)
    want = serial_latent({**fields, "model": str(tmp_path / "reference.safetensors")}, tensors)
    assert (out - want).abs().max() <= bound(want)


def test_pipefusion_and_the_step_cache_are_refused_with_the_reason(backend):
    from xdit_backend.wire.endpoint import BackendError

    with pytest.raises(BackendError, match="video-to-audio attention reads all of the video"):
        backend(2).sample({**EVEN, "parallel": {"pipefusion": 2}})
    with pytest.raises(BackendError, match="audio stream is not cached yet"):
        backend(2).sample({**EVEN, "parallel": {"ulysses": 2}, "cache": "fbcache"})


def test_a_video_without_audio_runs_the_video_stream_alone(backend):
    """An empty audio latent (ComfyUI's LTX-2 model given a video latent alone: no audio tokens, no cross-modal
    attention): every layout gives serial's video, and no audio."""
    tensors = {"audio_latent": torch.zeros(1, 8, 0, 16)}
    expected = serial_parts(EVEN, tensors)
    assert expected["audio_samples"].shape == (1, 8, 0, 16)
    assert (expected["samples"] - serial_parts(EVEN)["samples"]).abs().max() > 1e-3  # the audio changed the video
    result, _ = backend(2).sample({**EVEN, "parallel": {"ulysses": 2}}, tensors)
    assert result["audio_samples"].shape == (1, 8, 0, 16)
    assert (result["samples"] - expected["samples"]).abs().max().item() <= bound(expected["samples"])


def test_the_audio_whole_costs_what_its_formula_says(backend):
    """bench layouts' audio column: what a rank sends with the audio, less what it sends for the video alone, is
    cost.audio_traffic's "whole" term (the video-to-audio merges), counted in the collectives."""
    from xdit_backend.distributed.cost import audio_traffic

    def sent(tensors):
        _, info = backend(2).sample({**EVEN, "parallel": {"ulysses": 2}, "profile": True}, tensors)
        return max(sum(v for k, v in r["sent_bytes"].items() if k != "control") for r in info["profile"])

    audio = sent({"audio_latent": torch.zeros(1, 8, 17, 16)}) - sent({"audio_latent": torch.zeros(1, 8, 0, 16)})
    config = registry.BUILTINS["ltx2-tiny"].config
    whole = audio_traffic(layers=2, audio_width=32, audio_heads=config["audio_num_attention_heads"], video_tokens=48,
                          audio_tokens=17, rows=2, ulysses=2, ring=1, element_bytes=4)["whole"]
    assert audio == whole * EVEN["steps"]


def test_a_lora_in_lightricks_names_patches_the_blocks_and_a_connector(ltx23, tmp_path):
    """The templates' distilled LoRA is in the original names (diffusion_model.transformer_blocks.N.attn1.to_q, …, the
    audio-to-video attention, a text connector's block): every key lands through the converter's table, and the
    outputs move."""
    from safetensors.torch import save_file

    from xdit_backend.models import lora

    g = torch.Generator().manual_seed(0)
    pairs = {"transformer_blocks.0.attn1.to_q": (64, 64), "transformer_blocks.1.audio_to_video_attn.to_k": (32, 32),
             "transformer_blocks.0.audio_ff.net.0.proj": (32, 128),
             "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_v": (64, 64)}
    state = {}
    for module, (inputs, outputs) in pairs.items():
        state[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(4, inputs, generator=g) * 0.1
        state[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(outputs, 4, generator=g) * 0.1
    path = tmp_path / "ltx-lora.safetensors"
    save_file(state, str(path))
    patched = registry.build("ltx2-tiny", torch.device("cpu"), loras=lora.parse([{"path": str(path), "strength": 1.0}]))
    assert [(r["merged_modules"], r["unmatched_keys"]) for r in patched.lora_reports] == [(4, 0)]
    video, audio = torch.randn(1, 128, 2, 2, 2, generator=g), torch.randn(1, 8, 5, 16, generator=g)
    cond = {"context": torch.randn(1, 5, 96, generator=g)}
    with torch.no_grad():
        ours = patched.output((video, audio), torch.tensor([0.5]), cond, None)
        base = ltx23.output((video, audio), torch.tensor([0.5]), cond, None)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(ours, base))


@pytest.mark.parametrize("kind", ["perturbed", "isolated"])
def test_a_guidance_pass_is_comfyuis(ltx23, kind):
    """STG's pass (block 1's self-attention, both streams, a value passthrough) and modality guidance's (no audio↔video
    attention) equal ComfyUI's LTXAV restated with stg_self_attn_blocks / a2v_cross_attn and v2a_cross_attn off."""
    from xdit_backend.sampling.guidance import Passes

    g = torch.Generator().manual_seed(3)
    video, audio = torch.randn(1, 128, 3, 2, 2, generator=g), torch.randn(1, 8, 9, 16, generator=g)
    context = torch.randn(1, 7, ltx23.spec.context_dim, generator=g)
    with torch.no_grad(), ltx23.guidance_pass(kind, Passes(stg_scale=1.0, stg_blocks=frozenset({1}))):
        ours = ltx23.output((video, audio), torch.tensor([0.4]), {"context": context}, None)
    theirs = comfy_ltxav(ltx23.transformer, video, audio, torch.tensor([0.4]), context,
                         stg_blocks=(1,) if kind == "perturbed" else (), isolated=kind == "isolated")
    with torch.no_grad():
        plain = ltx23.output((video, audio), torch.tensor([0.4]), {"context": context}, None)
    for mine, want, base in zip(ours, theirs, plain):
        assert (mine - want).abs().max() < 1e-5 and (mine - base).abs().max() > 1e-4


def test_the_passes_combine_as_comfyuis_guider_and_post_cfg_functions():
    """LTXVDualCFGGuider's per-part scales, then STG's and modality guidance's terms (nodes_lt.py's post-CFG
    functions), in x0 space."""
    from xdit_backend.sampling.guidance import Passes
    from xdit_backend.sampling.packed import LatentParts

    g = torch.Generator().manual_seed(4)
    parts = LatentParts(((2, 3), (4,)))
    c, u, p, i = (torch.randn(1, 10, generator=g) for _ in range(4))
    passes = Passes(audio_cfg=7.0, stg_scale=1.5, modality_scale=3.0)
    got = passes.combine({"cond": c, "uncond": u, "perturbed": p, "isolated": i}, 3.0, parts)
    video = u[:, :6] + (c[:, :6] - u[:, :6]) * 3.0
    audio = u[:, 6:] + (c[:, 6:] - u[:, 6:]) * 7.0
    want = torch.cat([video, audio], dim=1) + (c - p) * 1.5 + (c - i) * (3.0 - 1.0)
    assert torch.allclose(got, want, atol=1e-6)
    assert passes.extra(0.5) == ["perturbed", "isolated"]
    assert Passes(stg_scale=1.0, stg_sigmas=(0.9, 0.6)).extra(0.5) == []  # outside STG's σ range


# the guidance passes' layouts: STG on block 1 and modality guidance, the audio at its own CFG scale; four passes a step
PASSES = {"stg_scale": 1.0, "stg_blocks": "1", "modality_scale": 3.0, "audio_cfg": 6.0, "stg_end": 0.6}


@pytest.mark.parametrize("world,degrees", [(2, {"cfg": 2}), (2, {"ulysses": 2}), (4, {"cfg": 2, "ring": 2})],
                         ids=["cfg2", "ulysses2", "cfg2xring2"])
def test_the_guidance_passes_equal_serial(world, degrees, backend):
    """Up to four passes a step (cond, uncond, perturbed, isolated), over the CFG ranks two each, or one after the
    other on a sequence-parallel group: serial's video and audio."""
    fields = {**EVEN, **PASSES}
    expected = serial_parts(fields)
    plain = serial_parts(EVEN)
    assert (expected["samples"] - plain["samples"]).abs().max() > 1e-3
    result, _ = backend(world).sample({**fields, "parallel": degrees})
    assert_parts_equal(result, expected)


def test_the_connectors_run_once_per_side_while_the_passes_alternate(monkeypatch):
    """Under the guidance passes each side is a model call of its own (cond, uncond, perturbed, isolated: the sides
    alternate at every step), yet the text connectors run once per side for the whole generation; the latent is the
    one made with them run at every call."""
    from xdit_backend.models.base import PerConditioning

    model = registry.build("ltx2-tiny", torch.device("cpu"))
    runs = []
    model.transformer.video_embeddings_connector.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args: runs.append(args[0].shape))
    fields = {**EVEN, **PASSES}
    kept = serial_latent(fields, model=model)
    assert len(runs) == 2  # the positive side and the negative
    monkeypatch.setattr(PerConditioning, "get", lambda self, tensor, derive: derive(tensor))
    runs.clear()
    every_call = serial_latent(fields, model=model)
    assert len(runs) > 2 * fields["steps"]  # four passes a step at first, two once STG has ended
    assert torch.equal(kept, every_call)


def test_guidance_passes_are_refused_on_another_family_and_off_the_blocks(backend):
    from xdit_backend.wire.endpoint import BackendError

    with pytest.raises(BackendError, match="has no such guidance"):
        backend(2).sample({"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "stg_scale": 1.0})
    with pytest.raises(BackendError, match="has blocks 0 to 1"):
        backend(2).sample({**EVEN, "stg_scale": 1.0, "stg_blocks": "29"})
