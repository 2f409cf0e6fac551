"""``xdit-backend bench``: measurements, printed as markdown. Timings live here, never in tests."""

from __future__ import annotations

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
    print(f"| what | median ms | p90 ms | runs |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"\nframe size for the latent: {len(frame)} bytes")
    return 0
