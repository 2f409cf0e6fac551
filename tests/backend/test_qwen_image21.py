"""Qwen-Image 2.1 (one stream over [text | image], block-causal, the text modulated at t = 0): every layout equals
serial, the model equals ComfyUI's forward restated over the whole sequence (the wrapper's prefix computed once and
joined to every rank's keys is exact), files in ComfyUI's layout load, the constants are ComfyUI's."""

import math

import pytest
import torch

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

# 80 × 112 px: 5 × 7 = 35 image tokens, which no degree below divides (padded shares); cfg 3, the built-in's negative
Q21 = {"model": "qwen-image-2.1-tiny", "width": 80, "height": 112, "steps": 3, "seed": 5, "cfg": 3.0}

FULL_WARMUP = {"warmup_steps": Q21["steps"]}  # PipeFusion exact: every step one chunk
ROWS = [(Q21, 2, {"ulysses": 2}), (Q21, 2, {"ring": 2}), (Q21, 2, {"cfg": 2}), (Q21, 4, {"ulysses": 2, "ring": 2}),
        (Q21, 4, {"ulysses": 4}), ({**Q21, "batch": 2}, 2, {"dp": 2}), (Q21, 2, {"ulysses": 2, "shard_weights": True}),
        (Q21, 2, {"pipefusion": 2, **FULL_WARMUP}),
        # 96 px: 6 tokens a row, so every band of rows splits over Ulysses' 2 ranks
        ({**Q21, "width": 96}, 4, {"pipefusion": 2, "ulysses": 2, **FULL_WARMUP})]


def close(result: torch.Tensor, expected: torch.Tensor) -> bool:
    return (result - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("fields,world,degrees", [
    pytest.param(*row, id=f"b{row[0].get('batch', 1)}-world{row[1]}-" + "x".join(f"{k}{v}" for k, v in row[2].items()))
    for row in ROWS])
def test_every_layout_equals_serial(fields, world, degrees, backend):
    expected = serial_latent(fields)
    result, info = backend(world).sample({**fields, "parallel": degrees})
    assert info["world_size"] == world
    assert result["samples"].shape == expected.shape and close(result["samples"], expected)


def test_prompts_of_different_lengths_under_ulysses_and_ring(backend):
    """The sides' prefixes differ in length (they run one after the other); each rank joins its heads of them."""
    g = torch.Generator().manual_seed(3)
    tensors = {"context": torch.randn(1, 9, 32, generator=g), "negative_context": torch.randn(1, 4, 32, generator=g)}
    expected = serial_latent(Q21, tensors)
    result, _ = backend(4).sample({**Q21, "parallel": {"ulysses": 2, "ring": 2}}, tensors)
    assert close(result["samples"], expected)


def test_pipefusion_with_patches_is_near_serial(backend):
    """Two patches after one warm-up step: each attends over the prefix and the other's one-step-stale keys. Inexact,
    and far closer to serial than another seed is (test_pipefusion.py's rule for the other families)."""
    expected, other_seed = serial_latent(Q21), serial_latent({**Q21, "seed": 6})
    result, _ = backend(2).sample({**Q21, "parallel": {"pipefusion": 2, "num_pipeline_patch": 2, "warmup_steps": 1}})
    staleness = (result["samples"] - expected).norm()
    assert result["samples"].isfinite().all() and staleness > 0
    assert 10 * staleness < (other_seed - expected).norm()


# ComfyUI's Qwen-Image 2.1 forward restated (Comfy-Org/ComfyUI comfy/ldm/qwen_image21/model.py 08f68f09), apart from
# models/qwen_image21.py, on the same weights: the whole sequence [text | image] in every block under the block-causal
# mask, the modulation rows picked per token ([t; 0]: the text the last), EmbedND's rotations applied to pairs.

def comfy_rope(ids: torch.Tensor, axes) -> tuple[torch.Tensor, torch.Tensor]:
    """comfy/ldm/flux/math.py rope per axis: cos and sin [S, D/2] of pos · θ^(−2k/d), float64."""
    angles = []
    for axis, dim in enumerate(axes):
        scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64)
        angles.append(ids[:, axis, None].double() / 10000 ** scale)
    angle = torch.cat(angles, dim=1)
    return angle.cos().float(), angle.sin().float()


