"""``xdit-backend bench model-call``: what the xDiT MODEL's way in costs per step against the xDiT Sampler's.

The xDiT Sampler sends one request and the backend runs the whole loop; the xDiT MODEL (nodes/remote_model.py)
leaves the loop to ComfyUI and sends one ``evaluate`` request per model call. Here the MODEL's loop is ComfyUI's
Euler written out in this process (the backend's own model-sampling math, which is ComfyUI's), calling the
backend through the client as the stand-in does: per step the latent goes out and the output comes back, the
conditioning only with the first call. Both run the same model, size, seed and layout on one backend, their
runs interleaved; the MODEL's step is timed here (socket and all, as ComfyUI would see it), the Sampler's by
its profile. Their final latents are compared too (the same Euler: they agree to float rounding).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..client import Client
from ..launch import launcher
from ..launch.options import LaunchOptions
from ..models import registry
from ..sampling import schedulers
from ..sampling.generate import comfy_noise

SEED = 3


def remote_loop(client: Client, fields: dict, spec, inputs: dict, width: int, height: int, steps: int) -> dict:
    """Euler with cfg 1 through ``evaluate`` calls: seconds per step, bytes per call, the final latent."""
    sampling = spec.model_sampling(None)
    sigmas = schedulers.sigmas("simple", sampling, steps, 1.0, sampler="euler").float()
    shape = spec.latent_shape(1, width, height)
    x = sampling.noise_scaling(sigmas[0], comfy_noise(shape, SEED), torch.zeros(shape))
    guidance = {"guidance": torch.tensor([spec.default_guidance])} if spec.default_guidance is not None else {}
    client.inputs_sent.clear()  # the first call carries the conditioning, as a generation's first call does
    step_s, sent, received = [], [], 0
    for i in range(steps):
        started = time.perf_counter()
        sigma = sigmas[i:i + 1]  # [1]
        tensors = {"x": sampling.calculate_input(sigma, x), "timestep": sampling.timestep(sigma), **guidance}
        out, _ = client.evaluate(fields, tensors, inputs)
        denoised = sampling.calculate_denoised(sigma, out, x)
        x = x + (x - denoised) / sigma * (sigmas[i + 1] - sigma)  # Euler, as ComfyUI's sample_euler steps
        step_s.append(time.perf_counter() - started)
        sent.append(sum(t.nbytes for t in tensors.values()))
        received = out.nbytes
    conditioning = sum(t.nbytes for t in inputs.values())
    latent = spec.latent_format.process_out(sampling.inverse_noise_scaling(sigmas[-1], x))
    return {"step_s": step_s, "call_bytes_out": sent[-1], "call_bytes_back": received,
            "conditioning_bytes_once": conditioning, "latent": latent}


def measure(model: str, worlds: tuple[int, ...], width: int, height: int, steps: int, repeats: int,
            dtype: str = "auto", device: str = "cpu") -> list[dict]:
    spec = registry.spec(model)
    positive, _ = registry.random_conditioning(model, 1, SEED, spec)
    figures = []
    for world in worlds:
        with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
            options = LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=world, device=device,
                                    topology_probe="off")
            launcher.start(options)
            try:
                client = Client(options.socket)
                layout = {} if world == 1 else {"ulysses": world}
                sample = {"model": model, "width": width, "height": height, "steps": steps, "seed": SEED,
                          "cfg": 1.0, "dtype": dtype, "parallel": layout, "profile": True}
                call = {"model": model, "dtype": dtype, "parallel": layout}
                tensors = {"context": positive["context"], "pooled": positive["pooled"]} if "pooled" in positive \
                    else {"context": positive["context"]}
                client.sample({**sample, "steps": 1, "profile": False}, timeout=3600)  # loads the model
                sampler_steps, model_steps, last = [], [], None
                for _ in range(repeats):
                    result, info = client.sample(sample, timeout=3600)
                    sampler_steps += info["profile"][0]["step_s"][1:]
                    last = remote_loop(client, call, spec, tensors, width, height, steps)
                    model_steps += last["step_s"][1:]
                sampler, remote = statistics.median(sampler_steps), statistics.median(model_steps)
                difference = (result["samples"] - last["latent"]).abs().max().item()
                figures.append({"world": world, "layout": "serial" if world == 1 else f"ulysses={world}",
                                "sampler_step_s": sampler, "model_step_s": remote, "ratio": remote / sampler,
                                "sampler_min_s": min(sampler_steps), "model_min_s": min(model_steps),
                                "call_bytes_out": last["call_bytes_out"], "call_bytes_back": last["call_bytes_back"],
                                "conditioning_bytes_once": last["conditioning_bytes_once"],
                                "max_latent_difference": difference})
            finally:
                launcher.stop(options.socket)
    return figures


def run_model_call_bench(model: str, worlds: tuple[int, ...], width: int, height: int, steps: int, repeats: int,
                         dtype: str = "auto", device: str = "cpu") -> int:
    figures = measure(model, worlds, width, height, steps, repeats, dtype, device)
    threads = f", {torch.get_num_threads()} threads" if device == "cpu" else ""
    print(f"{model} {width}×{height}, {steps} steps × {repeats} runs, cfg 1 (first step of each run excluded), "
          f"{device}{threads}\n")
    print("| world | layout | xDiT Sampler step ms, median (min) | xDiT MODEL step ms, median (min) | MODEL / Sampler, "
          "median (min) | bytes per call (out + back) | conditioning, first call only | max |latent difference| |\n"
          "|---|---|---|---|---|---|---|---|")
    for f in figures:
        print(f"| {f['world']} | {f['layout']} | {f['sampler_step_s'] * 1e3:.1f} ({f['sampler_min_s'] * 1e3:.1f}) | "
              f"{f['model_step_s'] * 1e3:.1f} ({f['model_min_s'] * 1e3:.1f}) | {f['ratio']:.3f} "
              f"({f['model_min_s'] / f['sampler_min_s']:.3f}) | {f['call_bytes_out']} + {f['call_bytes_back']} | "
              f"{f['conditioning_bytes_once']} | {f['max_latent_difference']:.3g} |")
    return 0
