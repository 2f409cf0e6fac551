"""MiniMax-H3 (video with audio in one packed sequence, ComfyUI's MiniMaxH3Model on diffusers' modules): both outputs
of every layout equal serial's, the packed sequence's rows cut alike (text, audio and video rows, positions, AdaLN
rows), the audio carried at its own σ as ComfyUI's ModelSamplingAV carries it."""

import math

import pytest
import torch
from parity import assert_parts_equal, serial_parts

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

# 128 × 64 px × 22 frames: 7 latent frames of 2 × 4 tokens (56 video rows), 37 audio frames (74 rows, stereo) and 8
# text rows: 138 rows, which no degree below divides by 4 (padded shares); cfg 3 with the built-in's negative
H3 = {"model": "minimax-h3-tiny", "width": 128, "height": 64, "frames": 22, "steps": 3, "seed": 7, "cfg": 3.0}
PRUNED = {**H3, "model": "minimax-h3-pruned-tiny"}  # the curve form of a pruned file (its time table, AdaLN rank 8)


ROWS = [(H3, 2, {"ulysses": 2}), (H3, 2, {"ring": 2}), (H3, 2, {"cfg": 2}), (H3, 4, {"ulysses": 2, "ring": 2}),
        (H3, 4, {"ulysses": 4}), ({**H3, "batch": 2}, 2, {"dp": 2}),
        (H3, 2, {"ulysses": 2, "shard_weights": True}), (PRUNED, 2, {"ulysses": 2})]


@pytest.mark.parametrize("fields,world,degrees", [
    pytest.param(*row, id=f"{row[0]['model']}-b{row[0].get('batch', 1)}-world{row[1]}-"
                 + "x".join(f"{k}{v}" for k, v in row[2].items()))
    for row in ROWS])
def test_video_and_audio_equal_serial(fields, world, degrees, backend):
    expected = serial_parts(fields)
    result, info = backend(world).sample({**fields, "parallel": degrees})
    assert info["world_size"] == world
    assert_parts_equal(result, expected)


# ComfyUI's MiniMaxH3Model forward restated (Comfy-Org/ComfyUI comfy/ldm/minimax/model.py 01a56b76, model_base.py
# 094c74c1 MiniMaxH3, model_sampling.py 2fd20839 ModelSamplingAV), apart from models/minimax_h3.py, on the same weights:
# the packed layout, the rows' tags, timesteps and positions, the audio carried at its own σ, the negated velocity.

