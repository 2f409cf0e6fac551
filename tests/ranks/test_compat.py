"""The torch range (distributed/compat.py): every API newer than the oldest supported torch has its
fallback, and each fallback runs here, on the pinned torch, with the newer name taken away."""

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks
from torch.distributed import device_mesh

from xdit_backend.distributed import compat
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.distributed.mesh import MeshCache
from xdit_backend.parallel import traffic

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_claims_the_oldest_torch_the_code_supports():
    [claim] = re.findall(r'^\s*"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert compat.version(claim) == compat.MIN_TORCH


def test_an_older_torch_is_refused_with_the_version_and_the_fix():
    why = compat.unsupported("2.6.0+cu124")
    assert why.startswith("torch 2.6.0+cu124 is older than 2.7") and "pip install 'torch>=2.7'" in why
    assert compat.unsupported("2.7.1+cu128") is None and compat.unsupported("2.15.0") is None
    assert compat.unsupported() is None  # the torch this suite runs on


def _profiled_gathers_without_all_gather_single(rank: int) -> dict:
    """torch < 2.13: no dist.all_gather_single; FSDP2 gathers with all_gather_into_tensor."""
    if hasattr(dist, "all_gather_single"):  # torch ≥ 2.13: taken away in this spawned rank only
        del dist.all_gather_single
    shard = torch.full((3,), float(rank))
    out = torch.empty(6)
    with traffic.counting(compiled=False) as sent:
        dist.all_gather_into_tensor(out, shard)
    return {"sent": dict(sent), "gathered": out.tolist(), "restored": not hasattr(dist, "all_gather_single")}


def test_the_traffic_count_works_on_a_torch_without_all_gather_single():
    """Before the fix, entering the count raised AttributeError: every profiled request failed below 2.13."""
    for rank, seen in enumerate(on_ranks(_profiled_gathers_without_all_gather_single, 2)):
        assert seen["sent"] == {"shard_all_gather": 3 * 4}, (rank, seen)  # 3 float32 to the one other rank
        assert seen["gathered"] == [0.0] * 3 + [1.0] * 3 and seen["restored"], (rank, seen)


def _every_name_counted_once(rank: int) -> dict:
    names = compat.single_tensor_all_gathers()
    with traffic.counting(compiled=False) as sent:
        for name in names:
            getattr(dist, name)(torch.empty(4), torch.full((2,), float(rank)))
    return {"names": names, "sent": dict(sent)}


def test_where_both_names_exist_each_gather_is_counted_once():
    """torch ≥ 2.13: FSDP2 calls all_gather_single and the deprecated all_gather_into_tensor calls torch's
    own function, not the wrapped attribute; every name there is is wrapped, and a gather through any
    of them counts once: 2 float32 to the one other rank, per name."""
    for seen in on_ranks(_every_name_counted_once, 2):
        names = tuple(n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n))
        assert seen["names"] == names and seen["sent"] == {"shard_all_gather": 8 * len(names)}, seen


def _layouts_without_the_new_mesh_api(rank: int) -> dict:
    """init_device_mesh's backend_override and DeviceMesh._flatten arrived in 2.9: the mesh uses neither."""
    del device_mesh.init_device_mesh, device_mesh.DeviceMesh._flatten
    from datetime import timedelta

    cache = MeshCache("cpu", timedelta(seconds=30))
    seen = {}
    for name, config in {"sequence": ParallelConfig(ring=2, ulysses=2, shard_weights=True),
                         "pipeline": ParallelConfig(pipefusion=2, ulysses=2, shard_weights=True)}.items():
        layout = cache.get(config, step_cache=True)
        total = torch.ones(1)
        dist.all_reduce(total, group=layout.sequence_group)
        seen[name] = {"sequence sum": total.item(), "shard ranks": layout.shard_mesh.mesh.tolist(),
                      "step group size": dist.get_world_size(layout.step_group),
                      "coordinates": [layout.index(axis) for axis in ("pipefusion", "ring", "ulysses")]}
    dist.barrier()  # torch 2.7: a rank outside a new group does not wait for its members, and rank 0 holds the store
    return seen


def test_the_mesh_builds_every_layout_without_init_device_mesh_or_flatten():
    """World 4; FSDP2 over the shard mesh this builds runs in every sharded parity row (tests/backend)."""
    for rank, seen in enumerate(on_ranks(_layouts_without_the_new_mesh_api, 4)):
        assert seen["sequence"]["sequence sum"] == 4 and seen["sequence"]["shard ranks"] == [0, 1, 2, 3], seen
        assert seen["sequence"]["coordinates"] == [0, rank // 2, rank % 2], seen
        stage = rank // 2
        assert seen["pipeline"]["sequence sum"] == 2 and seen["pipeline"]["step group size"] == 2, seen
        assert seen["pipeline"]["shard ranks"] == [2 * stage, 2 * stage + 1], seen
        assert seen["pipeline"]["coordinates"] == [stage, 0, rank % 2], seen


def test_a_rank_on_an_older_torch_stops_at_start_with_that_reason(monkeypatch, tmp_path):
    """The check comes first in start_runtime: nothing joins a process group on a torch it cannot run."""
    from xdit_backend.distributed.runtime import StartupError, start_runtime
    from xdit_backend.launch.options import LaunchOptions

    monkeypatch.setattr(torch, "__version__", "2.6.0+cu124")
    with pytest.raises(StartupError, match=r"torch 2\.6\.0\+cu124 is older than 2\.7"):
        start_runtime(LaunchOptions(socket=tmp_path / "b.sock", nproc=1, device="cpu"))
    assert not dist.is_initialized()
