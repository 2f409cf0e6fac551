"""The step cache (parallel/step_cache.py): every layout takes the serial run's decisions and gives its latent.

flux-tiny at 144×144 px (9 × 9 = 81 image tokens) with 7-token prompts: under ulysses=2 and ring=2 each
rank holds a padded share, so the decision's sums must leave the padding out to match serial.
"""

import pytest
import torch
from conftest import flux_tiny_conditioning

from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.parallel.step_cache import CacheOptions, StepCache
from xdit_backend.sampling.generate import generate
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 144, "height": 144, "steps": 12, "seed": 3, "cfg": 3.5, "batch": 2}
# Thresholds that reuse some steps with every statistic well away from them (test_thresholds_are_away_from_every_decision)
THRESHOLDS = {"fbcache": 0.45, "teacache": 0.1}
MARGIN = 0.01  # the least |statistic − threshold| of the serial run; the layouts' statistics agree to ~1e-6
LAYOUTS = [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}, {"dp": 2}, {"ulysses": 2, "shard_weights": True}]


@pytest.fixture(scope="module")
def conditioning():
    return flux_tiny_conditioning(seed=11, batch=2, text_tokens=7)


@pytest.fixture(scope="module")
def model():
    return registry.build("flux-tiny", torch.device("cpu"))


def serial(model, tensors: dict, **fields):
    """(latent, step cache) of the world-1 code path, in this process."""
    request = SampleRequest.parse(Message("sample", {**FIELDS, **fields}, tensors))
    denoiser = Denoiser(model)
    with torch.no_grad():
        latent = generate(denoiser, request.generation(model.spec, *request.conditioning(model.spec)))
    return latent, denoiser.cache


@pytest.fixture(scope="module")
def cached_serial(model, conditioning):
    """method → (latent, step cache) of the cached serial run, computed once per module."""
    runs = {}

    def run(method: str):
        if method not in runs:
            runs[method] = serial(model, conditioning, **cached(method))
        return runs[method]

    return run


def cached(method: str) -> dict:
    return {"cache": method, "cache_threshold": THRESHOLDS[method]}


@pytest.mark.parametrize("method", ["fbcache", "teacache"])
def test_threshold_zero_equals_the_uncached_run_exactly(model, conditioning, method):
    uncached, _ = serial(model, conditioning)
    latent, cache = serial(model, conditioning, cache=method, cache_threshold=0.0)
    assert cache.counts == {"computed": FIELDS["steps"], "reused": 0}
    assert torch.equal(latent, uncached)


@pytest.mark.parametrize("method", ["fbcache", "teacache"])
def test_thresholds_are_away_from_every_decision(cached_serial, method):
    """The statistic the threshold is compared with, at every step the serial run decides, is at least
    MARGIN from the threshold: a layout whose sums differ in the last digits takes the same decisions."""
    _, cache = cached_serial(method)
    ratios = [d.ratio for d in cache.trace if d.ratio is not None]
    margin = min(abs(r - THRESHOLDS[method]) for r in ratios)
    assert margin >= MARGIN, f"{method}: a statistic lies {margin:.3g} from the threshold {THRESHOLDS[method]}"
    assert 0 < cache.counts["reused"] < FIELDS["steps"] - 3, cache.counts


@pytest.mark.parametrize("method", ["fbcache", "teacache"])
def test_the_cached_latent_stays_near_the_uncached_one(model, conditioning, cached_serial, method):
    """Relative to the latent's scale, reusing steps moves the result far less than another seed does."""
    uncached, _ = serial(model, conditioning)
    latent, cache = cached_serial(method)
    other_seed, _ = serial(model, conditioning, seed=FIELDS["seed"] + 1)
    assert cache.counts["reused"] > 0
    distance = ((latent - uncached).norm() / uncached.norm()).item()
    seeds = ((other_seed - uncached).norm() / uncached.norm()).item()
    assert distance < 0.1 * seeds, f"{method}: cached is {distance:.3g} from uncached, another seed {seeds:.3g}"


def test_sides_that_run_one_call_each_decide_once_per_step(model):
    """A negative prompt of another length runs as a second model call: it follows the first call's
    decision, and the result equals the batched-sides rule (cond rows decide) run under cfg=2 below."""
    tensors = flux_tiny_conditioning(seed=11, batch=2, text_tokens=7)
    shorter = flux_tiny_conditioning(seed=12, batch=2, text_tokens=5)
    tensors.update({k: v for k, v in shorter.items() if k.startswith("negative_")})
    latent, cache = serial(model, tensors, **cached("fbcache"))
    assert len(cache.trace) == FIELDS["steps"] and cache.counts["reused"] > 0


