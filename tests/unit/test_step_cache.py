"""The step cache (parallel/step_cache.py) in-process: its serial decisions, and each family's plan. Through a
backend (every layout takes the serial run's decisions and gives its latent): tests/backend/test_step_cache.py.

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
