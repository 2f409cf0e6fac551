"""``compile``: torch.compile'd transformer blocks (compile.py) give the eager latent (flux-tiny, float32,
max abs diff ≤ 1e-4; measured ≈ 2e-6), and a compiled model is compiled once, not per request:
not for a new resolution, a new prompt length, new per-request attention processors, nor for a
profiled request (whose traffic counting would swap the torch.distributed functions a compiled
block calls), nor for the step cache's decisions (a branch around the compiled blocks).

Inductor builds C++ on the CPU: without a C++ compiler these tests fail (never skip), the first
one saying why. Compiling is slow on a small machine, so the requests are the smallest there are
and the in-process model is compiled once for the module.
"""

import gc
import weakref
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.models import registry
from xdit_backend.parallel import attention, sequence, traffic
from xdit_backend.models.storage import StoredLinear
from xdit_backend.parallel.compile import compile_blocks, upcasts_left_eager
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.sampling.generate import generate
from xdit_backend.service.executor import Executor
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import Message

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 3}


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return counters["stats"]["unique_graphs"]


def run(model, text_tokens: int | None = None, **fields) -> torch.Tensor:
    """A request's latent; its prompt: the built-in stand-in, or ``text_tokens`` random tokens."""
    request = SampleRequest.parse(Message("sample", {**FIELDS, **fields}))
    positive, _ = registry.random_conditioning("flux-tiny", 1, request.seed, model.spec)
    if text_tokens is not None:
        shapes = model.spec.conditioning_shapes(1, text_tokens)
        positive = {key: torch.randn(shape, generator=torch.Generator().manual_seed(1)) for key, shape in shapes.items()}
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
    """Under ulysses=2 with the weights sharded: compile.py's compiled block forward runs between FSDP2's
    eager hooks (gather, then free); the eager sharded latent equals serial in test_parity.py."""
    backend2.unload()  # the session's backend: only this test's model is listed below
    fields = {**FIELDS, "parallel": {"ulysses": 2, "shard_weights": True}}
    eager, _ = backend2.sample(fields)
    compiled, _ = backend2.sample({**fields, "compile": True})
    difference = (compiled["samples"] - eager["samples"]).abs().max().item()
    assert difference <= TOLERANCE, f"ulysses=2, sharded: max |compiled − eager| = {difference:.3g}"
    [model] = backend2.status()["models"]  # one base: compiling made no copy
    assert model["name"] == "flux-tiny" and model["compiled"]
    profiled, info = backend2.sample({**fields, "compile": True, "profile": True})
    assert [record["sent_bytes"] for record in info["profile"]] == [None, None]  # not counted: traffic.py
    assert torch.equal(profiled["samples"], compiled["samples"])


def test_compile_is_a_boolean_request_field_carried_to_every_rank():
    fields = {**FIELDS, "compile": True, "parallel": {"ulysses": 2}}
    decoded = protocol.decode_bytes(protocol.encode_bytes(Message("sample", fields)))
    request = SampleRequest.parse(decoded)
    assert request.compile and request.to_fields()["compile"] is True
    assert SampleRequest.parse(Message("sample", FIELDS)).compile is False
    with pytest.raises(protocol.FrameError, match="'compile'.*expected boolean"):
        protocol.decode_bytes(protocol.encode_bytes(Message("sample", {**FIELDS, "compile": 1})))


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone: the collectives run, with nothing to exchange."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_profiling_a_compiled_model_leaves_what_its_graphs_guard_on(world_of_one):
    """Dynamo guards on the torch.distributed functions a compiled block calls, so counting traffic
    (which swaps them) would compile again; for a compiled model it counts nothing and swaps nothing."""
    def block(x):  # a compiled block's collective, as Shard.gather's all_gather
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x * 2, group=world_of_one)
        return torch.cat(parts) + 1

    compiled = torch.compile(block)
    x = torch.randn(4, 8)
    compiled(x)
    before = graphs()
    with traffic.counting(compiled=True) as sent:
        compiled(x)
    assert sent is None and graphs() == before
    with traffic.counting(compiled=False) as sent:  # why: an eager count's swap is a new graph
        compiled(x)
    assert sent == {"all_gather": 0} and graphs() > before


def test_sequence_parallel_processors_compile_once_for_every_prompt_length(compiled, world_of_one):
    """Our processors and kernel choice inside compiled blocks: attached anew per request (new objects)
    and for a new prompt length, they reuse the graphs (the text length is a dynamic size, not an
    attribute). One rank: the cut and the gather are whole, attention is the local kernel."""
    model = compiled[0]
    layout = SimpleNamespace(sequence_group=world_of_one, sequence_index=0, config=SimpleNamespace(sequence=1),
                             group=lambda name: None)

    def request(text_tokens: int) -> torch.Tensor:
        attached = sequence.attach(model.transformer, model.spec.sequence_plan, layout,
                                   attention.local_attention(torch.device("cpu")))
        try:
            return run(model, text_tokens)
        finally:
            attached.detach()

    first = graphs()
    request(8)
    before = graphs()
    assert before > first, "the processors' first request compiled nothing: the blocks ran eagerly"
    request(8)
    assert graphs() == before, "new processor objects compiled again"
    request(16)
    assert graphs() == before, f"a 16-token prompt compiled {graphs() - before} new graphs"


