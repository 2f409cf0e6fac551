"""PipeFusion beside its parity rows (full warm-up: test_parity.py): a small perturbation with stale K/V,
1/N of the blocks per rank, receives posted ahead of use, what it refuses, and cancelling."""

import pytest
import torch
import parity
from parity import PIPELINED, bound, family, serial

from xdit_backend.client import BackendError, Cancelled
from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

from .test_parity import FLUX as FIELDS


def conditioning():
    return parity.conditioning("flux")


def test_stale_kv_is_a_small_perturbation_of_the_right_image(backend2):
    """warmup 1, 8 steps: finite, and 10× closer to serial than another seed's serial latent is."""
    fields, tensors = {**FIELDS, "steps": 8}, conditioning()
    result, _ = backend2.sample({**fields, "parallel": {"pipefusion": 2, "warmup_steps": 1}}, tensors)
    reference = serial(fields, "flux")
    other_seed = serial({**fields, "seed": 22}, "flux")
    assert torch.isfinite(result["samples"]).all()
    staleness = (result["samples"] - reference).norm()
    assert staleness > 0, "with stale K/V the result cannot be exact: the patches were not used"
    assert 10 * staleness < (other_seed - reference).norm()


def parameter_split():
    full = registry.build("flux-tiny", torch.device("cpu")).transformer
    total = sum(p.numel() for p in full.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in [*full.transformer_blocks,
                                                                 *full.single_transformer_blocks]]
    return total, total - sum(blocks), blocks


def test_each_rank_holds_about_one_nth_of_the_parameters(backend2):
    """pipefusion=2: per-rank parameters ≈ total / 2, within the size of the embedding and output layers."""
    total, non_block, _ = parameter_split()
    _, info = backend2.sample({**FIELDS, "parallel": {"pipefusion": 2, "warmup_steps": 1}, "profile": True},
                              conditioning())
    for record in info["profile"]:
        assert abs(record["parameters"] - total / 2) <= non_block, record["rank"]


def test_every_block_lives_on_exactly_one_stage(backend4):
    """pipefusion=4: each rank holds the small shared layers plus its own blocks, and no block twice."""
    total, non_block, blocks = parameter_split()
    _, info = backend4.sample({**FIELDS, "parallel": {"pipefusion": 4, "warmup_steps": 1}, "profile": True},
                              conditioning())
    own = [record["parameters"] - non_block for record in info["profile"]]
    assert sum(own) == sum(blocks)
    assert max(own) <= sum(blocks) / 4 + max(blocks)  # balanced to within one block


def test_receives_are_posted_before_they_are_waited_on(backend2):
    """In every step, each rank posts the receives of all patches before waiting on the first."""
    patches = 4
    _, info = backend2.sample({**FIELDS, "parallel": {"pipefusion": 2, "warmup_steps": 1,
                                                      "num_pipeline_patch": patches}, "profile": True},
                              conditioning())
    for record in info["profile"]:
        trace = record["pipeline_trace"]
        for step in range(1, FIELDS["steps"]):  # after the one-patch warm-up step
            events = [kind for kind, s, _ in trace if s == step]
            first_wait = events.index("wait") if "wait" in events else len(events)
            assert events[:first_wait].count("post") == patches, (record["rank"], step, events)


def test_flux2_with_a_short_prompt_equals_serial_on_the_text_padded_to_512(backend2):
    """8 positive and 20 negative text tokens (as Flux.2-dev's Mistral encoder gives for a short prompt), full
    warm-up at pipefusion=2: equal to serial on the text padded to 512 with zeros in front, written out here."""
    message = family("flux2-tiny")
    g = torch.Generator().manual_seed(9)
    positive, negative = torch.randn(1, 8, 96, generator=g), torch.randn(1, 20, 96, generator=g)
    short = {"context": positive, "negative_context": negative}
    padded = {"context": torch.cat([torch.zeros(1, 504, 96), positive], dim=1),
              "negative_context": torch.cat([torch.zeros(1, 492, 96), negative], dim=1)}
    result, _ = backend2.sample({**message, "parallel": {"pipefusion": 2, "num_pipeline_patch": 4,
                                                         "warmup_steps": message["steps"]}}, short)
    reference = serial_latent(message, padded)
    assert (result["samples"] - reference).abs().max() <= bound(reference)


def test_z_image_with_image_pad_tokens_is_refused_with_the_rule(backend2):
    """112 × 80 px: 35 image tokens, padded to 64 with pad tokens no PipeFusion stage can hold."""
    message = family("z-image-tiny", width=112, height=80)
    with pytest.raises(BackendError, match="image tokens are a multiple of 32; 112 × 80 px has 35"):
        backend2.sample({**message, "parallel": {"pipefusion": 2}})


def test_a_sampler_with_two_calls_per_step_is_refused_by_name(backend2):
    with pytest.raises(BackendError, match="sampler 'heun' cannot run with PipeFusion: it calls the model twice"):
        backend2.sample({**family("sd3-tiny", sampler="heun"), "parallel": {"pipefusion": 2}})


@pytest.mark.parametrize("model", PIPELINED)
def test_family_stale_kv_is_a_small_perturbation(model, backend2):
    """warm-up 1, 4 patches: finite, inexact, and far closer to serial than another seed is."""
    message = family(model, steps=6)
    result, _ = backend2.sample({**message, "parallel": {"pipefusion": 2, "num_pipeline_patch": 4,
                                                         "warmup_steps": 1}})
    reference, other = serial(message), serial({**message, "seed": 8})
    staleness = (result["samples"] - reference).norm()
    assert torch.isfinite(result["samples"]).all() and staleness > 0
    assert 10 * staleness < (other - reference).norm()


def test_cancel_stops_every_stage_and_the_next_request_is_right(backend2):
    """A cancel after step 3 of 200 (4 patches, pipelined steps): the request ends within a few steps
    (the gate stops every rank within two of its own steps), and the next request is exact again."""
    layout = {"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 1}
    first, _ = backend2.sample({**FIELDS, "parallel": layout}, conditioning())
    seen = []
    with pytest.raises(Cancelled):
        backend2.sample({**FIELDS, "steps": 200, "parallel": layout}, conditioning(),
                        on_progress=lambda step, total, elapsed: seen.append(step), should_cancel=lambda: len(seen) >= 3)
    assert max(seen) < 20, seen
    again, _ = backend2.sample({**FIELDS, "parallel": layout}, conditioning())
    assert torch.equal(first["samples"], again["samples"])


def test_a_request_with_nothing_to_do_returns_its_latent_under_dp(backend4):
    """start_step past the end, pipefusion=2 × dp=2: each dp group's rows come back as given (gathered
    over dp from the stages' devices)."""
    latent = torch.randn(2, 16, 8, 16, generator=torch.Generator().manual_seed(3))  # [B, C, h, w] of 128×64
    result, _ = backend4.sample({**FIELDS, "start_step": FIELDS["steps"], "add_noise": False,
                                 "parallel": {"pipefusion": 2, "dp": 2}}, {**conditioning(), "latent": latent})
    assert torch.equal(result["samples"], latent)
