"""What the parallel layouts do beside giving the serial latent (test_parity.py): the bytes they send, the groups
they build, prompts of different lengths on the two sides of the guidance."""

import pytest
import torch
import parity

from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.service.request import SampleRequest
from xdit_backend.service.reference import serial_latent
from xdit_backend.wire.protocol import Message

from .test_parity import FLUX

TOLERANCE = 1e-4  # every layout against serial: test_parity.py
FIELDS = FLUX


@pytest.fixture(scope="module")
def conditioning():
    return parity.conditioning("flux")


@pytest.fixture(scope="module")
def serial():
    return parity.serial(FIELDS, "flux")


def test_different_seeds_differ_beyond_the_tolerance(backend2, serial, conditioning):
    """The tolerance is meaningful: another seed moves the latent far more than it allows."""
    result, _ = backend2.sample({**FIELDS, "seed": 22, "parallel": {"ulysses": 2}}, conditioning)
    assert (result["samples"] - serial).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("degrees", [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}, {"dp": 2}], ids=str)
def test_counted_traffic_equals_the_formula(backend2, conditioning, degrees):
    """Bytes each rank sends, counted from the collectives, equal the method's algebra in bench.py."""
    from xdit_backend.distributed.cost import traffic_formula
    from xdit_backend.models.registry import BUILTINS

    config = BUILTINS["flux-tiny"].config
    dims = {"attention_layers": config["num_layers"] + config["num_single_layers"],
            "hidden": config["num_attention_heads"] * config["attention_head_dim"], "text_tokens": 8}
    _, info = backend2.sample({**FIELDS, "parallel": degrees, "profile": True}, conditioning)
    expected, _ = traffic_formula(degrees, dims, FIELDS)
    for record in info["profile"]:
        sent = sum(v for k, v in record["sent_bytes"].items() if k != "control")
        assert sent == pytest.approx(expected * FIELDS["steps"], abs=8), record
        assert len(record["step_s"]) == FIELDS["steps"] and record["peak_memory_bytes"] > 0


def test_a_warm_layout_creates_no_process_group_per_request(backend4, conditioning):
    """The mesh (and the flattened ring × ulysses group) is built once; later requests reuse it."""
    fields = {**FIELDS, "steps": 1, "parallel": {"ulysses": 2, "ring": 2}, "profile": True}
    backend4.sample(fields, conditioning)  # builds the mesh, unless an earlier test did
    _, second = backend4.sample(fields, conditioning)
    assert [r["process_groups_created"] for r in second["profile"]] == [0, 0, 0, 0]


def test_prompts_of_different_lengths_guide_exactly_serial_and_parallel(backend2, conditioning):
    """Qwen2.5-VL and Qwen3 prompts are not padded, so the two sides' contexts differ in length and
    cannot run as one batch: each side runs on its own (as ComfyUI runs conds that cannot concat),
    in the serial path and under cfg and ulysses; PipeFusion, which batches them, says so."""
    from xdit_backend.client import BackendError

    tensors = {**conditioning, "negative_context": conditioning["negative_context"][:, :4].contiguous()}
    request = SampleRequest.parse(Message("sample", FIELDS, tensors))
    model = registry.build("flux-tiny", torch.device("cpu"))
    positive, negative = request.conditioning(model.spec)
    gen = request.generation(model.spec, positive, negative)
    x, sigma = torch.randn(2, 16, 8, 16, generator=torch.Generator().manual_seed(3)), torch.tensor([0.7, 0.7])
    with torch.no_grad():
        denoiser = Denoiser(model)
        guided = denoiser.x0(x, sigma, denoiser.conditioning(positive, negative), gen)
        cond, uncond = (model.predict_x0(x, sigma, side, gen) for side in (positive, negative))
        assert torch.allclose(guided, uncond + (cond - uncond) * FIELDS["cfg"], atol=1e-6)
    serial = serial_latent(FIELDS, tensors)
    for degrees in ({"cfg": 2}, {"ulysses": 2}):
        result, _ = backend2.sample({**FIELDS, "parallel": degrees}, tensors)
        difference = (result["samples"] - serial).abs().max().item()
        assert difference <= TOLERANCE, f"{degrees}: max |parallel − serial| = {difference:.3g}"
    with pytest.raises(BackendError, match=r"PipeFusion runs the two sides of the guidance as one batch, and they "
                                           r"differ: context \[2, 8, 64\] vs \[2, 4, 64\]"):
        backend2.sample({**FIELDS, "parallel": {"pipefusion": 2}}, tensors)
