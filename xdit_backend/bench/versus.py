"""Our sequence parallelism against diffusers' context parallelism (issue 12): one Flux-type
transformer forward on the CPU, the same seeded weights and inputs everywhere, 2 threads in total
(serial: one process, 2 threads; parallel: world 2 over gloo, 1 thread per rank).

What diffusers 0.42.1's context parallelism needs to run on a CPU-only torch (see ``_diffusers_cp``):
- ``enable_parallelism`` picks its device as ``rank % torch.accelerator.device_count()``, which is
  ``rank % 0`` without an accelerator (ZeroDivisionError): the count reads 1 during that call;
- Ulysses runs on the "native" backend (``F.scaled_dot_product_attention``) unchanged;
- Ring needs every block's log-sum-exp: "native" refuses ``return_lse=True``, and "_native_flash"
  calls ``aten._scaled_dot_product_flash_attention``, which has no CPU kernel. Ring therefore runs
  "_native_flash" with that one op replaced by the CPU flash op (the kernel ours uses too).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
from unittest import mock

import torch

MODEL = "flux-tiny"
CPU = torch.device("cpu")


def _inputs(width: int, height: int, text_tokens: int, spec):
    """Latent x [1, 16, H/8, W/8] ((H/16)·(W/16) image tokens), σ [1], text [1, L, C_text], pooled [1, C_pool]."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(1, 16, height // 8, width // 8, generator=g)
    cond = {"context": torch.randn(1, text_tokens, spec.context_dim, generator=g),
            "pooled": torch.randn(1, spec.pooled_dim, generator=g)}
    return x, torch.tensor([0.7]), cond


def _timed(call, repeats: int, barrier=None) -> tuple[float, torch.Tensor]:
    """Warm up once, then the median of ``repeats`` calls in ms, and the last output."""
    with torch.no_grad():
        out = call()
        times = []
        for _ in range(repeats):
            if barrier:
                barrier()  # the ranks start each call together
            started = time.perf_counter()
            out = call()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), out


def _cpu_flash_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """diffusers' _native_flash forward op on the CPU: q, k, v [B, S, H, D] → out [B, S, H, D], lse [B, S, H]."""
    from ..parallel import attention

    out, lse = attention.local_attention(CPU)(query, key, value, dropout_p, scale, is_causal)  # lse [B, H, S]
    lse = lse.transpose(1, 2).contiguous()  # [B, S, H], as diffusers' own op returns it
    return (out, lse) if return_lse else out


def _diffusers_cp(transformer, degrees: dict) -> list:
    """diffusers' context parallelism on ``transformer``; returns the patches to keep active while it runs."""
    from diffusers import ContextParallelConfig

    ring = degrees.get("ring", 1)
    patches = []
    if ring > 1:
        transformer.set_attention_backend("_native_flash")
        patches.append(mock.patch("diffusers.models.attention_dispatch._native_flash_attention_forward_op",
                                  _cpu_flash_forward_op))
    with mock.patch("torch.accelerator.device_count", return_value=1):
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degrees.get("ulysses", 1),
                                                                    ring_degree=ring))
    return patches


