"""SD3, PixArt, Wan and the newer families through the parallel layouts: each equals its serial result
(float32, ≤ 1e-4 of the latent's scale); Wan's 5-D latents, and step ranges that split one generation
into two (Wan 2.2's two experts).

The bound is relative to the largest value of the serial latent (and absolute below 1): a
random-weight PixArt predicts ε of order 1, which EPS sampling multiplies by σ_max ≈ 157 and
the SD 1.5 latent scale by 1/0.18215, so its latents reach ~4·10³; there, float32 rounding of
a different summation order (Ring's log-sum-exp merge) alone is ~2·10⁻³ absolute (6·10⁻⁷ relative).
"""

import pytest
import torch

from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.sampling.generate import generate
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

TOLERANCE = 1e-4


def bound(serial: torch.Tensor) -> float:
    return TOLERANCE * max(1.0, serial.abs().max().item())

# Each family at a size whose token count (32) every degree below divides; cfg 3.5 with the
# built-in's seeded negative, so cfg=2 has two passes to split.
FAMILIES = {
    "sd3-tiny": {"width": 128, "height": 64},
    "pixart-tiny": {"width": 128, "height": 64},
    "wan-tiny": {"width": 64, "height": 64, "frames": 5},  # latent [1, 16, 2, 8, 8]
    # latent [1, 32, 2, 4, 4]: 32 image tokens (16× VAE, 1×1×1 patches); text 8 byT5 + 8 Qwen2.5-VL tokens
    "hunyuan-video-1.5-tiny": {"width": 64, "height": 64, "frames": 5},
    "z-image-tiny": {"width": 128, "height": 64},  # unified sequence: 32 image + 32 caption tokens (8 padded)
    "hunyuan-dit-tiny": {"width": 128, "height": 64},
    "flux2-tiny": {"width": 128, "height": 64},  # latent [1, 128, 4, 8]: 32 tokens (and 512 of text)
    "qwen-image-tiny": {"width": 128, "height": 64},  # 4 × 8 = 32 image tokens, 8 text tokens
    "cogvideox-tiny": {"width": 64, "height": 64, "frames": 5},  # latent [1, 16, 2, 8, 8]: 32 tokens, text 8
}
LAYOUTS = [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (4, {"ulysses": 2, "ring": 2})]
# The report: a reference system returned wrong HunyuanDiT images at sequence parallel degree 4.
# HunyuanDiT's second-half blocks take a skip input: FSDP2-sharded blocks must pass it through.
EXTRA_LAYOUTS = {"hunyuan-dit-tiny": [(4, {"ulysses": 4}), (4, {"ring": 4}),
                                      (2, {"ulysses": 2, "shard_weights": True})]}


def fields(model: str, **extra) -> dict:
    return {"model": model, **FAMILIES[model], "steps": 3, "seed": 7, "cfg": 3.5, **extra}


def serial_latent(message_fields: dict) -> torch.Tensor:
    """The world-1 code path in this process, with the conditioning rank 0 would make up."""
    request = SampleRequest.parse(Message("sample", message_fields, {}))
    spec = registry.spec(request.model)
    request.check_model(spec)
    positive, negative = registry.random_conditioning(request.model, request.batch, request.seed, spec)
    model = registry.build(request.model, torch.device("cpu"))
    with torch.no_grad():
        return generate(Denoiser(model), request.generation(spec, positive, negative))


@pytest.fixture(scope="module")
def serial():
    return {model: serial_latent(fields(model)) for model in FAMILIES}


def case_id(case):
    model, (world, degrees) = case
    return f"{model}-" + "x".join(f"{k}{v}" for k, v in degrees.items())


@pytest.mark.parametrize("case", [(m, layout) for m in FAMILIES for layout in LAYOUTS + EXTRA_LAYOUTS.get(m, [])],
                         ids=case_id)
def test_family_layout_equals_serial(case, serial, request):
    model, (world, degrees) = case
    client = request.getfixturevalue(f"backend{world}")
    result, info = client.sample({**fields(model), "parallel": degrees})
    assert info["world_size"] == world
    assert result["samples"].shape == serial[model].shape
    difference = (result["samples"] - serial[model]).abs().max().item()
    assert difference <= bound(serial[model]), f"{case_id(case)}: max |parallel − serial| = {difference:.3g}"


# World 4 on one model: the sequence split 4 ways (text and video), and cfg beside ulysses.
WORLD_FOUR = [{"ulysses": 4}, {"ring": 4}, {"cfg": 2, "ulysses": 2}]


@pytest.mark.parametrize("degrees", WORLD_FOUR, ids=lambda d: case_id(("cogvideox-tiny", (4, d))))
def test_world_four_layouts_equal_serial(degrees, serial, backend4):
    result, info = backend4.sample({**fields("cogvideox-tiny"), "parallel": degrees})
    assert info["world_size"] == 4
    difference = (result["samples"] - serial["cogvideox-tiny"]).abs().max().item()
    assert difference <= bound(serial["cogvideox-tiny"]), f"{degrees}: max |parallel − serial| = {difference:.3g}"


