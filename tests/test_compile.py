"""``compile``: torch.compile'd transformer blocks (compile.py) give the eager latent (flux-tiny, float32,
max abs diff ≤ 1e-4; measured ≈ 2e-6), and a compiled model is compiled once, not per request.

Inductor builds C++ on the CPU: without a C++ compiler these tests fail (never skip), the first
one saying why. Compiling is slow on a small machine, so the requests are the smallest there are
and the in-process model is compiled once for the module.
"""

import pytest
import torch
from torch._dynamo.utils import counters

from xdit_backend import protocol
from xdit_backend.compile import compile_blocks
from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.protocol import Message
from xdit_backend.request import SampleRequest
from xdit_backend.sampling.generate import generate

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 3}


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def run(model, **fields) -> torch.Tensor:
    request = SampleRequest.parse(Message("sample", {**FIELDS, **fields}))
    positive, _ = registry.random_conditioning("flux-tiny", 1, request.seed, model.spec)
    with torch.no_grad():
        return generate(Denoiser(model), request.generation(model.spec, positive, None))


@pytest.fixture(scope="module")
def compiled():
    """A compiled flux-tiny after its first request: (model, that latent, graphs the request compiled)."""
    model = compile_blocks(registry.build("flux-tiny", torch.device("cpu")))
    before = graphs()
    latent = run(model)
    return model, latent, graphs() - before


def test_inductor_finds_a_cpp_compiler():
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as exc:
        pytest.fail(f"torch.compile (inductor) needs a C++ compiler on the CPU: {exc}; install g++ "
                    "(apt-get install g++) or set CXX")


def test_compiled_equals_eager_in_process(compiled):
    _, latent, new_graphs = compiled
    assert new_graphs > 0, "the first request compiled nothing: the blocks ran eagerly"
    difference = (latent - run(registry.build("flux-tiny", torch.device("cpu")))).abs().max().item()
    assert difference <= TOLERANCE, f"max |compiled − eager| = {difference:.3g}"


def test_later_requests_compile_nothing(compiled):
    """The same shape reuses the graphs; so do other resolutions (the token dimensions are dynamic)."""
    model, latent, _ = compiled
    before = graphs()
    again = run(model)
    assert graphs() == before, "the same request compiled again"
    assert torch.equal(again, latent)
    for width, height in ((128, 64), (128, 128)):
        run(model, width=width, height=height)
        assert graphs() == before, f"{width}×{height} compiled {graphs() - before} new graphs"


@pytest.mark.timeout(600)  # each rank compiles its ulysses graphs on one core
def test_compiled_equals_eager_through_a_backend(backend2):
    fields = {**FIELDS, "parallel": {"ulysses": 2}}
    eager, _ = backend2.sample(fields)
    compiled, _ = backend2.sample({**fields, "compile": True})
    difference = (compiled["samples"] - eager["samples"]).abs().max().item()
    assert difference <= TOLERANCE, f"ulysses=2: max |compiled − eager| = {difference:.3g}"
    assert {"flux-tiny (float32)", "flux-tiny (float32, compiled)"} <= set(backend2.status()["models"])


def test_compile_is_a_boolean_request_field_carried_to_every_rank():
    fields = {**FIELDS, "compile": True, "parallel": {"ulysses": 2}}
    decoded = protocol.decode_bytes(protocol.encode_bytes(Message("sample", fields)))
    request = SampleRequest.parse(decoded)
    assert request.compile and request.to_fields()["compile"] is True
    assert SampleRequest.parse(Message("sample", FIELDS)).compile is False
    with pytest.raises(protocol.FrameError, match="'compile'.*expected boolean"):
        protocol.decode_bytes(protocol.encode_bytes(Message("sample", {**FIELDS, "compile": 1})))