# fbcache in every layout (its sums run over tokens: padded shares, sharded weights); teacache's sums run over
# rows only, the same code, so two layouts show it: one splitting tokens, one splitting the guidance sides
CASES = [("fbcache", layout) for layout in LAYOUTS] + [("teacache", {"ulysses": 2}), ("teacache", {"cfg": 2})]


@pytest.mark.parametrize("method, layout", CASES,
                         ids=[f"{m}-" + ",".join(f"{k}{v}" for k, v in d.items()) for m, d in CASES])
def test_every_layout_takes_the_serial_decisions_and_gives_its_latent(backend2, cached_serial, conditioning, method,
                                                                     layout):
    expected, cache = cached_serial(method)
    result, info = backend2.sample({**FIELDS, **cached(method), "parallel": layout, "profile": True}, conditioning)
    assert info["cache"] == cache.counts
    difference = (result["samples"] - expected).abs().max().item()
    assert difference <= TOLERANCE, f"{method} {layout}: max |parallel − cached serial| = {difference:.3g}"
    traces = [record["cache_trace"] for record in info["profile"]]
    assert traces[0] == traces[1], "the ranks decided differently"
    for (step, ratio, reused), decision in zip(traces[0], cache.trace, strict=True):
        assert (step, reused) == (decision.step, decision.reused)
        assert (ratio is None) == (decision.ratio is None)
        if ratio is not None:
            assert abs(ratio - decision.ratio) <= 1e-5 * max(1.0, decision.ratio)


def test_negative_of_another_length_under_cfg_2_equals_serial(backend2, model):
    tensors = flux_tiny_conditioning(seed=11, batch=2, text_tokens=7)
    shorter = flux_tiny_conditioning(seed=12, batch=2, text_tokens=5)
    tensors.update({k: v for k, v in shorter.items() if k.startswith("negative_")})
    expected, cache = serial(model, tensors, **cached("fbcache"))
    result, info = backend2.sample({**FIELDS, **cached("fbcache"), "parallel": {"cfg": 2}}, tensors)
    assert info["cache"] == cache.counts
    assert (result["samples"] - expected).abs().max().item() <= TOLERANCE


def test_full_warmup_pipefusion_takes_the_serial_decisions_and_gives_its_latent(backend2, cached_serial,
                                                                                conditioning):
    """pipefusion=2 with every step a warm-up step (the whole latent in one chunk): the decider (the stage
    with the first block) decides from the serial run's statistic; the other stage follows its flag and
    adds its own residual; the latent is the cached serial one."""
    expected, cache = cached_serial("fbcache")
    parallel = {"pipefusion": 2, "warmup_steps": FIELDS["steps"]}
    result, info = backend2.sample({**FIELDS, **cached("fbcache"), "parallel": parallel, "profile": True},
                                   conditioning)
    assert info["cache"] == cache.counts
    difference = (result["samples"] - expected).abs().max().item()
    assert difference <= TOLERANCE, f"max |pipefusion − cached serial| = {difference:.3g}"
    decider, follower = (record["cache_trace"] for record in info["profile"])  # flux: stage 0 holds block 0
    assert [reused for _, _, reused in follower] == [d.reused for d in cache.trace]
    assert all(ratio is None for _, ratio, _ in follower)  # it followed the flag
    for (step, ratio, reused), decision in zip(decider, cache.trace, strict=True):
        assert (step, reused, ratio is None) == (decision.step, decision.reused, decision.ratio is None)
        if ratio is not None:
            assert abs(ratio - decision.ratio) <= 1e-5 * max(1.0, decision.ratio)


