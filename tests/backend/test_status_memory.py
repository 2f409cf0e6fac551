"""``status`` shows memory: each rank's device memory and the bytes its models hold, and per loaded
model its precision, sharding, LoRAs and bytes on every rank. The expected bytes are counted here from
a model built in the test."""

from datetime import timedelta

import torch
from conftest import SMALL
from safetensors.torch import save_file

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.models import registry
from xdit_backend.service.executor import Executor

MEMORY_KEYS = {"total", "free", "allocated", "peak", "parameters"}


def test_status_reports_each_ranks_memory_and_each_models_bytes_per_rank(backend2, tmp_path):
    width, rank = 64, 2  # flux-tiny's width, the LoRA's rank
    path = tmp_path / "style.safetensors"
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(rank, width),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(width, rank)}, str(path))
    lora_bytes = 2 * rank * width * 4
    transformer = registry.build("flux-tiny", torch.device("cpu")).transformer
    model_bytes = sum(t.numel() * t.element_size() for t in (*transformer.parameters(), *transformer.buffers()))

    backend2.unload()  # the session's backend: only this test's models count
    backend2.sample({**SMALL, "parallel": {"ulysses": 2}, "loras": [{"path": str(path), "strength": 0.5}]})
    status = backend2.status()
    for entry in status["ranks"]:
        memory = entry["memory"]
        assert set(memory) == MEMORY_KEYS and all(isinstance(v, int) for v in memory.values()), memory
        assert 0 < memory["free"] <= memory["total"] and 0 < memory["allocated"] <= memory["peak"], memory
        assert memory["parameters"] == model_bytes + lora_bytes, entry["rank"]
    assert status["models"] == [{
        "name": "flux-tiny", "storage_dtype": "float32", "compute_dtype": "float32", "weight_dtype": "default",
        "sharded": False, "loras": [{"path": str(path.resolve()), "strength": 0.5}], "compiled": False,
        "pipefusion_stages": False, "bytes_per_rank": [model_bytes, model_bytes]}]

    backend2.sample({**SMALL, "parallel": {"pipefusion": 2, "num_pipeline_patch": 2, "warmup_steps": 1}})
    staged = [m for m in backend2.status()["models"] if m["pipefusion_stages"]]
    assert len(staged) == 1 and all(0 < b < model_bytes for b in staged[0]["bytes_per_rank"]), staged

    backend2.unload()
    status = backend2.status()
    assert status["models"] == [] and all(r["memory"]["parameters"] == 0 for r in status["ranks"])


def test_local_rank_0_gives_the_allocators_cache_back_after_each_request(monkeypatch):
    """The GPU local rank 0 shares with ComfyUI gets the cached blocks back; the other GPUs keep theirs."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    for local_rank in (0, 1):
        rt = Runtime(local_rank, 2, local_rank, torch.device("cuda", local_rank), None, 0.0, timedelta(seconds=30))
        Executor(rt).spare_shared_gpu()
    assert emptied == [True]


def test_a_gpu_ranks_memory_is_the_drivers_free_and_total_and_the_allocators_bytes(monkeypatch):
    from xdit_backend import device

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5, 24))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 9)
    assert device.snapshot(torch.device("cuda", 0), parameters=6) == {
        "total": 24, "free": 5, "allocated": 7, "peak": 9, "parameters": 6}
