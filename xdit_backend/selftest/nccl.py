"""The selftest's one-rank NCCL section: what only NCCL can show, on one GPU (review gpu-paths-2 C.2).

One GPU cannot hold two NCCL ranks ("Duplicate GPU detected"), and at world 1 the backend builds no layout,
so the selftest's backend never runs these. A world of one in this process runs them at a degree-1 layout:
- the mesh cache's groups on NCCL, with their timeout options, and the step cache's gloo group beside them;
- a float64 all-reduce on NCCL;
- FSDP2 over a one-rank CUDA mesh for every storage precision (bf16; fp8, scaled fp8, GGUF Q8_0 and Q4_K
  files), the sharded latent against the unsharded model's, eager, and compiled for bf16, fp8 and Q8_0;
- ``MeshCache.clear`` (the aborts of ``release``) with a collective still queued behind a sleeping kernel, then
  the mesh built again and used.
The CPU dry run runs the same on gloo, without compile and without a collective held in flight.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

from ..distributed import compat
from ..distributed.config import ParallelConfig
from ..distributed.mesh import MeshCache
from ..models import registry
from ..parallel import shard
from ..parallel.compile import compile_blocks
from .files import BF16, written
from .models import distance, generation
from .runner import Checks, Context, Skip

MODEL = "flux-tiny"
ONE_RANK = ParallelConfig(shard_weights=True)  # degree 1 everywhere; validate would refuse it, the mesh cache builds it
REQUEST = {"width": 128, "height": 128, "steps": 3, "seed": 7, "cfg": 1.0}
COMPILED = ("bf16", "fp8", "gguf_q8_0")  # one of each kind of storage: plain, float8, GGUF blocks
SHARDED_TOLERANCE = 1e-5  # relative L2: one rank's all-gather returns its own shard, the same numbers
COMPILED_TOLERANCE = 2e-2  # relative L2, compiled bf16 against eager bf16 (the compile section's bound)
SLEEP_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of a GPU at 2 GHz, a collective queued behind it


@contextmanager
def world_of_one(device: torch.device):
    """This process as rank 0 of a one-rank world: NCCL on CUDA, gloo on the CPU."""
    if dist.is_initialized():
        raise Skip("this process already belongs to a process group")
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if cuda else None)
    try:
        yield
    finally:
        dist.destroy_process_group()


def nccl(ctx: Context, checks: Checks) -> None:
    device, request = ctx.device, {**REQUEST, **({"width": 64, "height": 64} if ctx.quick else {})}
    with world_of_one(device):
        cache = MeshCache(device.type, timedelta(seconds=60))
        layout = cache.get(ONE_RANK, step_cache=True)
        _groups(device, layout, checks)
        with tempfile.TemporaryDirectory(prefix="xdit-selftest-") as tmp:
            for form in ("bf16", "fp8", "scaled_fp8", "gguf_q8_0", "gguf_q4_k"):
                _sharded(ctx, checks, layout.shard_mesh, form, Path(tmp), request)
        _release_in_flight(device, cache, checks)


def _groups(device: torch.device, layout, checks: Checks) -> None:
    """The shard group on the device's backend, the step cache's on gloo; a float64 sum on each."""
    shard_group = layout.shard_mesh.get_group()
    backends = {"shard": dist.get_backend(shard_group), "step_cache": dist.get_backend(layout.step_group)}
    checks.record(**{f"{name}_group": backend for name, backend in backends.items()})
    wanted = "nccl" if device.type == "cuda" else "gloo"
    checks.expect(backends["shard"] == wanted, f"the shard group on {backends['shard']}, not {wanted}")
    checks.expect(backends["step_cache"] == "gloo", f"the step cache's group on {backends['step_cache']}, not gloo")
    for group, on in ((shard_group, device), (layout.step_group, torch.device("cpu"))):
        sums = torch.tensor([1.0 + 2.0**-40, -3.5], dtype=torch.float64, device=on)  # a float32 would round the first
        dist.all_reduce(sums, group=group)
        checks.expect(sums.tolist() == [1.0 + 2.0**-40, -3.5], f"float64 all-reduce on {dist.get_backend(group)} "
                                                               f"gave {sums.tolist()}")


def _build(ctx: Context, form: str, directory: Path, mesh=None):
    """flux-tiny in ``form`` computing in bf16: whole on the device, or with ``mesh`` built on the CPU and its
    blocks sharded onto the device (as the executor loads a sharded model)."""
    ref = MODEL
    if form != "bf16":
        path = directory / f"{MODEL}-{form}"
        if not path.exists():
            path.mkdir()
            written(MODEL, form, path)
        ref = str(next(path.iterdir()))
    model = registry.build(ref, ctx.device if mesh is None else torch.device("cpu"), BF16)
    return model if mesh is None else shard.shard_blocks(model, mesh, ctx.device)


def _sharded(ctx: Context, checks: Checks, mesh, form: str, directory: Path, request: dict) -> None:
    if ctx.device.type == "cpu" and "fp8" in form and not compat.fsdp_shards_mixed_dtypes():  # the dry run, on gloo
        checks.record(**{f"{form}_skipped": "torch 2.7's FSDP2 gathers a float8 block as float8, which gloo cannot "
                                            "(NCCL can: this section on a GPU)"})
        return
    try:
        whole = generation(_build(ctx, form, directory), MODEL, request)
    except ImportError as exc:  # gguf: an optional extra
        checks.record(**{f"{form}_skipped": f"cannot write it here: {exc}"})
        return
    model = _build(ctx, form, directory, mesh)
    first_block = shard.blocks_of(model)[0]
    kept = set(shard.whole_on_every_rank(first_block) or ())  # what this torch's FSDP2 cannot shard (compat.py)
    checks.record(**{f"{form}_parameters_kept_whole": len(kept)})
    checks.expect(shard.mesh_of(model) is mesh and all(isinstance(p, DTensor) != (p in kept)
                                                       for p in first_block.parameters()),
                  f"{form}: the blocks were not sharded (but for the {len(kept)} parameters this torch keeps whole)")
    _, rel = distance(generation(model, MODEL, request), whole)
    checks.record(**{f"{form}_sharded_rel": rel})
    checks.expect(rel <= SHARDED_TOLERANCE, f"{form}: sharded over one rank, {rel:.2e} from the whole model")
    if ctx.quick or form not in COMPILED:
        return
    before = counters["stats"]["unique_graphs"]
    compiled = generation(compile_blocks(model), MODEL, request)
    _, rel = distance(compiled, whole)
    graphs = counters["stats"]["unique_graphs"] - before
    checks.record(**{f"{form}_sharded_compiled_rel": rel, f"{form}_sharded_compiled_graphs": graphs})
    checks.expect(graphs > 0, f"{form}: the sharded blocks compiled no graph")
    checks.expect(rel <= COMPILED_TOLERANCE, f"{form}: sharded and compiled, {rel:.2e} from the whole model eager")


def _release_in_flight(device: torch.device, cache: MeshCache, checks: Checks) -> None:
    """``cache.clear()`` while an all-reduce waits behind a sleeping kernel (on CUDA), then the mesh again."""
    group = cache.get(ONE_RANK, step_cache=True).shard_mesh.get_group()
    held = torch.ones(4, device=device)
    if device.type == "cuda":
        torch.cuda._sleep(SLEEP_CYCLES)
    dist.all_reduce(held, group=group, async_op=True)  # on CUDA still queued when the group is released
    started = time.perf_counter()
    cache.clear()
    released = time.perf_counter() - started
    again = cache.get(ONE_RANK, step_cache=True).shard_mesh.get_group()
    fresh = torch.full((4,), 2.0, device=device)
    dist.all_reduce(fresh, group=again)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    checks.record(release_s=released, rebuilt_sum=fresh.tolist())
    checks.expect(again is not group, "the mesh cache gave back the released group")
    checks.expect(fresh.tolist() == [2.0] * 4, f"the rebuilt group's all-reduce gave {fresh.tolist()}")