def test_the_step_cache_compiles_nothing_per_decision(compiled):
    """fbcache on compiled blocks at 144², 12 steps (the module's shapes: batch 1, one call a step; at 0.45 it
    reuses 7 steps, every statistic ≥ 0.03 from the threshold): the decision is a branch outside the blocks,
    so neither the cache nor another threshold, deciding other steps, compiles a graph that the same request
    without the cache did not; and the latent is the uncompiled cached run's."""
    model = compiled[0]
    fields = {**FIELDS, "width": 144, "height": 144, "steps": 12}

    def cached_run(target, threshold: float | None, **changes):
        cache = {} if threshold is None else {"cache": "fbcache", "cache_threshold": threshold}
        request = SampleRequest.parse(Message("sample", {**fields, **cache, **changes}))
        positive, _ = registry.random_conditioning("flux-tiny", 1, request.seed, target.spec)
        denoiser = Denoiser(target)
        with torch.no_grad():
            latent = generate(denoiser, request.generation(target.spec, positive, None))
        return latent, denoiser.cache

    cached_run(model, None, steps=2)  # this size, without the cache (dynamic tokens: nothing new expected)
    before = graphs()
    latent, cache = cached_run(model, 0.45)
    assert graphs() == before, f"the step cache compiled {graphs() - before} new graphs"
    assert 0 < cache.counts["reused"] < fields["steps"], cache.counts
    assert min(abs(d.ratio - 0.45) for d in cache.trace if d.ratio is not None) >= 0.01
    eager, eager_cache = cached_run(registry.build("flux-tiny", torch.device("cpu")), 0.45)
    assert [d.reused for d in cache.trace] == [d.reused for d in eager_cache.trace]
    difference = (latent - eager).abs().max().item()
    assert difference <= TOLERANCE, f"fbcache 0.45: max |compiled − eager| = {difference:.3g}"

    _, other = cached_run(model, 0.2)
    assert [d.reused for d in other.trace] != [d.reused for d in cache.trace], "0.2 decided as 0.45 did"
    assert graphs() == before, f"other decisions compiled {graphs() - before} new graphs"


def test_an_unloaded_compiled_model_leaves_no_weight_behind():
    """Nothing of dynamo's keeps an evicted compiled model's weights (gpu-paths-2.md B10): after unload
    no reference to its parameters is left, so release_memory gives their memory back."""
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    positive, _ = registry.random_conditioning("flux-tiny", 1, FIELDS["seed"], registry.spec("flux-tiny"))
    executor.generate(SampleRequest.parse(Message("sample", {**FIELDS, "compile": True}, positive)),
                      lambda done, total: True)
    [entry] = executor.cache.entries.values()
    assert entry.model.compiled_blocks is not None
    weight = weakref.ref(next(entry.model.transformer.parameters()))
    del entry
    assert executor.unload(None) == ["flux-tiny"]
    gc.collect()
    assert weight() is None, "an unloaded compiled model's weight is still referenced"


# On GPUs without Triton's float8 types (below compute capability 8.9: A100, RTX 30xx, A6000) each float8-stored
# layer's upcast stays out of the compiled graph, where Inductor would fuse it into a Triton kernel that fails to
# build; from 8.9 on, and for layers not stored in float8, nothing changes (gpu-paths-2.md B9).

def blocks_of(model) -> list:
    return [block for name in model.spec.stage_plan.block_lists for block in getattr(model.transformer, name)]


def graph_breaks(layer: StoredLinear) -> int:
    """Graph breaks dynamo takes tracing the layer's forward (the eager backend: nothing is compiled)."""
    return torch._dynamo.explain(layer.forward)(torch.randn(2, layer.in_features)).graph_break_count


@pytest.mark.parametrize("capability,left_eager", [((8, 6), True), ((8, 9), False)])  # RTX 30xx; RTX 40xx
def test_below_8_9_a_float8_layers_upcast_breaks_the_graph(capability, left_eager):
    model = registry.build("flux-tiny", torch.device("cpu"), weight_dtype="fp8_e4m3fn")
    layers = [m for block in blocks_of(model) for m in block.modules() if isinstance(m, StoredLinear)]
    assert layers and all(layer.weight.dtype == torch.float8_e4m3fn for layer in layers)
    x = torch.randn(2, layers[0].in_features)
    before = layers[0](x)
    assert upcasts_left_eager(blocks_of(model), capability) == (len(layers) if left_eager else 0)
    assert torch.equal(layers[0](x), before)  # the same arithmetic, only where it runs
    assert (graph_breaks(layers[0]) > 0) == left_eager


def test_layers_not_stored_in_float8_stay_in_the_graph():
    model = registry.build("flux-tiny", torch.device("cpu"))  # float32 weights: plain Linears
    assert upcasts_left_eager(blocks_of(model), (8, 0)) == 0
