"""The memory-aware model cache: with a device budget that holds two models, loading a third evicts the
least recently used one; a model that cannot fit even after evicting everything is refused before
loading, naming the rank, the bytes needed and free, and the fixes; nothing is evicted then. The
budget is the tests-only XDIT_TEST_MEMORY_BUDGET; the models' bytes are counted here."""

from datetime import timedelta

import pytest
import torch
from conftest import SMALL

from xdit_backend.client import BackendError
from xdit_backend.distributed.runtime import Runtime
from xdit_backend.memory.fit import TEST_BUDGET_ENV, NotEnoughMemory
from xdit_backend.models import registry
from xdit_backend.service.executor import Executor
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message


def model_bytes(dtype: torch.dtype) -> int:
    transformer = registry.build("flux-tiny", torch.device("cpu"), dtype).transformer
    return sum(t.numel() * t.element_size() for t in (*transformer.parameters(), *transformer.buffers()))


def run(executor: Executor, dtype: str) -> None:
    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)
    request = SampleRequest.parse(Message("sample", {**SMALL, "steps": 1, "dtype": dtype}, positive))
    executor.generate(request, lambda done, total: True)


def loaded(executor: Executor) -> list[str]:
    return [key.compute_dtype for key in executor.cache.entries]  # least recently used first


