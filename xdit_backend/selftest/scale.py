"""The selftest's sections at scale: torch.compile on the device, and the full-size Flux.1-dev
architecture (random weights) at 1024² and 2048²: the backend's step against a plain diffusers loop,
peak memory, and the compute one rank does on a 1/P share of the tokens (what ``bench scaling`` needs)."""

from __future__ import annotations

import statistics
import time

import torch
from torch._dynamo.utils import counters

from ..bench.overhead import measure_overhead
from ..models import flux, registry
from ..parallel import attention
from ..parallel.compile import compile_blocks
from ..service.reference import serial_latent
from ..service.step_clock import StepClock
from .models import distance
from .runner import Checks, Context, Skip

SIZES = ((1024, 6), (2048, 4))  # (side, steps): the step-time budget's two sizes
SHARDS = (1, 2, 4, 8)  # sequence-parallel degrees whose per-rank compute is measured


def _timed_generation(model, request_fields: dict) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    latent = serial_latent({**request_fields, "model": model.name}, model=model)  # ends on the CPU
    return latent, time.perf_counter() - started


def compiled(ctx: Context, checks: Checks) -> None:
    """flux-tiny in bf16, eager then compiled: a first request (compiles), the same again and a new
    resolution (neither may compile again), the compiled latent against the eager one."""
    if ctx.device.type != "cuda":
        raise Skip("Inductor on the CPU takes minutes here; tests/backend/test_compile.py covers compile on the CPU")
    request = {"model": "flux-tiny", "width": 512, "height": 512, "steps": 8, "seed": 4, "cfg": 3.5}
    model = registry.build("flux-tiny", ctx.device, torch.bfloat16)
    _timed_generation(model, request)  # warm-up: kernels loaded, allocator primed
    eager, eager_s = _timed_generation(model, request)
    compile_blocks(model)
    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    before = graphs()
    first, first_s = _timed_generation(model, request)
    after_first = graphs()
    again, again_s = _timed_generation(model, request)
    after_again = graphs()
    _timed_generation(model, {**request, "width": 768, "height": 640})
    after_resize = graphs()
    _, rel = distance(again, eager)
    checks.record(eager_s=eager_s, first_compiled_s=first_s, compiled_s=again_s, speedup=eager_s / again_s,
                  graphs_first=after_first - before, graphs_same_again=after_again - after_first,
                  graphs_new_resolution=after_resize - after_again, compiled_vs_eager_rel=rel)
    checks.expect(after_again == after_first, f"the same request compiled {after_again - after_first} more graphs")
    checks.expect(after_resize == after_again, f"a new resolution compiled {after_resize - after_again} more graphs")
    checks.expect(rel < 2e-2, f"compiled vs eager (bf16): relative {rel:.2e}")
    checks.expect(bool(torch.isfinite(first).all()), "the first compiled latent is not finite")


def _forward_seconds(model, image_rows: int, width_tokens: int, text: int, repeats: int = 3) -> float:
    """One transformer forward on ``image_rows``×``width_tokens`` image tokens and ``text`` text tokens."""
    device, dtype, config = model.device, model.dtype, model.transformer.config
    g = torch.Generator().manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, image_rows * width_tokens, config.in_channels, generator=g).to(device, dtype),
        encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=g).to(device, dtype),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=g).to(device, dtype),
        timestep=torch.tensor([0.5], device=device), guidance=torch.tensor([3.5], device=device),
        img_ids=flux.image_ids(2 * image_rows, 2 * width_tokens).to(device),
        txt_ids=torch.zeros(text, 3, device=device), return_dict=False)
    with torch.no_grad():
        return _median_seconds(lambda: model.transformer(**inputs), device, repeats)


def _attention_seconds(model, queries: int, keys: int, heads: int | None = None, repeats: int = 5) -> float:
    """Our attention kernel at the model's head size and heads (or ``heads``), ``queries`` against ``keys``."""
    config = model.transformer.config
    kernel = attention.local_attention(model.device)
    shape = (heads or config.num_attention_heads, config.attention_head_dim)
    q, k, v = (torch.randn(1, s, *shape, device=model.device, dtype=model.dtype) for s in (queries, keys, keys))
    return _median_seconds(lambda: kernel(q, k, v), model.device, repeats)


