"""``xdit-backend demo``: the built-in tiny model, once serially in this process and once through a
backend on every available device, the ranks sharing the work in the layout ``auto`` picks,
with progress, timings and the difference between the two."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from . import launcher
from .client import Client
from .models import registry
from .request import SampleRequest
from .protocol import Message
from .parallel.denoiser import Denoiser
from .sampling.generate import generate

MODEL = "flux-tiny"
SEED = 42


def _progress(label: str):
    def show(step: int, total: int, elapsed: float) -> None:
        end = "\n" if step == total else ""
        print(f"\r  {label}: step {step}/{total}  {elapsed:6.2f} s", end=end, file=sys.stderr, flush=True)

    return show


def run_serial(fields: dict) -> tuple[torch.Tensor, float]:
    """The reference: the same request run in this process, no backend, no socket."""
    request = SampleRequest.parse(Message("sample", fields))
    model = registry.build(MODEL, torch.device("cpu"))
    positive, negative = registry.random_conditioning(MODEL, request.batch, request.seed, model.spec)
    show, started = _progress("serial "), time.perf_counter()
    latent = generate(Denoiser(model), request.generation(model.spec, positive, negative),
                      lambda i, n: show(i, n, time.perf_counter() - started) or True)
    return latent, time.perf_counter() - started


def run_demo(steps: int = 8, size: int = 512, nproc: int | None = None) -> int:
    fields = {"model": MODEL, "width": size, "height": size, "steps": steps, "seed": SEED, "cfg": 3.5}
    print(f"xDiT demo: {MODEL} (random weights), {size}×{size}, {steps} steps, seed {SEED}, cfg 3.5", file=sys.stderr)
    serial, serial_s = run_serial(fields)

    with tempfile.TemporaryDirectory(prefix="xdit-demo-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=nproc).resolved()
        print(f"starting a backend: {options.nproc} ranks on {options.device} …", file=sys.stderr)
        started = time.perf_counter()
        status = launcher.start(options)
        cold_start_s = time.perf_counter() - started
        try:
            client = Client(options.socket)
            started = time.perf_counter()
            client.sample(fields, on_progress=_progress("backend, first"))
            first_s = time.perf_counter() - started
            started = time.perf_counter()
            result, info = client.sample(fields, on_progress=_progress("backend, warm"))
            backend_s = time.perf_counter() - started
        finally:
            launcher.stop(options.socket)

    difference = (result["samples"] - serial).abs().max().item()
    print(f"\n| run | time |\n|---|---|\n| serial, in this process ({torch.get_num_threads()} threads) | {serial_s:.2f} s |\n"
          f"| backend cold start ({status['world_size']} ranks on {options.device}) | {cold_start_s:.2f} s |\n"
          f"| backend, first request (includes building the model) | {first_s:.2f} s |\n"
          f"| backend, warm request through the socket | {backend_s:.2f} s |\n")
    print(f"layout of the {status['world_size']} ranks: {info.get('layout')}")
    print(f"max |backend − serial| = {difference:.3g}  (float32; the parity tests allow 1e-4)")
    return 0 if difference <= 1e-4 else 1