def test_a_budget_for_two_models_evicts_the_least_recently_used_third(monkeypatch):
    full, half = model_bytes(torch.float32), model_bytes(torch.bfloat16)
    monkeypatch.setenv(TEST_BUDGET_ENV, str(full + half + half // 2))  # the third needs one evicted
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    run(executor, "float32")
    run(executor, "bfloat16")
    assert loaded(executor) == ["float32", "bfloat16"], "two models that fit together stay loaded together"
    run(executor, "float32")  # now bfloat16 is the least recently used
    run(executor, "float16")
    assert loaded(executor) == ["float32", "float16"]
    assert executor.held_bytes() <= full + half + half // 2


def test_a_model_that_cannot_fit_is_refused_before_loading_and_nothing_is_evicted(monkeypatch):
    half = model_bytes(torch.bfloat16)
    monkeypatch.setenv(TEST_BUDGET_ENV, str(half + half // 2))
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    run(executor, "bfloat16")
    with pytest.raises(NotEnoughMemory) as refused:
        run(executor, "float32")  # twice the bytes: not even with bfloat16 evicted
    message = str(refused.value)
    assert "rank 0 cannot load flux-tiny" in message and "nothing was loaded" in message
    needed = float(message.split("needs ")[1].split(" GB")[0]) * 1e9
    assert needed >= model_bytes(torch.float32) - 5e6  # printed in GB with 2 decimals
    assert message.index("shard_weights") < message.index("fp8") < message.index("more GPUs")
    assert loaded(executor) == ["bfloat16"]


def test_a_request_too_large_for_the_loaded_model_is_refused_before_it_runs(monkeypatch):
    """Issue 25 (1): every request is sized, not only the one that loads the model: with room for flux-tiny
    and a 64² request, a 512² request on the loaded model is refused (its activations named, nothing run), the
    model stays loaded, and a 64² request runs again."""
    from xdit_backend.memory.fit import needed, request_shape
    from xdit_backend.models.resolved import resolve_model

    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)

    def request(side: int) -> SampleRequest:
        return SampleRequest.parse(Message("sample", {**SMALL, "width": side, "height": side, "steps": 1}, positive))

    def estimate(side: int):
        tokens, rows = request_shape(request(side), spec, positive["context"].shape[1])
        return needed(resolve_model("flux-tiny"), torch.float32, "default", 1, None, tokens, rows)

    small, large = estimate(64), estimate(512)
    monkeypatch.setenv(TEST_BUDGET_ENV, str(small.total + (large.total - small.total) // 2))
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    executor.generate(request(64), lambda done, total: True)
    with pytest.raises(NotEnoughMemory) as refused:
        executor.generate(request(512), lambda done, total: pytest.fail("the refused request ran a step"))
    message = refused.value.message
    assert message.startswith("rank 0 cannot run this request on flux-tiny, which it holds: the request needs ")
    assert "activations" in message and message.endswith("nothing was run")
    assert "smaller size" in refused.value.hint
    assert loaded(executor) == ["float32"]
    executor.generate(request(64), lambda done, total: True)


def test_every_rank_refuses_at_once_and_the_backend_keeps_serving(backends, monkeypatch):
    """All ranks agree before loading: no rank waits out a collective timeout for one that refused."""
    monkeypatch.setenv(TEST_BUDGET_ENV, str(model_bytes(torch.float32) // 2))
    client = backends.start(2, collective_timeout=60.0, heartbeat=20.0)
    with pytest.raises(BackendError) as refused:
        client.sample({**SMALL, "parallel": {"ulysses": 2}})
    assert refused.value.kind == "out_of_memory" and "cannot load flux-tiny" in refused.value.message
    assert "shard_weights" in refused.value.hint and "keeps serving" in refused.value.hint
    status = client.status()
    assert status["models"] == [] and all(r["memory"]["parameters"] == 0 for r in status["ranks"])


def test_on_a_gpu_free_memory_counts_the_allocators_unused_cache_and_an_oom_names_the_bytes(monkeypatch):
    """CUDA's queries monkeypatched (no GPU here): what can be had is the driver's free memory plus what
    this process's caching allocator reserved but does not use; an out-of-memory names this rank's
    allocated bytes and the device's free and total, then the fixes."""
    from xdit_backend.memory import fit as memory_fit

    gib = 2**30
    monkeypatch.delenv(TEST_BUDGET_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * gib, 24 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 8 * gib)
    cuda = torch.device("cuda", 1)
    assert memory_fit.available(cuda, held=7 * gib) == 5 * gib
    error = memory_fit.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                     1, cuda, held=7 * gib)
    message = str(error)
    assert message.startswith("rank 1 ran out of memory (OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert "8.59 GB allocated by this rank, 3.22 GB free of 25.77 GB on cuda:1" in message
    assert message.index("shard_weights") < message.index("fp8") < message.index("more GPUs")



def test_auto_shards_the_weights_when_only_a_share_fits(backends, monkeypatch):
    """With a budget between the memory model's sharded and unsharded needs of auto's layout, auto turns
    shard_weights on and says so, and the sharded run equals the serial one."""
    from xdit_backend.distributed.config import ParallelConfig
    from xdit_backend.memory.fit import needed, request_shape
    from xdit_backend.models.resolved import resolve_model

    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)
    fields = {**SMALL, "steps": 2, "cfg": 1.0}  # one guided pass: auto picks ulysses=2 on two ranks

    def need(config):
        request = SampleRequest.parse(Message("sample", {**fields, "parallel": config.to_json()}, positive))
        tokens, rows = request_shape(request, spec, positive["context"].shape[1])
        shard_ranks = config.shard_size if config.shard_weights else 1
        return needed(resolve_model("flux-tiny"), torch.float32, "default", shard_ranks, config, tokens, rows).total

    whole, shared = need(ParallelConfig(ulysses=2)), need(ParallelConfig(ulysses=2, shard_weights=True))
    assert shared < whole, "a share of the blocks must need less than the whole model"
    monkeypatch.setenv(TEST_BUDGET_ENV, str((whole + shared) // 2))
    client = backends.start(2, collective_timeout=60.0, heartbeat=20.0)
    tensors, info = client.sample(fields, positive)
    assert info["layout"].startswith("ulysses=2") and "weights sharded 2 ways" in info["layout"], info["layout"]
    serial = serial_latent(fields, positive)
    torch.testing.assert_close(tensors["samples"], serial, rtol=1e-4, atol=1e-5)


def test_on_the_cpu_the_ranks_of_a_host_share_its_memory(monkeypatch):
    """Issue 25 (3): CPU ranks share the host's available memory, so each counts on its share: a model and
    request that fit in what is available are refused to each of two ranks on the host when they do not fit
    in half of it."""
    from xdit_backend import device as device_memory
    from xdit_backend.memory.fit import needed, request_shape
    from xdit_backend.models.resolved import resolve_model

    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)
    request = SampleRequest.parse(Message("sample", {**SMALL, "steps": 1}, positive))
    tokens, rows = request_shape(request, spec, positive["context"].shape[1])
    need = needed(resolve_model("flux-tiny"), torch.float32, "default", 1, None, tokens, rows).total
    monkeypatch.delenv(TEST_BUDGET_ENV, raising=False)
    monkeypatch.setattr(device_memory, "free_and_total", lambda device: (need * 3 // 2, 10 * need))
    alone = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    alone.generate(request, lambda done, total: True)
    shared = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30), local_world_size=2))
    with pytest.raises(NotEnoughMemory, match="rank 0 cannot load flux-tiny"):
        shared.generate(request, lambda done, total: True)


def test_a_cpu_allocation_failure_is_reported_as_running_out_of_memory(monkeypatch):
    """Issue 25 (3): the CPU allocator's RuntimeError gets the readable out-of-memory message a GPU's has."""
    failed = RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
                          "tried to allocate 41943040000 bytes. Error code 12 (Cannot allocate memory)")
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))

    def allocate(request, after_step):
        raise failed

    monkeypatch.setattr(executor, "_generate", allocate)
    with pytest.raises(NotEnoughMemory) as error:
        executor.generate(None, lambda done, total: True)
    assert error.value.message.startswith("rank 0 ran out of memory (RuntimeError: [enforce fail at alloc_cpu.cpp:117]")
    assert "GB available of" in error.value.message and "shard_weights" in error.value.hint
    monkeypatch.setattr(executor, "_generate", lambda request, after_step: torch.ones(2, 3) @ torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # any other error is left as it is
        executor.generate(None, lambda done, total: True)