UNEVEN = {"model": "cogvideox-tiny", "width": 80, "height": 48, "frames": 5, "steps": 3, "seed": 7, "cfg": 3.5}


def uneven_conditioning() -> dict:
    """7 text tokens (5B takes any length): with 30 video tokens (2 frames × 3 × 5), neither divides by 4."""
    generator = torch.Generator().manual_seed(3)
    return {"context": torch.randn(1, 7, 64, generator=generator),
            "negative_context": torch.randn(1, 7, 64, generator=generator)}


@pytest.fixture(scope="module")
def uneven_serial():
    request = SampleRequest.parse(Message("sample", UNEVEN, uneven_conditioning()))
    spec = registry.spec("cogvideox-tiny")
    request.check_model(spec)
    positive, negative = request.conditioning(spec)
    with torch.no_grad():
        return generate(Denoiser(registry.build("cogvideox-tiny", torch.device("cpu"))),
                        request.generation(spec, positive, negative))


@pytest.mark.parametrize("degrees", WORLD_FOUR + [{"ulysses": 2, "ring": 2}],
                         ids=lambda d: case_id(("cogvideox-tiny-uneven", (4, d))))
def test_uneven_video_and_text_tokens_equal_serial(degrees, uneven_serial, backend4):
    result, _ = backend4.sample({**UNEVEN, "parallel": degrees}, uneven_conditioning())
    difference = (result["samples"] - uneven_serial).abs().max().item()
    assert difference <= bound(uneven_serial), f"{degrees}: max |parallel − serial| = {difference:.3g}"


def test_sharded_weights_equal_serial(serial, backend2):
    """FSDP2 weight sharding over CogVideoX's blocks, beside ulysses=2: the same latent."""
    result, info = backend2.sample({**fields("cogvideox-tiny"), "parallel": {"ulysses": 2, "shard_weights": True}})
    assert "weights sharded" in info["layout"]
    difference = (result["samples"] - serial["cogvideox-tiny"]).abs().max().item()
    assert difference <= bound(serial["cogvideox-tiny"]), f"max |sharded − serial| = {difference:.3g}"


def test_another_seed_differs_beyond_the_tolerance(serial):
    """The tolerance means something for every family: another seed moves the latent far more."""
    for model in FAMILIES:
        other = serial_latent(fields(model, seed=8))
        assert (other - serial[model]).abs().max() > 100 * bound(serial[model]), model


@pytest.mark.parametrize("degrees", [{"ulysses": 4}, {"ulysses": 2, "ring": 2}], ids=["ulysses4", "ulysses2xring2"])
def test_z_image_uneven_heads_and_tokens_equal_serial(degrees, backend4):
    """Z-Image's 30 heads are not divisible by 4 (the tiny's 6 neither), and 112 × 80 px gives 7 × 5 = 35
    image tokens; Z-Image pads them and its caption to 32 each, so the unified sequence (64 + 32) splits."""
    message = fields("z-image-tiny", width=112, height=80)
    result, _ = backend4.sample({**message, "parallel": degrees})
    serial = serial_latent(message)
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= bound(serial), f"z-image-tiny {degrees}: max |parallel − serial| = {difference:.3g}"


def test_z_image_with_sharded_weights_equals_serial(backend2):
    """FSDP2 over Z-Image's three block lists (refiners and main blocks) beside ulysses=2, batch 2."""
    message = fields("z-image-tiny", batch=2)
    result, info = backend2.sample({**message, "parallel": {"ulysses": 2, "shard_weights": True}})
    assert "weights sharded 2 ways" in info["layout"]
    serial = serial_latent(message)
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= bound(serial), f"max |sharded − serial| = {difference:.3g}"


def test_wan_latent_is_video_shaped(serial):
    assert serial["wan-tiny"].shape == (1, 16, 2, 8, 8)  # 5 frames → 1 + 4/4 latent frames; 64 px / 8


def test_two_step_ranges_equal_one_run():
    """High-noise expert to step 2 with its leftover noise, then the low-noise expert from step 2
    without new noise (KSamplerAdvanced, as ComfyUI's Wan 2.2 workflow does) = one 4-step run."""
    whole = serial_latent(fields("wan-tiny", steps=4))
    first = serial_latent(fields("wan-tiny", steps=4, end_step=2, return_with_leftover_noise=True))
    request = SampleRequest.parse(Message("sample", fields("wan-tiny", steps=4, start_step=2, add_noise=False),
                                          {"latent": first}))
    spec = registry.spec("wan-tiny")
    positive, negative = registry.random_conditioning("wan-tiny", 1, 7, spec)
    with torch.no_grad():
        second = generate(Denoiser(registry.build("wan-tiny", torch.device("cpu"))),
                          request.generation(spec, positive, negative))
    assert (second - whole).abs().max() <= 1e-5
    assert (first - whole).abs().max() > 100 * TOLERANCE  # the first half alone is not the result


