"""Will a model fit this rank's device, and which loaded models must go to make room; and how running
out of memory is reported (the rank, the bytes, the fixes in order).

The bytes a request needs come from the written memory model (memory_model.estimate): the model's
weights at their storage precision and share (FSDP2 sharding, PipeFusion stage) plus the request's
activations and attention workspace. What is available: the device's free memory plus what this
process's allocator holds unused (GPU), or MemAvailable (CPU: device_memory.py); evicting a loaded
model adds its bytes. ``XDIT_TEST_MEMORY_BUDGET`` (tests only) replaces the device by a budget of
that many bytes, of which the loaded models' bytes are used.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .. import device as device_memory
from ..errors import UserError
from ..models import storage
from ..models.registry import ModelSource
from ..models.resolved import ResolvedModel
from . import model as memory_model

TEST_BUDGET_ENV = "XDIT_TEST_MEMORY_BUDGET"  # tests only: bytes the rank's device has
FIXES = ("in order: turn on shard_weights (each rank keeps 1/N of every block: --shard-weights, or the "
         "xDiT Parallel Config node's shard_weights), use an fp8 or GGUF file or weight_dtype fp8_e4m3fn (1 byte a "
         "weight), then more GPUs; a smaller size or batch lowers the activations")

ACTIVATION_FIXES = ("a smaller size, batch or frame count, or fewer reference images; or more sequence-parallel "
                    "ranks (ulysses, ring: each holds a share of the tokens)")


class NotEnoughMemory(UserError):
    """A rank's device cannot hold what a request needs: before loading, or an out-of-memory while running."""


def budget() -> int | None:
    value = os.environ.get(TEST_BUDGET_ENV)
    return int(value) if value else None


def available(device: torch.device, held: int, sharing: int = 1) -> int:
    """Bytes this rank can still allocate on ``device``; ``held``: what its loaded models hold; ``sharing``: the
    ranks on this host, which on the CPU share its memory (each counts on its share of what is available)."""
    if budget() is not None:
        return budget() - held
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return device_memory.free_and_total(device)[0] // sharing