def comfy_h3(t, video, carried, sigma_v, context, tags=None, keyframes=(), seed=0):
    """``keyframes``: (pixel frame, latent [1, 24, 1, h, w]) pairs: MiniMaxH3ImageToVideo's first and last frame."""
    b, c, frames, h, w = video.shape
    steps = carried.shape[-1]
    base = sigma_v / (12 + sigma_v * (1 - 12))
    sigma_a = 3 * base / (1 + 2 * base)  # the audio's σ: shift 3 at the video's base time
    k = 12 / 3
    audio = carried * sigma_a / sigma_v
    text = t.token_refiner(t.context_embedder(context))
    length = text.shape[1]
    tags = torch.ones(length, dtype=torch.long) if tags is None else tags[0].long()
    v_rows = frames * (h // 2) * (w // 2)
    k_rows = len(keyframes) * (h // 2) * (w // 2)
    tag = torch.cat([tags, torch.zeros(k_rows, dtype=torch.long), torch.full((2 * steps,), 2),
                     torch.zeros(v_rows, dtype=torch.long)])
    t_v, t_a = 1 - sigma_v, 1 - sigma_a
    t_k = max(float(t_v), 0.999)  # VISUAL_COND_TIMESTEP
    unique = sorted({float(t_v), float(t_a), t_k})
    index = {value: i for i, value in enumerate(unique)}
    row_t = torch.tensor([index[float(t_v)]] * length + [index[t_k]] * k_rows + [index[float(t_a)]] * 2 * steps
                         + [index[float(t_v)]] * v_rows)
    if hasattr(t.time_embedder, "table"):  # a pruned file's curve form: the table read by linear interpolation
        table = t.time_embedder.table
        position = torch.tensor(unique).clamp(0, 1) * (table.shape[0] - 1)
        lower = position.floor().long().clamp(max=table.shape[0] - 2)
        temb = table[lower] + (position - lower)[:, None] * (table[lower + 1] - table[lower])
        activation = torch.nn.Identity()  # the AdaLN projections run on it without SiLU
    else:
        half = t.config.freq_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
        angle = torch.tensor(unique)[:, None] * freqs
        temb = t.time_embedder(torch.cat([angle.cos(), angle.sin()], dim=-1))
        activation = torch.nn.SiLU()
    side = math.sqrt(h * w)

    def axis(cells):
        ratio, n = cells / side, cells // 2
        return (torch.arange(n, dtype=torch.float64) * (ratio / n) + (1 - ratio) / 2) * 32

    rows_h, cols_w = axis(h), axis(w)
    per = [1, 4, 4, 4, 4]
    times = [length + 5 / 3 * sum(per[j % 5] for j in range(f)) for f in range(frames)]
    positions = [(i, 0.0, 0.0) for i in range(length)]
    positions += [(length + 5 / 3 * frame, float(rows_h[r]), float(cols_w[q])) for frame, _ in keyframes
                  for r in range(h // 2) for q in range(w // 2)]
    positions += [(length + j, 0.0, float(cols_w[0] if ch == 0 else cols_w[-1]))  # the grid's left and right edges
                  for ch in range(2) for j in range(steps)]
    positions += [(times[f], float(rows_h[r]), float(cols_w[q])) for f in range(frames) for r in range(h // 2)
                  for q in range(w // 2)]
    rope = t.rope(torch.tensor(positions, dtype=torch.float64))
    def patches(latent):
        count = latent.shape[2] * (h // 2) * (w // 2)
        rows = torch.einsum("nctrhpwq->nthwcrpq", latent.reshape(b, c, latent.shape[2], 1, h // 2, 2, w // 2, 2))
        return rows.reshape(b, count, -1)

    v_in = patches(video)
    def noise(shape):  # a CPU generator seeded anew for every keyframe and call
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    k_in = [0.999 * patches(z) + 0.001 * noise(patches(z).shape[1:]) for _, z in keyframes]
    a_in = audio.permute(0, 2, 3, 1).reshape(b, 2 * steps, 32)  # channel 0's frames, then channel 1's
    x = torch.cat([text, *(t.proj_in(k) for k in k_in), t.audio_proj_in(a_in), t.proj_in(v_in)], dim=1)
    adaln = row_t * 3 + tag
    for block in t.transformer_blocks:
        modulation = block.adaln_proj.linear(activation(temb)).view(-1, 6 * t.config.hidden_size).chunk(6, dim=-1)
        assert all(torch.equal(a, b) for a, b in zip(block.adaln_proj(temb), modulation))
        x = block(x, temb, adaln, rope)
    shift, scale = t.norm_out.linear(activation(temb)).chunk(2, dim=-1)
    x = t.norm_out.norm(x) * (1 + scale[row_t]) + shift[row_t]
    v = -t.proj_out(x[:, length + k_rows + 2 * steps:])
    a = -t.audio_proj_out(x[:, length + k_rows:length + k_rows + 2 * steps]).reshape(b, 2, steps, 32)
    a = a.permute(0, 3, 1, 2)
    v = torch.einsum("nthwcrpq->nctrhpwq", v.reshape(b, frames, h // 2, w // 2, c, 1, 2, 2)).reshape(video.shape)
    return v, (1 - k) * audio + (1 + (k - 1) * sigma_a) * a


@pytest.fixture(scope="module")
def h3():
    return registry.build("minimax-h3-tiny", torch.device("cpu"))


@pytest.fixture(scope="module")
def pruned():
    return registry.build("minimax-h3-pruned-tiny", torch.device("cpu"))


@pytest.mark.parametrize("tagged", [False, True], ids=["text", "first-and-last-frame"])
@pytest.mark.parametrize("form", ["full", "pruned"])
def test_the_model_is_comfyuis_minimax_h3(h3, pruned, tagged, form):
    """The wrapper's forward equals ComfyUI's MiniMaxH3Model restated: text to video, and with MiniMaxH3ImageToVideo's
    first and last frame (the images' vision tokens tagged 0 in the text; two keyframe rows' blocks, seeded noise);
    a pruned file's curve form as its use_adaln_curves branch runs it."""
    h3 = pruned if form == "pruned" else h3
    g = torch.Generator().manual_seed(1)
    video, carried = torch.randn(1, 24, 7, 4, 6, generator=g), torch.randn(1, 32, 2, 11, generator=g)
    context = torch.randn(1, 9, 48, generator=g)
    tags = torch.tensor([[1.0, 0, 0, 0, 1, 1, 1, 1, 1]]) if tagged else None
    sigma = torch.tensor([0.7])
    keyframes = [(0, torch.randn(1, 24, 1, 4, 6, generator=g)), (22, torch.randn(1, 24, 1, 4, 6, generator=g))]
    cond = {"context": context}
    if tagged:
        cond.update(text_token_tags=tags, keyframe_latents=torch.cat([z for _, z in keyframes], dim=2),
                    keyframe_frames=torch.tensor([[0.0, 22.0]]))
    h3.seed = 9
    with torch.no_grad():
        ours = h3.output((video, carried), sigma * 1000, cond, None)
        theirs = comfy_h3(h3.transformer, video, carried, sigma[0], context, tags, keyframes if tagged else (), seed=9)
    for mine, want, name in zip(ours, theirs, ("video", "audio")):
        assert (mine - want).abs().max() < 1e-5, name


def test_the_streams_attend_to_each_other(h3):
    g = torch.Generator().manual_seed(2)
    video, carried = torch.randn(1, 24, 2, 4, 4, generator=g), torch.randn(1, 32, 2, 7, generator=g)
    cond = {"context": torch.randn(1, 5, 48, generator=g)}
    sigma = torch.tensor([500.0])
    with torch.no_grad():
        v, a = h3.output((video, carried), sigma, cond, None)
        v_other, _ = h3.output((video, carried.flip(-1)), sigma, cond, None)
        _, a_other = h3.output((video.flip(2), carried), sigma, cond, None)
    assert (v - v_other).abs().max() > 1e-3 and (a - a_other).abs().max() > 1e-3


def test_the_audios_schedule_makes_a_packed_euler_step_its_own():
    """ModelSamplingAV's carry, for any model output: with the audio's σ from time_shift_sigma (shift 3 at the video's
    base times), an Euler step of the packed state from σv to σv' is, for the audio, an Euler step from σa to σa' of
    its own state x_a = y·σa/σv (k·a0 its clean value). A schedule that does not match the carry fails it; the model's
    own output is checked against ComfyUI's forward above (comfy_h3)."""
    from xdit_backend.models.minimax_h3 import time_shift_sigma

    g = torch.Generator().manual_seed(3)
    x_a = torch.randn(1, 32, 2, 7, generator=g)
    sv, sv_next = torch.tensor(0.8), torch.tensor(0.6)
    sa, sa_next = time_shift_sigma(sv, 12, 3), time_shift_sigma(sv_next, 12, 3)
    y = x_a * sv / sa
    out_y = torch.randn(y.shape, generator=g)  # the packed velocity, whatever the model gives
    y_next = y + out_y * (sv_next - sv)  # CONST's Euler: x + (x − x0)/σ·dσ, x0 = x − σ·out
    # the audio's own velocity: out_a from ComfyUI's relation out_y = (1 − k)·x_a + (1 + (k − 1)·σa)·out_a
    k = 4.0
    out_a = (out_y - (1 - k) * x_a) / (1 + (k - 1) * sa)
    x0_a = x_a - sa * out_a  # its clean estimate (the CONST denoised at σa), times k in y's units
    x_a_next = x_a + (x_a - x0_a) / sa * (sa_next - sa)
    assert torch.allclose(y_next * sa_next / sv_next, x_a_next, atol=1e-5)


PREFIXES = [("token_refiner.refiner_blocks.", "token_refiner.blocks."), ("transformer_blocks.", "blocks."),
            ("time_embedder.table", "adaln_t_table"), ("time_embedder.linear_1.", "time_embedder.proj_in."),
            ("time_embedder.linear_2.", "time_embedder.proj_out."),
            ("audio_proj_in.", "audio_patch_proj."), ("proj_in.", "video_patch_proj."),
            ("context_embedder.", "condition_proj."), ("norm_out.norm.", "final_layer.norm."),
            ("norm_out.linear.", "final_layer.adaln_proj.linear."), ("audio_proj_out.", "final_layer.audio_out."),
            ("proj_out.", "final_layer.video_out.")]
INNER = [(".attn.norm_q.", ".attn.q_norm."), (".attn.norm_k.", ".attn.k_norm."), (".attn.to_out.0.", ".attn.out_proj."),
         (".ff.net.0.proj.", ".mlp.fc1."), (".ff.net.2.", ".mlp.fc2.")]


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers' MiniMax-H3 → the original layout Comfy-Org's files hold (stacked [q; k; v], fc1 [gate; value]),
    written out here apart from the loader's table."""
    sd, out = transformer.state_dict(), {}
    for key, value in sd.items():
        if ".attn.to_k." in key or ".attn.to_v." in key:
            continue
        if ".attn.to_q." in key:
            value = torch.cat([sd[key], sd[key.replace("to_q", "to_k")], sd[key.replace("to_q", "to_v")]])
            key = key.replace(".attn.to_q.", ".attn.qkv_proj.")
        if ".ff.net.0.proj." in key:
            value, gate = value.chunk(2)
            value = torch.cat([gate, value])
        prefix = next(((ours, theirs) for ours, theirs in PREFIXES if key.startswith(ours)), ("", ""))
        key = prefix[1] + key[len(prefix[0]):]
        for ours, theirs in INNER:
            key = key.replace(ours, theirs)
        out[key] = value.contiguous()
    out["rope.inv_freq"] = transformer.rope.inv_freq  # the reference's buffer, which Comfy-Org's files keep
    return out


def test_the_original_names_are_those_diffusers_converts(h3):
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers

    converted = convert_minimax_h3_transformer_checkpoint_to_diffusers(
        original_state_dict(h3.transformer), dict(h3.transformer.config))  # it drops rope.inv_freq (recomputed)
    ours = h3.transformer.state_dict()
    assert converted.keys() == ours.keys()
    assert all(torch.equal(converted[key], ours[key]) for key in ours)


@pytest.mark.parametrize("stored", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
@pytest.mark.parametrize("form", ["full", "pruned"])
def test_a_comfy_org_file_loads_as_the_built_in(h3, pruned, tmp_path, stored, form):
    """Its config read off the shapes as ComfyUI's model detection reads it; its latents the built-in's (fp8: every
    matrix stored so, each tensor the fp8-rounded one; a pruned file's curve table kept float32, as Comfy-Org's)."""
    from safetensors.torch import save_file

    h3, name = (pruned, "minimax-h3-pruned-tiny") if form == "pruned" else (h3, "minimax-h3-tiny")
    path = tmp_path / f"{name}.safetensors"
    stored_as = {key: stored if value.dim() == 2 and key != "time_embedder.table" else value.dtype
                 for key, value in h3.transformer.state_dict().items()}
    weights = {key: value.to(stored) if value.dim() == 2 and key != "adaln_t_table" else value
               for key, value in original_state_dict(h3.transformer).items()}
    save_file({f"model.diffusion_model.{key}": value for key, value in weights.items()}, str(path))
    source = registry.resolve(str(path))
    built_in = registry.BUILTINS[name].config
    assert source.family == "minimax_h3"
    assert {key: source.config[key] for key in built_in if key != "patch_size"} == {
        key: value for key, value in built_in.items() if key != "patch_size"}
    if stored == torch.float32:
        g = torch.Generator().manual_seed(2)
        tensors = {"context": torch.randn(1, 8, 48, generator=g)}
        fields = {**H3, "model": name, "cfg": 1.0, "steps": 2}
        assert torch.equal(serial_latent({**fields, "model": str(path)}, tensors), serial_latent(fields, tensors))
        return
    loaded = registry.build(str(path), torch.device("cpu")).transformer.state_dict()
    for key, value in h3.transformer.state_dict().items():
        want = value.to(stored_as[key]).float()
        assert torch.equal(loaded[key].float(), want), key


def test_the_text_is_refined_once_per_side_when_the_sides_alternate(h3, monkeypatch):
    """Prompts of different lengths cannot batch, so cond and uncond are calls of their own, one after the other at
    every step; the token refiner still runs once per side, and the latent is the one made with it run at every
    call."""
    from xdit_backend.models.base import PerConditioning

    generator = torch.Generator().manual_seed(2)
    tensors = {"context": torch.randn(1, 8, 48, generator=generator),
               "negative_context": torch.randn(1, 5, 48, generator=generator)}
    runs = []
    handle = h3.transformer.token_refiner.register_forward_pre_hook(lambda module, args: runs.append(args[0].shape))
    try:
        kept = serial_latent(H3, tensors, model=h3)
        assert [shape[1] for shape in runs] == [8, 5]
        monkeypatch.setattr(PerConditioning, "get", lambda self, tensor, derive: derive(tensor))
        runs.clear()
        every_call = serial_latent(H3, tensors, model=h3)
        assert len(runs) == 2 * H3["steps"]
    finally:
        handle.remove()
    assert torch.equal(kept, every_call)


def test_pipefusion_and_the_step_cache_are_refused_with_the_reason(backend):
    from xdit_backend.wire.endpoint import BackendError

    with pytest.raises(BackendError, match="one sequence holds the text, the audio and the video"):
        backend(2).sample({**H3, "parallel": {"pipefusion": 2}})
    with pytest.raises(BackendError, match="not cached yet"):
        backend(2).sample({**H3, "parallel": {"ulysses": 2}, "cache": "fbcache"})


def test_the_audio_rows_cost_what_their_formula_says(backend):
    """bench layouts' audio column: what a rank sends with the audio, less what it sends with none, is
    cost.packed_audio_traffic's "split" term (the audio rows' share of the Ulysses all-to-alls), counted."""
    from xdit_backend.distributed.cost import packed_audio_traffic

    def sent(tensors):
        _, info = backend(2).sample({**H3, "cfg": 1.0, "parallel": {"ulysses": 2}, "profile": True}, tensors)
        return max(sum(v for k, v in r["sent_bytes"].items() if k != "control") for r in info["profile"])

    g = torch.Generator().manual_seed(5)
    text = {"context": torch.randn(1, 8, 48, generator=g)}
    audio = (sent({**text, "audio_latent": torch.zeros(1, 32, 2, 37)})
             - sent({**text, "audio_latent": torch.zeros(1, 32, 2, 0)}))
    split = packed_audio_traffic(layers=2, attention_width=128, audio_rows=74, rows=1, ulysses=2, ring=1,
                                 element_bytes=4)["split"]
    assert audio == split * H3["steps"] + 74 * 128 * 4 * H3["steps"] // 2  # and the heads' outputs' gather


def test_first_and_last_frame_equal_serial(backend):
    """MiniMaxH3ImageToVideo's keyframes on the prompt (rows of the packed sequence, cut with the rest), cfg 3 with a
    negative that has none (the sides then run one after the other)."""
    g = torch.Generator().manual_seed(8)
    tensors = {"context": torch.randn(1, 8, 48, generator=g), "negative_context": torch.randn(1, 6, 48, generator=g),
               "keyframe_latents": torch.randn(1, 24, 2, 4, 8, generator=g),
               "keyframe_frames": torch.tensor([[0.0, 21.0]])}
    expected = serial_parts(H3, tensors)
    without = serial_parts(H3, {k: v for k, v in tensors.items() if not k.startswith("keyframe")})
    assert (expected["samples"] - without["samples"]).abs().max() > 1e-3
    result, _ = backend(4).sample({**H3, "parallel": {"ulysses": 2, "ring": 2}}, tensors)
    assert_parts_equal(result, expected)