def test_flux2_with_its_weights_sharded_equals_serial(serial, backend2):
    """Flux.2's blocks (double- and single-stream, their fused projections) sharded under ulysses=2."""
    result, _ = backend2.sample({**fields("flux2-tiny"), "parallel": {"ulysses": 2, "shard_weights": True}})
    assert (result["samples"] - serial["flux2-tiny"]).abs().max() <= bound(serial["flux2-tiny"])


def test_step_ranges_through_the_backend(backend2):
    """The same split over the socket, under a parallel layout."""
    base = {**fields("wan-tiny", steps=4), "parallel": {"ulysses": 2}}
    whole, _ = backend2.sample(base)
    first, _ = backend2.sample({**base, "end_step": 2, "return_with_leftover_noise": True})
    second, _ = backend2.sample({**base, "start_step": 2, "add_noise": False}, {"latent": first["samples"]})
    assert (second["samples"] - whole["samples"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize(("extra", "message"), [
    ({"frames": 6}, "frames 6 is not 1 \\+ a multiple of 4"),
    ({"width": 72}, "width 72 is not a multiple of 16"),
    ({"guidance": 3.5}, "has no guidance embedding"),
    ({"end_step": 9}, "end_step 9 is past the last of 3 steps"),
])
def test_requests_a_family_cannot_run_are_refused(extra, message):
    request = SampleRequest.parse(Message("sample", fields("wan-tiny", **extra), {}))
    with pytest.raises(RequestError, match=message):
        request.check_model(registry.spec("wan-tiny"))


def test_an_image_model_refuses_frames_and_pixart_refuses_a_shift():
    for model, extra, message in (("sd3-tiny", {"frames": 5}, "makes images, not videos"),
                                  ("pixart-tiny", {"shift": 3.0}, "no flow shift")):
        request = SampleRequest.parse(Message("sample", fields(model, **extra), {}))
        with pytest.raises(RequestError, match=message):
            request.check_model(registry.spec(model))


def test_hunyuan_video15_with_sharded_weights_equals_serial(serial, backend2):
    """HunyuanVideo 1.5 runs its blocks from its own loop, never the transformer's forward: FSDP's
    per-block gathers must still fire (ulysses 2 with every block's weights sharded 2 ways)."""
    result, info = backend2.sample({**fields("hunyuan-video-1.5-tiny"), "parallel": {"ulysses": 2, "shard_weights": True}})
    assert "weights sharded" in info["layout"]
    reference = serial["hunyuan-video-1.5-tiny"]
    assert (result["samples"] - reference).abs().max() <= bound(reference)


@pytest.mark.parametrize(("world", "degrees"), [(2, {"ring": 2}), (4, {"ulysses": 4})], ids=["ring2", "ulysses4"])
def test_hunyuan_dit_at_a_token_count_no_degree_divides_equals_serial(world, degrees, request):
    """80 × 48 px is 5 × 3 = 15 HunyuanDiT tokens: padded shares, and the RoPE table padded with them."""
    message = {**fields("hunyuan-dit-tiny"), "width": 80, "height": 48}
    serial = serial_latent(message)
    result, _ = request.getfixturevalue(f"backend{world}").sample({**message, "parallel": degrees})
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= bound(serial), f"{degrees}: max |parallel − serial| = {difference:.3g}"


def test_a_reference_latent_through_the_backend_changes_qwen_image_and_stays_exact_under_ulysses_2(backend2):
    """An edit request end to end: the reference latent (reference_0, as --reference-latent and the nodes send
    it) moves the result well beyond the tolerance, and ulysses=2 gives the serial latent. 10 × 6 latent cells
    of reference: 15 reference tokens with the 32 image tokens, which 2 does not divide (padded shares)."""
    message = fields("qwen-image-tiny")
    spec = registry.spec("qwen-image-tiny")
    positive, negative = registry.random_conditioning("qwen-image-tiny", 1, 7, spec, references=((6, 10),))
    tensors = {**positive, **{f"negative_{key}": value for key, value in negative.items()}}
    request = SampleRequest.parse(Message("sample", message, tensors))
    model = registry.build("qwen-image-tiny", torch.device("cpu"))
    with torch.no_grad():
        serial = generate(Denoiser(model), request.generation(spec, *request.conditioning(spec)))
    result, _ = backend2.sample({**message, "parallel": {"ulysses": 2}}, tensors)
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= bound(serial), f"ulysses=2 with a reference: max |parallel − serial| = {difference:.3g}"
    without, _ = backend2.sample({**message, "parallel": {"ulysses": 2}},
                                 {k: v for k, v in tensors.items() if "reference" not in k})
    assert (without["samples"] - serial).abs().max() > 10 * bound(serial)  # 0.09: 50 × the bound (random weights)