@pytest.mark.parametrize("degrees", [{"cfg": 2}, {"ulysses": 2}], ids=["cfg2", "ulysses2"])
def test_pipefusion_hybrids_take_the_serial_decisions_and_give_its_latent(backend4, model, conditioning, degrees):
    """pipefusion=2 with cfg=2 (the uncond pipeline's stage adds zeros to the decision) or ulysses=2 (each
    stage's ranks hold half of every chunk's tokens), full warm-up, at 128² (64 tokens: every chunk splits)."""
    fields = {"width": 128, "height": 128, **cached("fbcache")}
    expected, cache = serial(model, conditioning, **fields)
    margin = min(abs(d.ratio - THRESHOLDS["fbcache"]) for d in cache.trace if d.ratio is not None)
    assert margin >= MARGIN and cache.counts["reused"] > 0, (margin, cache.counts)
    parallel = {"pipefusion": 2, **degrees, "warmup_steps": FIELDS["steps"]}
    result, info = backend4.sample({**FIELDS, **fields, "parallel": parallel}, conditioning)
    assert info["cache"] == cache.counts
    assert (result["samples"] - expected).abs().max().item() <= TOLERANCE


def test_patched_pipefusion_reuses_the_same_steps_on_every_stage(backend2, conditioning, method="fbcache"):
    """After warm-up (2 patches): threshold 0 is the uncached pipeline exactly (the flag row changes
    nothing); at a reusing threshold every stage skips the same steps, the step after warm-up computes,
    and the latent stays near the uncached pipeline's."""
    fields = {**FIELDS, "parallel": {"pipefusion": 2, "warmup_steps": 2}, "profile": True}
    uncached, _ = backend2.sample(fields, conditioning)
    zero, info = backend2.sample({**fields, "cache": method, "cache_threshold": 0.0}, conditioning)
    assert info["cache"] == {"computed": FIELDS["steps"], "reused": 0}
    assert torch.equal(zero["samples"], uncached["samples"])
    result, info = backend2.sample({**fields, **cached(method)}, conditioning)
    traces = [[reused for _, _, reused in record["cache_trace"]] for record in info["profile"]]
    assert traces[0] == traces[1] and len(traces[0]) == FIELDS["steps"], "the stages skipped different steps"
    assert info["cache"]["reused"] > 0 and not traces[0][2], info["cache"]  # step 2: the first patched one
    other_seed, _ = backend2.sample({**fields, "seed": FIELDS["seed"] + 1}, conditioning)
    distance = ((result["samples"] - uncached["samples"]).norm() / uncached["samples"].norm()).item()
    seeds = ((other_seed["samples"] - uncached["samples"]).norm() / uncached["samples"].norm()).item()
    assert distance < 0.1 * seeds, f"{method}: cached is {distance:.3g} from uncached, another seed {seeds:.3g}"


# (family, method, threshold) whose serial statistics stay ≥ MARGIN from the threshold at 10 steps, seed 7:
# Flux.2 and Z-Image decide on stage 1 (stage 0 holds the double blocks / the refiners, outside the span);
# HunyuanDiT's long skips travel between its stages.
PIPELINED = [("flux2-tiny", "teacache", 0.45), ("z-image-tiny", "teacache", 0.45), ("hunyuan-dit-tiny", "fbcache", 0.3)]


@pytest.mark.parametrize("name, method, threshold", PIPELINED, ids=[case[0] for case in PIPELINED])
def test_full_warmup_pipefusion_of_families_equals_their_cached_serial(backend2, name, method, threshold):
    fields = {"model": name, "width": 128, "height": 64, "steps": 10, "seed": 7, "cfg": 3.5, "cache": method,
              "cache_threshold": threshold}
    request = SampleRequest.parse(Message("sample", fields, {}))
    spec = registry.spec(name)
    model = registry.build(name, torch.device("cpu"))
    denoiser = Denoiser(model)
    with torch.no_grad():  # the conditioning rank 0 makes up for a request without tensors
        expected = generate(denoiser, request.generation(spec, *registry.random_conditioning(name, 1, 7, spec)))
    cache = denoiser.cache
    margin = min(abs(d.ratio - threshold) for d in cache.trace if d.ratio is not None)
    assert margin >= MARGIN and cache.counts["reused"] > 0, (margin, cache.counts)
    result, info = backend2.sample({**fields, "parallel": {"pipefusion": 2, "warmup_steps": 10}, "profile": True})
    assert info["cache"] == cache.counts
    for record in info["profile"]:  # the stage before the decider learns the decisions at the end
        assert [reused for _, _, reused in record["cache_trace"]] == [d.reused for d in cache.trace]
    bound = TOLERANCE * max(1.0, expected.abs().max().item())
    assert (result["samples"] - expected).abs().max().item() <= bound