def is_out_of_memory(exc: BaseException) -> bool:
    """A failed allocation: CUDA's, Python's, or the CPU allocator's (a RuntimeError, "can't allocate memory")."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def needed(model: ResolvedModel, compute_dtype: torch.dtype, weight_dtype: str, shard_ranks: int, config,
           tokens_per_rank: int, rows: int, modulation_per_token: bool = False) -> memory_model.Estimate:
    """The memory model's bytes for loading ``model`` and running a request with it on one rank;
    ``config``: the request's ParallelConfig (None: one rank); ``modulation_per_token``: the request gives the model
    a timestep per token (SampleRequest.modulates_per_token)."""
    transformer = model.on_meta()
    stages = config.pipefusion if config else 1
    stale = model.spec.stage_plan.buffers_per_block(transformer) if stages > 1 else 0
    return memory_model.estimate(transformer, storage_bytes_per_value=storage_rule(model.source, compute_dtype,
                                                                                   weight_dtype),
                                 compute_dtype=compute_dtype,
                                 shard_ranks=shard_ranks, tokens_per_rank=tokens_per_rank, rows=rows,
                                 stages=stages, ulysses=config.ulysses if config else 1,
                                 ring=config.ring if config else 1, stale_buffers=stale,
                                 modulation_per_token=modulation_per_token)


def storage_rule(source: ModelSource, compute_dtype: torch.dtype, weight_dtype: str):
    """Bytes a value of ``source``'s weights takes once loaded: weight_dtype fp8_* stores matrices in fp8;
    by default a file's float8 and GGUF matrices stay as stored (their bytes read from the file, on
    average) and everything else takes the compute dtype."""
    if weight_dtype.startswith("fp8"):
        return memory_model.fp8_storage(compute_dtype)
    size = float(compute_dtype.itemsize)
    if source.kind != "file":  # a built-in or a diffusers folder: cast to the compute dtype
        return size
    kept_bytes, kept_values, cast_values = storage.file_matrix_bytes(source.ref, Path(source.ref).stat().st_mtime_ns)
    if not kept_values:
        return size
    matrix = (kept_bytes + cast_values * size) / (kept_values + cast_values)
    return lambda param_name, param: matrix if param.dim() >= 2 else size


def tightest_room(records: list[dict]) -> int:
    """The least memory any rank could give a model, from ``status``'s per-rank records (rank 0's last
    gather): its free bytes plus what its loaded models hold (the cache evicts them to make room)."""
    if budget() is not None:
        return budget()
    return min(record["memory"]["free"] + record["memory"]["parameters"] for record in records)


def request_shape(request, spec, text_tokens: int) -> tuple[int, int]:
    """(tokens per rank, rows per forward) of a request under its layout: the joint sequence (image, text and
    reference latents' tokens) cut by the sequence-parallel degree; the batch, doubled when CFG's two passes
    share a forward, cut by dp."""
    config = request.parallel
    sequence = config.sequence if config else 1
    image_tokens, _ = spec.token_grid(request.width, request.height, request.frames)
    tokens = image_tokens + text_tokens + request.reference_tokens(spec)
    rows = request.batch * (2 if request.cfg != 1 and (config is None or config.cfg == 1) else 1)
    return math.ceil(tokens / sequence), math.ceil(rows / (config.dp if config else 1))


def eviction_plan(need: int, free: int, loaded: list[tuple[object, int]]) -> list | None:
    """The least recently used models (``loaded``: (key, bytes), least recent first) to drop so that
    ``need`` bytes fit in ``free`` plus theirs; [] when it fits already; None when dropping all is not enough."""
    plan, freed = [], 0
    for key, size in loaded:
        if free + freed >= need:
            break
        plan.append(key)
        freed += size
    return plan if free + freed >= need else None


def host_verdict(whole_bytes: int, host_free: int, rank: int, model: str) -> dict | None:
    """Where a sharded model is built whole in host memory before it is sharded (torch before 2.8; GGUF before
    2.13: parallel/shard.builds_whole_first), whether this rank's share of the host holds it: None, or the
    verdict ``refusal`` words."""
    if whole_bytes <= host_free:
        return None
    return {"rank": rank, "model": model, "host": True, "needed": whole_bytes, "free": host_free}


def refusal(verdict: dict) -> NotEnoughMemory:
    """The error every rank raises when ``verdict``'s rank cannot load the model, or cannot run the request on
    the model it holds (``verdict["loaded"]``): the same on all."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    if verdict.get("host"):
        return NotEnoughMemory(
            f"rank {verdict['rank']} cannot load {verdict['model']} sharded on this torch: it builds the whole model "
            f"in host memory before sharding it ({gb(verdict['needed'])}), and the host has {gb(verdict['free'])} "
            "for this rank (its available memory shared by the ranks on it); nothing was loaded",
            "install torch ≥ 2.8 (≥ 2.13 for a GGUF file), whose sharded loading reads only each rank's share; or run "
            "fewer ranks on this host, or use an fp8 or GGUF file")
    if verdict.get("loaded"):
        return NotEnoughMemory(
            f"rank {verdict['rank']} cannot run this request on {verdict['model']}, which it holds: the request needs "
            f"{gb(verdict['needed'])} more (activations {gb(verdict['activations'])} + attention workspace "
            f"{gb(verdict['workspace'])} + weights gathered or upcast a block at a time "
            f"{gb(verdict['needed'] - verdict['activations'] - verdict['workspace'])}) and "
            f"{gb(verdict['free'] + verdict['evictable'])} can be had on {verdict['device']} ({gb(verdict['free'])} "
            f"free + {gb(verdict['evictable'])} by unloading the other models); nothing was run", ACTIVATION_FIXES)
    return NotEnoughMemory(
        f"rank {verdict['rank']} cannot load {verdict['model']}: it needs {gb(verdict['needed'])} (weights "
        f"{gb(verdict['weights'])} + activations {gb(verdict['activations'])} + attention workspace "
        f"{gb(verdict['workspace'])}) and {gb(verdict['free'] + verdict['evictable'])} can be had on "
        f"{verdict['device']} ({gb(verdict['free'])} free + {gb(verdict['evictable'])} by unloading the other "
        f"models); nothing was loaded", FIXES)


def out_of_memory(exc: BaseException, rank: int, device: torch.device, held: int) -> NotEnoughMemory:
    """An out-of-memory raised while running, with what this rank held and had free when it happened."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    first = str(exc).splitlines()[0] if str(exc) else ""
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        free, total = torch.cuda.mem_get_info(device)
        where = f"{gb(allocated)} allocated by this rank, {gb(free)} free of {gb(total)} on {device}"
    else:
        free, total = device_memory.free_and_total(device)
        where = f"{gb(free)} available of {gb(total)} on {device}"
    return NotEnoughMemory(f"rank {rank} ran out of memory ({type(exc).__name__}: {first}); its models hold "
                           f"{gb(held)}, {where}; the backend keeps serving and released the request's memory",
                           FIXES)