def _rank(rank: int, world: int, port: int, layouts: list, size: tuple, repeats: int, result: str) -> None:
    """One rank of a world's gloo group; per layout: ours, then diffusers' CP, each on a fresh seeded model."""
    import warnings

    import torch.distributed as dist
    from diffusers.utils import logging as diffusers_logging

    from ..distributed.config import ParallelConfig
    from ..distributed.mesh import MeshCache
    from ..models import registry
    from ..parallel import attention, sequence

    warnings.filterwarnings("ignore", category=FutureWarning)  # diffusers' funcol.all_gather_tensor
    diffusers_logging.set_verbosity_error()  # "enable_parallelism is an experimental feature"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    meshes, results = MeshCache("cpu"), {}
    try:
        for text, degrees in layouts:
            ours = registry.build(MODEL, CPU, torch.float32)
            x, t, cond = _inputs(*size, ours.spec)
            guidance = ours.spec.default_guidance
            layout = meshes.get(ParallelConfig(**degrees))
            kernel = attention.local_attention(CPU)
            attached = sequence.attach(ours.transformer, ours.spec.sequence_plan, layout, kernel)
            ours_ms, ours_out = _timed(lambda: ours.output(x, t, cond, guidance), repeats, dist.barrier)
            attached.detach()

            theirs = registry.build(MODEL, CPU, torch.float32)  # a fresh copy of the same weights
            patches = _diffusers_cp(theirs.transformer, degrees)
            for patch in patches:
                patch.start()
            try:  # full inputs: diffusers' hooks cut them (its Flux _cp_plan) and gather after proj_out
                theirs_ms, theirs_out = _timed(lambda: theirs.output(x, t, cond, guidance), repeats, dist.barrier)
            finally:
                for patch in patches:
                    patch.stop()
            results[text] = {"ours_ms": ours_ms, "ours": ours_out, "theirs_ms": theirs_ms, "theirs": theirs_out}
        if rank == 0:
            torch.save(results, result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(width=1024, height=1024, text_tokens=256, repeats=3, layouts=("ulysses=2", "ring=2")) -> dict:
    """Serial, then each layout's two parallel runs:
    {"serial_ms": ms, "scale": largest |serial|, layout: {"ours_ms", "theirs_ms", "ours_diff", "theirs_diff"}}."""
    import torch.multiprocessing as mp

    from ..models import registry
    from .layouts import parse_layout, world_of

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = registry.build(MODEL, CPU, torch.float32)
        x, t, cond = _inputs(width, height, text_tokens, model.spec)
        serial_ms, serial = _timed(lambda: model.output(x, t, cond, model.spec.default_guidance), repeats)
    finally:
        torch.set_num_threads(threads)
    scale = serial.abs().max().item()  # [1, 16, H/8, W/8]
    results = {"serial_ms": serial_ms, "scale": scale}
    by_world: dict[int, list] = {}
    for text in layouts:
        degrees = parse_layout(text)
        by_world.setdefault(world_of(degrees), []).append((text, degrees))
    for world, group in by_world.items():  # one spawned group per world size: its start-up is paid once
        with tempfile.TemporaryDirectory(prefix="xdit-versus-") as tmp:
            path = os.path.join(tmp, "rank0.pt")
            mp.spawn(_rank, args=(world, _free_port(), group, (width, height, text_tokens), repeats, path),
                     nprocs=world, join=True)
            got = torch.load(path)
        for text, _ in group:
            r = got[text]
            results[text] = {"ours_ms": r["ours_ms"], "theirs_ms": r["theirs_ms"],
                             "ours_diff": (r["ours"] - serial).abs().max().item(),
                             "theirs_diff": (r["theirs"] - serial).abs().max().item()}
    return results


def run_versus_diffusers_bench(width=1024, height=1024, text_tokens=256, repeats=3,
                               layouts=("ulysses=2", "ring=2")) -> int:
    """Print the markdown table; 1 when either parallel output is off serial by more than 1e-4 of its largest value."""
    results = compare(width, height, text_tokens, repeats, layouts)
    serial = results["serial_ms"]
    tokens = (width // 16) * (height // 16)
    print(f"{MODEL}, float32, CPU, 2 threads in total (serial: 1 process × 2 threads; parallel: 2 ranks × 1 thread, "
          f"gloo); one transformer forward, {tokens} image + {text_tokens} text tokens; median of {repeats} "
          f"after 1 warm-up\n\nserial: {serial:.1f} ms\n")
    print("| layout | ours ms | ours speed-up vs serial | diffusers CP ms | diffusers speed-up "
          "| max \\|ours − serial\\| | max \\|diffusers − serial\\| |\n|---|---|---|---|---|---|---|")
    failed = []
    for text in layouts:
        r = results[text]
        print(f"| {text} | {r['ours_ms']:.1f} | {serial / r['ours_ms']:.2f}× | {r['theirs_ms']:.1f} | "
              f"{serial / r['theirs_ms']:.2f}× | {r['ours_diff']:.2e} | {r['theirs_diff']:.2e} |")
        failed += [f"{text} {name}" for who, name in (("ours", "ours"), ("theirs", "diffusers CP"))
                   if r[f"{who}_diff"] > 1e-4 * results["scale"]]
    scale = results["scale"]
    print(f"\nlargest serial output value {scale:.3g}; parity bound 1e-4 of it: {1e-4 * scale:.2e}; "
          f"load average at the end {os.getloadavg()[0]:.1f} (timings from a busy machine are not comparable)")
    print("FAIL: " + ", ".join(failed) if failed else "parity: PASS")
    return 1 if failed else 0