FAMILY_SIZES = {"flux-tiny": {"width": 64, "height": 64}, "sd3-tiny": {"width": 128, "height": 64},
                "pixart-tiny": {"width": 128, "height": 64}, "wan-tiny": {"width": 64, "height": 64, "frames": 5},
                "hunyuan-video-1.5-tiny": {"width": 64, "height": 64, "frames": 5},
                "z-image-tiny": {"width": 128, "height": 64}, "hunyuan-dit-tiny": {"width": 128, "height": 64},
                "flux2-tiny": {"width": 128, "height": 64}, "qwen-image-tiny": {"width": 128, "height": 64},
                "cogvideox-tiny": {"width": 64, "height": 64, "frames": 5}}


@pytest.mark.parametrize("name", FAMILY_SIZES)
@pytest.mark.parametrize("method", ["fbcache", "teacache"])
def test_every_family_reuses_a_step_as_it_computed_it(name, method):
    """Each family's CachePlan (its span, the streams its blocks take and return, its probe): two model calls
    on the same input, the first computed, the second reused (its statistic is 0), give the same output; so a
    skipped block hands its streams on in the order its successor takes them and the tail residual is right."""
    request = SampleRequest.parse(Message("sample", {"model": name, **FAMILY_SIZES[name], "steps": 4, "seed": 5,
                                                     "cfg": 1.0}, {}))
    spec = registry.spec(name)
    positive, negative = registry.random_conditioning(name, 1, 5, spec)
    gen = request.generation(spec, positive, negative)
    model = registry.build(name, torch.device("cpu"))
    x = torch.randn(gen.latent.shape, generator=torch.Generator().manual_seed(1))
    sigma = gen.sigmas[1:2]  # [B]
    cache = StepCache(CacheOptions(method, threshold=1e9, start=0, end=0), steps=4, coefficients=spec.cache_plan.teacache)
    outputs = []
    with torch.no_grad(), cache.attached(model.transformer, spec.cache_plan):
        for _ in range(2):
            with cache.call(0, decides=True, rows=slice(None)):
                outputs.append(model.predict_x0(x, sigma, gen.positive, gen))
    assert [d.reused for d in cache.trace] == [False, True]
    computed, reused = outputs
    assert (reused - computed).abs().max().item() <= 1e-5 * max(1.0, computed.abs().max().item())
    uncached = model.predict_x0(x, sigma, gen.positive, gen)  # and the forwards are restored after
    assert torch.equal(uncached, computed)


def test_a_reused_stage_leaves_with_as_many_carried_tensors_as_it_computed():
    """A PipeFusion stage whose skipped blocks push long skips (HunyuanDiT's first half, 40 blocks deep:
    more than the tiny's 4 hold) leaves a reused step with the count the next stage's buffer expects,
    and its image is the computed step's (same input: the statistic is 0)."""
    from types import SimpleNamespace

    from xdit_backend.models.base import CachePlan
    from xdit_backend.parallel.step_cache import StageCache

    class Block(torch.nn.Module):
        def __init__(self, scale: float):
            super().__init__()
            self.scale = scale

        def forward(self, hidden_states, temb):
            return hidden_states * self.scale + temb

    def run_block(block, image, text, kwargs):  # every block pushes its output, as a first-half block does
        image = block(image, kwargs["temb"])
        kwargs["carry"].append(image)
        return image, text

    blocks = [Block(s) for s in (0.9, 1.1, 0.8, 1.2)]
    plan = CachePlan(blocks=("blocks",), returns={"blocks": ("hidden_states",)}, probe="temb", teacache=(1.0, 0.0))
    steps = StepCache(CacheOptions("fbcache", threshold=1.0, start=1, end=0), steps=2)
    stage = StageCache(steps, SimpleNamespace(blocks=blocks), plan, blocks, decides=True, rows=slice(None),
                       device=torch.device("cpu"))
    image, temb = torch.randn(1, 6, 4), torch.randn(1, 1, 4)
    outputs = []
    for step in range(2):
        kwargs = {"temb": temb, "carry": []}
        out, _ = stage.run(blocks, run_block, image, None, kwargs, (0, 1), step)
        outputs.append((out, len(kwargs["carry"])))
    stage.detach()
    (computed, pushed), (reused, left_with) = outputs
    assert [d.reused for d in steps.trace] == [False, True]
    assert left_with == pushed == 4
    assert torch.allclose(reused, computed, atol=1e-6)
