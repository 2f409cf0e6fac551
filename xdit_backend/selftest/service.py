"""The selftest's backend sections: a world-1 backend on the device (its start on NCCL with the gloo
control group beside it, a profiled request, memory before and after ``unload``), the same with an
injected model fault (the request fails, the backend keeps serving), the step cache's figures, and
the demo."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..bench.demo import run_demo
from ..bench.layouts import relative_distance
from ..client import BackendError, Client
from ..launch import launcher
from ..launch.options import LaunchOptions
from ..launch.worker_env import FAULT_ENV
from .runner import Checks, Context, Skip

REQUEST = {"model": "flux-tiny", "steps": 4, "seed": 2, "cfg": 3.5}


@dataclass
class Backend:
    client: Client
    status: dict  # as the start returned it
    fault: Path  # "RANK:N" written here fails that rank's N-th model call of the next request (FAULT_ENV)


def world_one(ctx: Context) -> Backend:
    """The sections' one-rank backend on the selftest's device: started by the first section that asks
    and stopped when the selftest ends (one start, not one per section: each costs the ranks' imports
    and, on a GPU, a CUDA context)."""
    if "backend" not in ctx.shared:
        folder = Path(ctx.held.enter_context(tempfile.TemporaryDirectory(prefix="xdit-selftest-")))
        options = LaunchOptions(socket=folder / "backend.sock", nproc=1, device=ctx.device.type,
                                collective_timeout=60.0)
        status = launcher.start(options, environment={FAULT_ENV: str(folder / "fault")})
        ctx.held.callback(launcher.stop, options.socket)  # before the folder goes: the stack unwinds in reverse
        ctx.shared["backend"] = Backend(Client(options.socket), status, folder / "fault")
    return ctx.shared["backend"]


def _rank_memory(client: Client) -> dict:
    """Rank 0's memory record from ``status``: ``allocated`` (its allocator's bytes on CUDA) and
    ``parameters`` (what its loaded models hold), fresh after a request or an unload."""
    return client.status()["ranks"][0]["memory"]


def backend(ctx: Context, checks: Checks) -> None:
    """A profiled request on a world-1 backend, then ``unload``: the model's bytes leave the rank.
    Checked in the rank's own figures, not the driver's free memory: that also moves with cuBLAS and
    cuDNN workspaces and lazily loaded kernels, tens of MB no unload frees, against 1.4 MB of
    flux-tiny in bf16 (review B7)."""
    size = 128 if ctx.quick else 512
    backend = world_one(ctx)
    client, status = backend.client, backend.status
    checks.record(rank=status["ranks"][0],
                  attention_kernel=status.get("attention_kernel"), topology=status.get("topology"))
    _, info = client.sample({**REQUEST, "width": size, "height": size, "profile": True})
    record = info["profile"][0]
    steps = record["step_s"][1:]
    checks.record(step_ms_median=1e3 * sorted(steps)[len(steps) // 2], peak_memory_mib=record["peak_memory_bytes"] / 2**20,
                  memory_kind=record["memory_kind"], layout=str(info.get("layout")))
    checks.expect(len(record["step_s"]) == REQUEST["steps"], f"{len(record['step_s'])} step times for {REQUEST['steps']} steps")
    loaded = _rank_memory(client)
    unloaded = client.unload()
    after = _rank_memory(client)
    checks.expect(bool(unloaded), "unload reported no model")
    checks.record(model_bytes=loaded["parameters"], model_bytes_after_unload=after["parameters"])
    checks.expect(loaded["parameters"] > 0 and after["parameters"] == 0,
                  f"the rank held {loaded['parameters']} model bytes, {after['parameters']} after unload")
    if ctx.device.type == "cuda":  # the CPU's figure is the process's resident size, which malloc keeps
        released = loaded["allocated"] - after["allocated"]
        checks.record(released_by_unload_mib=released / 2**20)
        checks.expect(released >= 0.9 * loaded["parameters"], f"unload released {released / 2**20:.2f} MiB "
                      f"of the model's {loaded['parameters'] / 2**20:.2f} MiB")


def fault(ctx: Context, checks: Checks) -> None:
    """A fault armed at rank 0's 3rd model call (FAULT_ENV): the request fails with model_error, the same
    backend serves the next one (world 1: the NCCL error agreement between ranks needs two GPUs)."""
    backend = world_one(ctx)
    client = backend.client
    backend.fault.write_text("0:3")
    try:
        client.sample({**REQUEST, "width": 128, "height": 128})
        checks.expect(False, "the request with the injected fault did not fail")
    except BackendError as exc:
        checks.record(error_kind=exc.kind, error=exc.message[:200])
        checks.expect(exc.kind == "out_of_memory", f"failed with {exc.kind}, not out_of_memory")
    result, _ = client.sample({**REQUEST, "width": 128, "height": 128})
    checks.expect(bool(torch.isfinite(result["samples"]).all()), "the request after the fault is not finite")


# The step cache on the Flux.1-dev architecture (random bf16 weights), 1024², 28 steps, at the thresholds
# the peers publish for Flux (ParaAttention's FBCache 0.08, TeaCache's 0.25): docs/benchmarks.md's GPU row.
CACHE_REQUEST = {"model": "flux-dev-random", "width": 1024, "height": 1024, "steps": 28, "seed": 1, "cfg": 1.0,
                 "dtype": "bfloat16", "profile": True}
CACHE_QUICK = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 6, "seed": 1, "cfg": 1.0, "profile": True}
CACHE_RUNS = (("fbcache", 0.08), ("teacache", 0.25))


def step_cache(ctx: Context, checks: Checks) -> None:
    """Uncached, another seed, then each method at its published threshold: steps reused, denoise time
    and speed-up, and the distance to the uncached latent beside two seeds' (bench.run_cache_bench's figures)."""
    request = CACHE_QUICK if ctx.quick else CACHE_REQUEST
    client = world_one(ctx).client
    client.sample({**request, "profile": False})  # warm-up: the model, first-touch allocations, kernels
    uncached, info = client.sample(request)
    baseline = info["profile"][0]["denoise_s"]
    other, _ = client.sample({**request, "seed": request["seed"] + 1})
    checks.record(model=request["model"], uncached_denoise_s=baseline,
                  seeds_relative_l2=relative_distance(other["samples"], uncached["samples"]))
    for method, threshold in CACHE_RUNS:
        result, info = client.sample({**request, "cache": method, "cache_threshold": threshold})
        counts, seconds = info["cache"], info["profile"][0]["denoise_s"]
        checks.record(**{f"{method}_{threshold}_reused": counts["reused"], f"{method}_{threshold}_denoise_s": seconds,
                         f"{method}_{threshold}_speed_up": baseline / seconds,
                         f"{method}_{threshold}_relative_l2": relative_distance(result["samples"], uncached["samples"])})
        checks.expect(counts["computed"] + counts["reused"] == request["steps"], f"{method}: counts {counts} "
                      f"for {request['steps']} steps")
        checks.expect(bool(torch.isfinite(result["samples"]).all()), f"{method}: the latent is not finite")


def demo(ctx: Context, checks: Checks) -> None:
    if ctx.device.type != "cuda":
        raise Skip("the demo starts a backend of its own; on the CPU `xdit-backend demo` runs it, as "
                   "tests/backend/test_demo.py does")
    code = run_demo(steps=2, size=128 if ctx.quick else 256, nproc=1)  # its backend takes the GPU when there is one
    checks.record(exit_code=code)
    checks.expect(code == 0, f"xdit-backend demo exited {code}")
