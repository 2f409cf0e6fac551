"""``xdit-backend bench overhead``: the backend's step at world 1 against a plain loop that calls the
diffusers transformer directly with the same Euler sampler, same model, size and dtype: what the
service layer (socket, step gate, progress, conditioning) costs per step. Budget: ≤ 3 %.

Works for Flux models (the plain loop calls diffusers' Flux signature): ``flux-tiny`` on the CPU,
``flux-dev-random`` (the full Flux.1-dev architecture, random weights) or a Flux file on a GPU.
On CUDA both loops time their steps with CUDA events, the backend's in its own process (its
``profile``), the plain one here; the first step of each run is left out (warm-up).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from ..client import Client
from ..device import compute_dtype
from ..launch import launcher
from ..launch.options import LaunchOptions
from ..service.step_clock import StepClock


def plain_loop(model, width: int, height: int, steps: int, seed: int = 3) -> list[float]:
    """Euler over the diffusers Flux transformer, as a script would write it; seconds per step."""
    from ..models import flux, registry
    from ..sampling.model_sampling import FlowSampling

    transformer, device, dtype = model.transformer, model.device, model.dtype
    positive, _ = registry.random_conditioning(model.name, 1, seed, model.spec)
    context, pooled = (positive[key].to(device, dtype) for key in ("context", "pooled"))
    h, w = height // 8, width // 8
    sigmas = FlowSampling(1.15, flux=True).sigmas(steps).to(device)
    ids, text_ids = flux.image_ids(h, w).to(device), torch.zeros(context.shape[1], 3, device=device)
    guidance = torch.tensor([3.5], device=device)
    x = torch.randn(1, 16, h, w, generator=torch.Generator().manual_seed(seed)).to(device)
    clock = StepClock(device)
    with torch.no_grad():
        clock.mark()
        for i in range(steps):
            velocity = transformer(hidden_states=flux.pack(x).to(dtype), encoder_hidden_states=context,
                                   pooled_projections=pooled, timestep=sigmas[i:i + 1], img_ids=ids,
                                   txt_ids=text_ids, guidance=guidance, return_dict=False)[0]
            x = x + flux.unpack(velocity.float(), h, w) * (sigmas[i + 1] - sigmas[i])  # Euler on v = (x − x0)/σ
            clock.mark()
    return clock.steps()[1:]


def measure_overhead(model_ref: str = "flux-tiny", device: str = "cpu", dtype: str = "auto",
                     sizes: tuple[tuple[int, int, int], ...] = ((1024, 1024, 8),), repeats: int = 3,
                     model=None) -> list[dict]:
    """Per (width, height, steps): the median step of the plain loop and of a world-1 backend, their
    runs interleaved so both see the same machine. One backend and one in-process model (``model``,
    when the caller has built it already) serve every size: a full-size model takes a minute to build."""
    from ..models import registry

    target = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    model = model or registry.build(model_ref, target, compute_dtype(dtype, target))
    figures = []
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=1, device=device)
        launcher.start(options)
        try:
            client = Client(options.socket)
            for width, height, steps in sizes:
                fields = {"model": model_ref, "width": width, "height": height, "steps": steps, "seed": 3,
                          "cfg": 1.0, "dtype": dtype, "parallel": {}, "profile": True}
                client.sample({**fields, "steps": 2, "profile": False}, timeout=1800)  # warm-up (the first builds)
                backend_steps, plain_steps, peak = [], [], 0
                for _ in range(repeats):
                    plain_steps += plain_loop(model, width, height, steps)
                    _, info = client.sample(fields, timeout=1800)
                    backend_steps += info["profile"][0]["step_s"][1:]
                    peak = max(peak, info["profile"][0]["peak_memory_bytes"])
                plain, backend = statistics.median(plain_steps), statistics.median(backend_steps)
                figures.append({"model": model_ref, "device": str(target), "dtype": str(model.dtype), "width": width,
                                "height": height, "image_tokens": (width // 16) * (height // 16), "steps": steps,
                                "repeats": repeats, "plain_step_s": plain, "backend_step_s": backend,
                                "overhead": backend / plain - 1, "plain_range_s": [min(plain_steps), max(plain_steps)],
                                "backend_range_s": [min(backend_steps), max(backend_steps)],
                                "backend_peak_memory_bytes": peak})
        finally:
            launcher.stop(options.socket)
    return figures


def run_overhead_bench(model: str = "flux-tiny", device: str = "cpu", dtype: str = "auto", width: int = 1024,
                       height: int = 1024, steps: int = 8, repeats: int = 3) -> int:
    [m] = measure_overhead(model, device, dtype, ((width, height, steps),), repeats)
    threads = f", threads {torch.get_num_threads()}" if device == "cpu" else ""
    print(f"{model} {width}×{height} ({m['image_tokens']} image tokens), {m['dtype']}, {m['device']}, "
          f"{steps} steps × {repeats} runs (first step of each excluded){threads}\n")
    print("| loop | step median ms | min–max ms |\n|---|---|---|")
    for name, key in (("plain diffusers loop, in-process", "plain"), ("backend, world 1 (socket, step gate, progress)",
                                                                       "backend")):
        low, high = m[f"{key}_range_s"]
        print(f"| {name} | {m[f'{key}_step_s'] * 1e3:.1f} | {low * 1e3:.1f}–{high * 1e3:.1f} |")
    print(f"\nbackend / plain = {1 + m['overhead']:.3f} ({m['overhead'] * 100:+.1f} %; budget ≤ +3 %)")
    return 0
