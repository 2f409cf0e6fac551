"""The step cache (parallel/step_cache.py) through a backend: every layout takes the serial run's decisions and
gives its latent.

flux-tiny at 144×144 px (9 × 9 = 81 image tokens) with 7-token prompts: under ulysses=2 and ring=2 each
rank holds a padded share, so the decision's sums must leave the padding out to match serial.
"""

import pytest
import torch
from conftest import flux_tiny_conditioning

from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.sampling.generate import generate
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message
from unit.test_step_cache import (FIELDS, MARGIN, THRESHOLDS, TOLERANCE, cached, cached_serial,  # noqa: F401
                                  conditioning, model, serial)

LAYOUTS = [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}, {"dp": 2}, {"ulysses": 2, "shard_weights": True}]

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
# Flux.2, Z-Image and Chroma decide on stage 1 (stage 0 holds the double blocks / the refiners, outside the span);
# HunyuanDiT's long skips travel between its stages.
PIPELINED = [("flux2-tiny", "teacache", 0.45), ("z-image-tiny", "teacache", 0.45), ("hunyuan-dit-tiny", "fbcache", 0.3),
             ("chroma-tiny", "teacache", 0.5)]


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
