"""``xdit-backend bench``: measurements, printed as markdown. Timings live here, never in tests."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import launcher, protocol
from .client import Client

FLUX_1024_LATENT = (1, 16, 128, 128)  # a 1024×1024 Flux latent, float32: 1 MiB


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _row(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"| {name} | {statistics.median(ms):.3f} | {p90:.3f} | {len(ms)} |"


def run_transport_bench(nproc: int = 2, repeats: int = 200) -> int:
    """Cold start of a backend, an empty request's round trip, and a 1024² Flux latent there and back."""
    latent = torch.randn(FLUX_1024_LATENT)
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=nproc, device="cpu")
        started = time.perf_counter()
        launcher.start(options)
        cold_start = time.perf_counter() - started
        try:
            client = Client(options.socket)
            client.hello()  # warm the path once
            rows = [
                _row("empty request round trip (hello, new connection each)", _timed(client.hello, repeats)),
                _row("status round trip", _timed(client.status, repeats)),
                _row("1×16×128×128 f32 latent to the backend and back (echo)",
                     _timed(lambda: client.echo({"latent": latent}), max(20, repeats // 4))),
            ]
        finally:
            launcher.stop(options.socket)
    frame = protocol.encode_bytes(protocol.Message("echo", {}, {"latent": latent}))
    rows += [
        _row("same latent: in-process copy (clone)", _timed(latent.clone, repeats)),
        _row("same latent: in-process encode + decode, no socket",
             _timed(lambda: protocol.decode_bytes(protocol.encode_bytes(
                 protocol.Message("echo", {}, {"latent": latent}))), repeats)),
    ]
    print(f"backend cold start, world {nproc} on cpu: {cold_start:.2f} s (until every rank answers)\n")
    print("| what | median ms | p90 ms | runs |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"\nframe size for the latent: {len(frame)} bytes")
    return 0


# --------------------------------------------------------------------------- parallel layouts

DEFAULT_LAYOUTS = ["serial", "ulysses=2", "ring=2", "cfg=2", "dp=2", "pipefusion=2", "pipefusion=2,patches=4",
                   "ulysses=2,ring=2", "ulysses=4", "ring=4", "cfg=2,ulysses=2", "cfg=2,ring=2", "dp=2,ulysses=2",
                   "pipefusion=4", "pipefusion=2,ulysses=2"]
_LAYOUT_KEYS = {"patches": "num_pipeline_patch", "warmup": "warmup_steps"}
DEGREE_NAMES = ("dp", "cfg", "pipefusion", "ring", "ulysses")


def parse_layout(text: str) -> dict:
    """"cfg=2,ulysses=2" → {"cfg": 2, "ulysses": 2}; "pipefusion=2,patches=4,warmup=1"; "serial" → {}."""
    if text == "serial":
        return {}
    try:
        pairs = (part.split("=") for part in text.split(","))
        return {_LAYOUT_KEYS.get(name.strip(), name.strip()): int(value) for name, value in pairs}
    except ValueError:
        raise SystemExit(f"xdit-backend: layout {text!r} is not like ulysses=2,ring=2 (or serial)") from None


def world_of(degrees: dict) -> int:
    return math.prod(degrees.get(name, 1) for name in DEGREE_NAMES)


def traffic_formula(degrees: dict, dims: dict, fields: dict) -> tuple[int, str]:
    """Bytes one rank sends per step by the methods' algebra, and the formula as text.

    A attention layers, B batch per forward, N image tokens, L text tokens, C hidden width,
    e bytes per element, U ulysses, R ring, P = U·R; the velocity tokens carry 64 channels.
    """
    u, r, cfg, dp, pf = (degrees.get(k, 1) for k in ("ulysses", "ring", "cfg", "dp", "pipefusion"))
    p = u * r
    a, c, e = dims["attention_layers"], dims["hidden"], 4
    n = (fields["width"] // 16) * (fields["height"] // 16)
    text = dims["text_tokens"]
    two_passes = fields["cfg"] != 1.0
    b = fields["batch"] // dp * (2 if two_passes and cfg == 1 else 1)
    total, terms = 0, []
    if pf > 1:
        if p > 1 or cfg > 1:
            return 0, "not modelled for PipeFusion hybrids"
        images = fields["batch"] // dp
        activations, returned = b * (n + text) * c * e, images * n * 64 * e
        return max(activations, returned), ("PipeFusion max(B·(N+L)·C·e activations to the next stage, "
                                            "(B/dp)·N·64·e patches back to stage 0); no factor of A")
    if u > 1:
        total += 4 * a * b * (n // p) * c * e * (u - 1) // u + a * b * text * (c // u) * e * (u - 1)
        terms.append("Ulysses 4·A·B·(N/P)·C·e·(U−1)/U + A·B·L·(C/U)·e·(U−1)")
    if r > 1:
        total += 2 * a * b * (n // r) * (c // u) * e * (r - 1)  # after Ulysses a ring rank holds N/R tokens
        terms.append("Ring 2·A·B·(N/R)·(C/U)·e·(R−1)")
    if p > 1:
        total += b * (n // p) * 64 * e * (p - 1)
        terms.append("velocity B·(N/P)·64·e·(P−1)")
    if cfg > 1:
        total += b * n * 64 * e
        terms.append("CFG B·N·64·e")
    if dp > 1:
        total += fields["batch"] // dp * n * 64 * e * (dp - 1) // fields["steps"]
        terms.append("dp (B/dp)·N·64·e·(dp−1)/steps")
    return total, " + ".join(terms) or "0"


def run_layout_bench(layouts: list[str], fields: dict, json_path: Path | None = None) -> int:
    """Each layout on a CPU backend of its world size: step time, bytes sent per rank, peak memory."""
    import json

    from .models.registry import BUILTINS

    spec = BUILTINS[fields["model"]]
    dims = {"attention_layers": spec.config["num_layers"] + spec.config["num_single_layers"],
            "hidden": spec.config["num_attention_heads"] * spec.config["attention_head_dim"],
            "text_tokens": spec.text_tokens}
    wanted = [(text, parse_layout(text)) for text in layouts]
    rows, records = [], []
    by_world: dict[int, list] = {}
    for text, degrees in wanted:
        by_world.setdefault(world_of(degrees), []).append((text, degrees))
    for world, group in sorted(by_world.items()):
        with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
            options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=world, device="cpu")
            launcher.start(options)
            try:
                client = Client(options.socket)
                for text, degrees in group:
                    request = {**fields, "parallel": degrees or {}}
                    client.sample({**request, "steps": 2})  # warm-up: model, mesh, first-touch allocations
                    _, info = client.sample({**request, "profile": True})
                    records.append({**info, "layout": text, "world": world, "described": info["layout"]})
            finally:
                launcher.stop(options.socket)
    serial = next((statistics.median(r["profile"][0]["step_s"][1:]) for r in records if r["layout"] == "serial"), None)
    for record in records:
        ranks = record["profile"]
        steps = ranks[0]["step_s"][1:]  # the first step is warm-up
        median = statistics.median(steps)
        sent = max(sum(v for k, v in r["sent_bytes"].items() if k != "control") for r in ranks) / fields["steps"]
        formula_bytes, formula = traffic_formula(parse_layout(record["layout"]), dims, fields)
        memory = max(r["peak_memory_bytes"] for r in ranks) / 2**20
        parameters = max(r["parameters"] for r in ranks) * 4 / 2**20  # float32
        speedup = f"{serial / median:.2f}×" if serial else "—"
        rows.append(f"| {record['layout']} | {record['world']} | {median * 1e3:.1f} | "
                    f"{min(steps) * 1e3:.1f}–{max(steps) * 1e3:.1f} | {speedup} | {sent / 1024:.1f} | "
                    f"{formula_bytes / 1024:.1f} | {formula} | {parameters:.2f} | {memory:.0f} |")
    n = (fields["width"] // 16) * (fields["height"] // 16)
    print(f"{fields['model']}, {fields['width']}×{fields['height']} ({n} image tokens), batch {fields['batch']}, "
          f"cfg {fields['cfg']}, {fields['steps']} steps (first excluded), float32, CPU, gloo\n")
    print("| layout | ranks | step median ms | step min–max ms | speed-up vs serial | sent/rank/step KiB, counted | "
          "formula KiB | formula | largest rank's parameters MiB | peak RSS/rank MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if json_path:
        json_path.write_text(json.dumps({"fields": fields, "records": records}, indent=1))
    return 0


def run_pipefusion_error_bench(stages: int, width: int, height: int) -> int:
    """Relative L2 distance to serial for patches ∈ {N, 2N}, warm-up ∈ {0, 1, 2}, steps ∈ {4, 8, 20}."""
    import torch

    from .models import registry
    from .parallel.denoiser import Denoiser
    from .protocol import Message
    from .request import SampleRequest
    from .sampling.generate import generate

    fields = {"model": "flux-tiny", "width": width, "height": height, "seed": 3, "cfg": 3.5, "batch": 1}
    spec = registry.spec("flux-tiny")
    positive, negative = registry.random_conditioning("flux-tiny", 1, 3, spec)
    tensors = {**positive, **{f"negative_{k}": v for k, v in negative.items()}}
    model = registry.build("flux-tiny", torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=stages, device="cpu")
        launcher.start(options)
        try:
            client = Client(options.socket)
            for steps in (4, 8, 20):
                request = SampleRequest.parse(Message("sample", {**fields, "steps": steps}, tensors))
                with torch.no_grad():
                    serial = generate(Denoiser(model), request.generation(spec, *request.conditioning(spec)))
                cells = []
                for patches in (stages, 2 * stages):
                    for warmup in (0, 1, 2):
                        layout = {"pipefusion": stages, "num_pipeline_patch": patches, "warmup_steps": warmup}
                        result, _ = client.sample({**fields, "steps": steps, "parallel": layout}, tensors)
                        error = (result["samples"] - serial).norm() / serial.norm()
                        cells.append(f"{error.item():.2e}")
                rows.append(f"| {steps} | " + " | ".join(cells) + " |")
        finally:
            launcher.stop(options.socket)
    head = " | ".join(f"M={m}, warm-up {w}" for m in (stages, 2 * stages) for w in (0, 1, 2))
    print(f"PipeFusion {stages} stages, flux-tiny {width}×{height}, cfg 3.5: relative L2 distance to serial\n")
    print(f"| steps | {head} |\n|---|" + "---|" * 6 + "\n" + "\n".join(rows))
    return 0
