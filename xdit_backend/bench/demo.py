"""``xdit-backend demo``: the built-in tiny model, once serially in this process and once through a
backend on every available device, the ranks sharing the work in the layout ``auto`` picks,
with progress, timings and the difference between the two. The serial reference runs on the
backend's kind of device and in its dtype (bfloat16 on CUDA), and the accepted difference is
chosen by that dtype."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from ..client import Client
from ..device import compute_dtype
from ..launch import launcher
from ..models import registry
from ..service.reference import serial_latent
from ..service.request import SampleRequest
from ..wire.protocol import Message

MODEL = "flux-tiny"
SEED = 42


def _progress(label: str):
    def show(step: int, total: int, elapsed: float) -> None:
        end = "\n" if step == total else ""
        print(f"\r  {label}: step {step}/{total}  {elapsed:6.2f} s", end=end, file=sys.stderr, flush=True)

    return show


def run_serial(fields: dict, device: torch.device) -> tuple[torch.Tensor, float, torch.dtype]:
    """The reference: the same request run in this process, no backend, no socket, on the backend's
    kind of device and in the dtype the backend computes in there (a built-in is the same model on
    every device, so only rounding can differ)."""
    request = SampleRequest.parse(Message("sample", fields))
    dtype = compute_dtype(request.dtype, device)
    model = registry.build(MODEL, device, dtype)
    show, started = _progress("serial "), time.perf_counter()
    latent = serial_latent(fields, model=model, after_step=lambda i, n: show(i, n, time.perf_counter() - started) or True)
    return latent, time.perf_counter() - started, dtype


def allowed(dtype: torch.dtype, serial: torch.Tensor) -> tuple[float, str]:
    """The largest |backend − serial| the demo accepts, and why. float32: the parity tests' 1e-4.
    Half precision: 4 machine epsilons of the latent's largest value, for the ranks' different
    rounding order (Ulysses or Ring at 2 ranks on the CPU: ~1.1 ε in bf16 and fp16); a different
    model or a broken layout is off by O(1)."""
    if dtype == torch.float32:
        return 1e-4, "float32; the parity tests allow 1e-4"
    epsilons, scale = 4 * torch.finfo(dtype).eps, serial.abs().max().item()
    name = str(dtype).removeprefix("torch.")
    return epsilons * scale, f"{name}; allowed: 4 {name} ε = {epsilons:.3g} of max |serial| {scale:.3g}, i.e. {epsilons * scale:.3g}"


def run_demo(steps: int = 8, size: int = 512, nproc: int | None = None) -> int:
    fields = {"model": MODEL, "width": size, "height": size, "steps": steps, "seed": SEED, "cfg": 3.5}
    print(f"xDiT demo: {MODEL} (random weights), {size}×{size}, {steps} steps, seed {SEED}, cfg 3.5", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="xdit-demo-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=nproc).resolved()
        serial, serial_s, dtype = run_serial(fields, torch.device(options.device))

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
    bound, why = allowed(dtype, serial)
    print(f"\n| run | time |\n|---|---|\n| serial, in this process ({_serial_where(options.device)}) | {serial_s:.2f} s |\n"
          f"| backend cold start ({status['world_size']} ranks on {options.device}) | {cold_start_s:.2f} s |\n"
          f"| backend, first request (includes building the model) | {first_s:.2f} s |\n"
          f"| backend, warm request through the socket | {backend_s:.2f} s |\n")
    print(f"layout of the {status['world_size']} ranks: {info.get('layout')}")
    print(f"max |backend − serial| = {difference:.3g}  ({why})")
    return 0 if difference <= bound else 1


def _serial_where(device: str) -> str:
    return "cuda:0" if device == "cuda" else f"{torch.get_num_threads()} threads"