def _median_seconds(run, device, repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``run`` after one untimed (warm-up) call."""
    clock = StepClock(device)
    run()
    clock.mark()
    for _ in range(repeats):
        run()
        clock.mark()
    return statistics.median(clock.steps())


def shard_compute(model, side: int = 1024, text: int = 512) -> dict[str, dict[int, float]]:
    """Seconds of compute one sequence rank does per step at degree P, from measured parts: a forward over its
    (image + text)/P tokens (its linear layers' exact work), with each attention layer's part replaced by the
    shape the rank really runs. Three ways: ``proxy``, its 1/P of the queries against all keys on every head (the
    first GPU run's figure); ``ulysses``, every query against every key on 1/P of the heads; ``ring``, its queries
    against each of the P chunks of keys in turn, on every head (the chunks' merges not counted)."""
    config = model.transformer.config
    layers = config.num_layers + config.num_single_layers
    heads = config.num_attention_heads
    rows, cols = side // 16, side // 16
    total = rows * cols + text
    shares: dict[str, dict[int, float]] = {"proxy": {}, "ulysses": {}, "ring": {}}
    for p in SHARDS:
        forward = _forward_seconds(model, rows // p, cols, text // p)
        mine = total // p
        own = _attention_seconds(model, mine, mine)  # what the forward above spent on each attention layer
        shares["proxy"][p] = forward + layers * (_attention_seconds(model, mine, total) - own)
        shares["ulysses"][p] = forward + layers * (_attention_seconds(model, total, total, max(1, heads // p)) - own)
        shares["ring"][p] = forward + layers * (p - 1) * own
    return shares


def shard_figures(checks: Checks, model, side: int, text: int) -> None:
    """The figures of ``shares`` for a built Flux ``model`` at ``side``²."""
    shares = shard_compute(model, side, text)
    checks.record(shard_compute_s={way: {str(p): t for p, t in by_degree.items()} for way, by_degree in shares.items()},
                  **{f"{way}_1_of_{p}_ms": t * 1e3 for way, by_degree in shares.items() for p, t in by_degree.items()})


def full_size_figures(checks: Checks, model, sizes: tuple[tuple[int, int], ...]) -> None:
    """The figures of ``full_size`` for a built Flux ``model``: the backend against the plain loop at every size."""
    dtype = str(model.dtype).removeprefix("torch.")
    runs = tuple((side, side, steps) for side, steps in sizes)
    for m in measure_overhead(model.name, model.device.type, dtype, runs, repeats=2, model=model):
        side = m["width"]
        checks.record(**{f"{side}_plain_step_ms": m["plain_step_s"] * 1e3, f"{side}_backend_step_ms":
                         m["backend_step_s"] * 1e3, f"{side}_overhead_pct": m["overhead"] * 100,
                         f"{side}_peak_gib": m["backend_peak_memory_bytes"] / 2**30, f"overhead_{side}": m})
        checks.expect(m["overhead"] <= 0.03, f"{side}²: the backend's step is {m['overhead'] * 100:+.1f} % "
                                             "over the plain loop (budget ≤ 3 %)")


def _flux_dev(ctx: Context, checks: Checks):
    """The Flux.1-dev architecture with random bf16 weights on the GPU, drawn once for the sections that use it
    (review gpu-paths-2 B5); the first to ask records how long the drawing took."""
    if ctx.device.type != "cuda":
        raise Skip("the full-size Flux.1-dev architecture needs a GPU (22 GiB of bf16 weights)")
    if "flux-dev" not in ctx.shared:
        started = time.perf_counter()
        ctx.shared["flux-dev"] = registry.build("flux-dev-random", ctx.device, torch.bfloat16)
        checks.record(build_s=time.perf_counter() - started, weights_gib=sum(
            p.numel() * p.element_size() for p in ctx.shared["flux-dev"].transformer.parameters()) / 2**30)
    return ctx.shared["flux-dev"]


def shares(ctx: Context, checks: Checks) -> None:
    shard_figures(checks, _flux_dev(ctx, checks), SIZES[0][0], text=512)


def full_size(ctx: Context, checks: Checks) -> None:
    full_size_figures(checks, _flux_dev(ctx, checks), SIZES)
    del ctx.shared["flux-dev"]  # its 22 GiB are not kept for the step-cache section's backend
