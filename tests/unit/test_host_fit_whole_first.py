"""Issue 25 item 2's host memory while loading: where this torch builds a sharded model whole in host memory
before sharding it (before 2.8; GGUF before 2.13: parallel/shard.builds_whole_first), the fit check sizes that
load against the host, and refuses it with the reason and the fixes instead of letting the out-of-memory killer
end a rank; where each rank reads only its rows, the same budget admits it. A rank's fit check alone, with the test
budget standing in for the host's memory."""

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from xdit_backend.distributed import compat
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.memory import fit as memory_fit
from xdit_backend.memory.fit import NotEnoughMemory
from xdit_backend.models.resolved import resolve_model
from xdit_backend.service.executor import Executor
from xdit_backend.service.model_cache import ModelKey

CPU = torch.device("cpu")


def _many_blocks_file(tmp_path) -> str:
    """A narrow Flux file of 17 blocks, so a rank's share plus two gathered blocks is well under the whole."""
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import save_file

    from backend.test_model_files import bfl_state_dict

    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=16,
                                   attention_head_dim=128, num_attention_heads=1, joint_attention_dim=32,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(16, 56, 56))
    path = tmp_path / "flux-17-blocks.safetensors"
    save_file(bfl_state_dict(model), str(path))
    return str(path)


def _make_room(monkeypatch, path: str, budget: int):
    rt = SimpleNamespace(device=CPU, rank=0, world_size=1, local_world_size=2, control=None,
                         timeout=timedelta(seconds=60), data_backend="gloo")
    executor = Executor(rt)
    model = resolve_model(path)
    key = ModelKey(model.cache_name, model.version, "float32", "default", (0, 1), None)
    request = SimpleNamespace(parallel=ParallelConfig(ulysses=2, shard_weights=True), width=64, height=64, frames=1,
                              batch=1, cfg=1.0, reference_tokens=lambda spec: 0)
    monkeypatch.setenv(memory_fit.TEST_BUDGET_ENV, str(budget))
    executor.make_room(model, key, request.parallel, *memory_fit.request_shape(request, model.spec, 8))


def test_a_load_that_builds_whole_first_is_sized_against_the_host(monkeypatch, tmp_path):
    path = _many_blocks_file(tmp_path)
    model = resolve_model(path)
    whole = memory_fit.needed(model, torch.float32, "default", 1, None, 0, 1).weights_resident
    config = ParallelConfig(ulysses=2, shard_weights=True)
    sharded = memory_fit.needed(model, torch.float32, "default", 2, config, 12, 1).total  # 64²: (16 + 8) / 2 tokens
    sharded *= 1.05  # make_room's own count of the request's tokens may differ by a few
    assert sharded < whole, (sharded, whole)  # the case: a rank's share fits where the whole model does not
    budget = int(whole + sharded) // 2
    monkeypatch.setattr(compat, "fsdp_shards_mixed_dtypes", lambda: True)  # as torch 2.8 on: each rank reads its
    _make_room(monkeypatch, path, budget)                                   # rows, so the share fits: admitted
    monkeypatch.setattr(compat, "fsdp_shards_mixed_dtypes", lambda: False)  # as torch 2.7
    with pytest.raises(NotEnoughMemory) as refused:
        _make_room(monkeypatch, path, budget)
    assert f"cannot load {path} sharded on this torch: it builds the whole model in host memory" in refused.value.message
    assert "install torch ≥ 2.8" in refused.value.hint