def apply_rope1(x, cos, sin):
    """apply_rope1: adjacent pairs (x0, x1) → (cos·x0 − sin·x1, sin·x0 + cos·x1); x [B, S, H, D]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = cos[None, :, None], sin[None, :, None]
    out = torch.stack([c * pairs[..., 0] - s * pairs[..., 1], s * pairs[..., 0] + c * pairs[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)


def comfy_qwen_image21(t, x, sigma, context, refs=(), slots=()):
    """``refs``: reference latents [B, 64, h', w'] already in model space; ``slots``: their places in the text."""
    b, c, h, w = x.shape
    n = h * w
    text = t.txt_in(context)
    bounds = [0, *(list(slots) + [context.shape[1]] * len(refs))[:len(refs)], context.shape[1]]
    parts, ids, segments, pos, length = [], [], [], 0, 0
    for (start, end), img in zip(zip(bounds[:-1], bounds[1:]), [*refs, x]):  # build_sequence
        if end > start:
            parts.append(text[:, start:end])
            ids.append(torch.arange(pos, pos + end - start, dtype=torch.float32)[:, None].expand(end - start, 3))
            segments.append((length, length + end - start, True))
            pos, length = pos + end - start, length + end - start
        hh, ww = img.shape[-2:]
        rows = torch.arange(hh, dtype=torch.float32) - (hh - hh // 2) + 0.5 * (hh % 2 - h % 2)
        cols = torch.arange(ww, dtype=torch.float32) - (ww - ww // 2) + 0.5 * (ww % 2 - w % 2)
        parts.append(t.img_in(img.flatten(2).transpose(1, 2)))
        ids.append(torch.stack([torch.full((hh, ww), float(pos)), rows[:, None].expand(hh, ww),
                                cols[None].expand(hh, ww)], dim=-1).reshape(-1, 3))
        segments.append((length, length + hh * ww, False))
        pos, length = pos + max(hh, ww), length + hh * ww
    hidden = torch.cat(parts, dim=1)  # [B, Lp + N, D]
    prefix = hidden.shape[1] - n
    cos, sin = comfy_rope(torch.cat(ids), t.config.axes_dims_rope)
    half = 128  # timestep_embedding(t, 256): cos then sin of 1000·t · 10000^(−k/128)
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    times = torch.cat([sigma, torch.zeros(1)])
    angle = 1000 * times[:, None] * freqs
    emb = t.time_text_embed.timestep_embedder(torch.cat([angle.cos(), angle.sin()], dim=-1))  # [B + 1, D]
    scale1, gate1, scale2, gate2 = t.modulation(emb).chunk(4, dim=-1)

    def rows_of(p):  # the prefix's rows from t = 0 (the last), the target's from its own t
        return torch.cat([p[-1:, None].expand(b, prefix, -1), p[:-1, None].expand(b, n, -1)], dim=1)

    def block_causal(q, k, v):  # block_causal_attention: each segment's queries over the keys up to its end
        outs = []
        for start, end, causal in segments:
            mask = torch.ones(end - start, end, dtype=torch.bool).tril(start) if causal else None
            outs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start:end], k[:, :, :end], v[:, :, :end], attn_mask=mask))
        return torch.cat(outs, dim=2)

    for block in t.transformer_blocks:
        attn = block.attn
        y = torch.nn.functional.layer_norm(hidden, hidden.shape[-1:], eps=1e-6) * (1 + rows_of(scale1))
        q, k, v = (proj(y).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = apply_rope1(attn.norm_q(q), cos, sin), apply_rope1(attn.norm_k(k), cos, sin)
        out = block_causal(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).flatten(2)
        hidden = hidden + rows_of(gate1.tanh()) * attn.to_out[0](out)
        y = torch.nn.functional.layer_norm(hidden, hidden.shape[-1:], eps=1e-6) * (1 + rows_of(scale2))
        mlp = block.img_mlp
        hidden = hidden + rows_of(gate2.tanh()) * mlp.out(torch.nn.functional.silu(mlp.gate_layer(y)) * mlp.proj(y))
    last = t.norm_out.linear(torch.nn.functional.silu(emb[:-1]))[:, None]
    out = t.proj_out(torch.nn.functional.layer_norm(hidden[:, prefix:], hidden.shape[-1:], eps=1e-6) * (1 + last))
    return out.transpose(1, 2).reshape(b, c, h, w)


@pytest.fixture(scope="module")
def q21():
    return registry.build("qwen-image-2.1-tiny", torch.device("cpu"))


@pytest.mark.parametrize("edit", ["text", "two-references"])
def test_the_model_is_comfyuis_qwen_image21(q21, edit):
    """Text to image, and an edit: two reference images at their places in the text (one of odd size: its grid half a
    token off the target's), each block-causal in the prefix, modulated at t = 0."""
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(2, 64, 5, 7, generator=g), torch.randn(2, 9, 32, generator=g)
    sigma = torch.tensor([0.7, 0.3])
    cond, refs, slots = {"context": context}, [], []
    if edit != "text":
        refs = [torch.randn(1, 64, 4, 6, generator=g), torch.randn(1, 64, 3, 3, generator=g)]
        slots = [2, 5]
        cond.update(reference_0=refs[0], reference_1=refs[1], image_slots=torch.tensor([[2.0, 5.0], [2.0, 5.0]]))
    fmt = q21.latent_format
    with torch.no_grad():
        ours = q21.output(x, sigma, cond, None)
        theirs = comfy_qwen_image21(q21.transformer, x, sigma, context,
                                    [fmt.process_in(r).expand(2, -1, -1, -1) for r in refs], slots)
    assert (ours - theirs).abs().max() < 1e-5


@pytest.mark.parametrize("world,degrees", [(4, {"ulysses": 2, "ring": 2}), (2, {"pipefusion": 2, **FULL_WARMUP})],
                         ids=["u2xr2", "pipefusion2"])
def test_an_edit_equals_serial(backend, world, degrees):
    """Two reference images in the prefix (whole on every rank; under PipeFusion it travels with each step's first
    chunk), the image's tokens split over the ranks."""
    g = torch.Generator().manual_seed(6)
    tensors = {"context": torch.randn(1, 8, 32, generator=g), "negative_context": torch.randn(1, 8, 32, generator=g),
               "reference_0": torch.randn(1, 64, 7, 5, generator=g),
               "reference_1": torch.randn(1, 64, 4, 4, generator=g),
               "image_slots": torch.tensor([[1.0, 6.0]]), "negative_image_slots": torch.tensor([[1.0, 6.0]])}
    # both prompts carry the references, as Text Encode Qwen Image 2.1 puts them on both
    tensors.update(negative_reference_0=tensors["reference_0"], negative_reference_1=tensors["reference_1"])
    expected = serial_latent(Q21, tensors)
    plain = serial_latent(Q21, {k: v for k, v in tensors.items() if "context" in k})
    assert not close(plain, expected)  # the references change the picture
    result, _ = backend(world).sample({**Q21, "parallel": degrees}, tensors)
    assert close(result["samples"], expected)


def test_the_image_reads_the_text_and_the_text_not_the_image(q21):
    """Joint attention, block-causal: a change of the prompt's last token moves the image; the prefix a step keeps is
    the same whatever the latent (it is computed once per prompt)."""
    g = torch.Generator().manual_seed(2)
    x, context = torch.randn(1, 64, 4, 4, generator=g), torch.randn(1, 6, 32, generator=g)
    other = context.clone()
    other[:, -1] += 1
    sigma = torch.tensor([0.5])
    with torch.no_grad():
        base = q21.output(x, sigma, {"context": context}, None)
        moved = q21.output(x, sigma, {"context": other}, None)
        kept = q21._prefix({"context": context}, 1, (4, 4), None)  # the first call's: nothing computed again
        again = q21.output(torch.randn(1, 64, 4, 4, generator=g), torch.tensor([0.2]), {"context": context}, None)
    assert (base - moved).abs().max() > 1e-3
    assert q21._prefix({"context": context}, 1, (4, 4), None) is kept and again.isfinite().all()


def comfy_file_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers' Qwen-Image 2.1 → ComfyUI's layout (written apart from the loader's table): the same names, each
    feed-forward's gate_layer and proj one ``gate_up`` [gate; up], under model.diffusion_model."""
    sd, out = transformer.state_dict(), {}
    for key, value in sd.items():
        if key.endswith("img_mlp.proj.weight"):
            continue
        if key.endswith("img_mlp.gate_layer.weight"):
            key, value = key.replace("gate_layer", "gate_up"), torch.cat([value, sd[key.replace("gate_layer", "proj")]])
        out[f"model.diffusion_model.{key}"] = value.contiguous()
    return out


def test_comfyuis_names_are_those_diffusers_converts(q21):
    from diffusers.loaders.single_file_utils import convert_qwen_image21_transformer_checkpoint_to_diffusers

    converted = convert_qwen_image21_transformer_checkpoint_to_diffusers(comfy_file_state_dict(q21.transformer))
    ours = q21.transformer.state_dict()
    assert converted.keys() == ours.keys() and all(torch.equal(converted[key], ours[key]) for key in ours)


@pytest.mark.parametrize("stored", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_a_comfy_org_file_loads_as_the_built_in(q21, tmp_path, stored):
    """Its config read off the shapes as ComfyUI's model detection reads it; its latent the built-in's (fp8: every
    matrix stored so, each tensor the fp8-rounded one)."""
    from safetensors.torch import save_file

    path = tmp_path / "qwen_image_2.1_tiny.safetensors"
    save_file({key: value.to(stored) if value.dim() == 2 else value
               for key, value in comfy_file_state_dict(q21.transformer).items()}, str(path))
    source = registry.resolve(str(path))
    built_in = registry.BUILTINS["qwen-image-2.1-tiny"].config
    assert source.family == "qwen_image21" and source.config["fused_mlp"]
    assert {key: source.config[key] for key in built_in} == {k: tuple(v) if isinstance(v, list) else v
                                                              for k, v in built_in.items()}
    if stored == torch.float32:
        g = torch.Generator().manual_seed(4)
        tensors = {"context": torch.randn(1, 8, 32, generator=g)}
        fields = {**Q21, "cfg": 1.0, "steps": 2}
        assert torch.equal(serial_latent({**fields, "model": str(path)}, tensors), serial_latent(fields, tensors))
        return
    loaded = registry.build(str(path), torch.device("cpu")).transformer.state_dict()
    for key, value in q21.transformer.state_dict().items():
        want = value.to(stored).float() if value.dim() == 2 else value
        assert torch.equal(loaded[key].float(), want), key


def test_the_sampling_and_latent_constants_are_comfyuis():
    """ModelSamplingFlux at shift 0.69 (supported_models.QwenImage21 01f03bbd: σ(t) = e^0.69 / (e^0.69 + 1/t − 1),
    timestep = σ); the latent (x − mean) / std per channel (latent_formats.QwenImage21 75399d78: channel 0's mean
    0.5126, std 3.2001; channel 63's 0.0304, 3.8161) at 16 pixels a cell."""
    spec = registry.spec("qwen-image-2.1-tiny")
    sampling = spec.model_sampling(None)
    t = torch.arange(1, 10001) / 10000  # ModelSamplingFlux tabulates 10000 times
    assert torch.allclose(sampling.table().double(), (math.exp(0.69) / (math.exp(0.69) + (1 / t.double() - 1))),
                          atol=1e-6)
    assert torch.equal(sampling.timestep(torch.tensor([0.4])), torch.tensor([0.4]))
    latent = torch.ones(1, 64, 2, 2)
    moved = spec.latent_format.process_in(latent)
    assert torch.allclose(moved[0, 0], torch.full((2, 2), (1 - 0.5126) / 3.2001))
    assert torch.allclose(moved[0, 63], torch.full((2, 2), (1 - 0.0304) / 3.8161))
    assert spec.latent_shape(1, 1024, 768) == (1, 64, 48, 64)


def test_the_step_cache_is_refused_with_the_reason(backend):
    from xdit_backend.wire.endpoint import BackendError

    with pytest.raises(BackendError, match="not cached yet"):
        backend(2).sample({**Q21, "parallel": {"ulysses": 2}, "cache": "fbcache"})
