"""``xdit-backend bench memory --measure``: the memory model against measured CPU peaks.

One transformer forward of ``flux-dev-two-blocks`` (Flux.1-dev's width, 1 double + 1 single block,
545 M parameters, random weights) on the CPU in float32, serial and Ulysses over 2 gloo ranks, each
rank a fresh process. Two measurements per rank, both of the forward alone (the weights are
resident and touched before it):

- tensors: torch's MemTracker (torch.distributed._tools.mem_tracker), the peak of the bytes held by
  live tensors during the forward, less the parameters' (exact for tensors; blind to a kernel's
  internal scratch and to gloo's buffers);
- RSS: the process's peak resident set during the forward (VmHWM, reset through
  /proc/self/clear_refs) less its resident set just before. glibc is told to serve every block
  over 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_), so freed tensors leave the resident set at once
  and the peak is that of live memory, not of the heap's high-water mark.

The prediction is memory_model.estimate's activations + workspace for the same tokens per rank.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

MODEL = "flux-dev-two-blocks"
CPU = torch.device("cpu")
MMAP_THRESHOLD = str(64 * 1024)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS (Linux ≥ 4.0)


def _inputs(spec, width: int, height: int, text_tokens: int):
    """Latent [1, 16, H/8, W/8] ((H/16)·(W/16) image tokens), σ [1], text [1, L, 4096], pooled [1, 768]."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 16, height // 8, width // 8, generator=g)
    cond = {"context": torch.randn(1, text_tokens, spec.context_dim, generator=g),
            "pooled": torch.randn(1, spec.pooled_dim, generator=g)}
    return x, torch.tensor([0.7]), cond


def _rank(rank: int, world: int, port: int, size: tuple[int, int, int], result: str) -> None:
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker

    from ..distributed.config import ParallelConfig
    from ..distributed.mesh import MeshCache
    from ..models import registry
    from ..parallel import attention, sequence

    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = registry.build(MODEL, CPU, torch.float32)
        x, t, cond = _inputs(model.spec, *size)
        if world > 1:
            layout = MeshCache("cpu").get(ParallelConfig(ulysses=world))
            sequence.attach(model.transformer, model.spec.sequence_plan, layout, attention.local_attention(CPU))

        def forward():
            return model.output(x, t, cond, model.spec.default_guidance)

        with torch.no_grad():
            forward()  # warm-up: one-time allocations (thread pools, RoPE tables, gloo buffers)
            before = _status_kib("VmRSS")
            _reset_peak_rss()
            forward()
            rss_peak = (_status_kib("VmHWM") - before) * 1024
            model.transformer.requires_grad_(True)  # MemTracker hooks every parameter's gradient (none made here)
            tracker = MemTracker()
            with tracker:
                forward()
        peak = tracker.get_tracker_snapshot("peak")[CPU]
        held = sum(v for k, v in peak.items() if getattr(k, "name", "") in ("PARAM", "BUFFER"))
        record = {"rss_peak": rss_peak, "tensor_peak": peak["Total"] - held}
        Path(f"{result}.{rank}").write_text(json.dumps(record))
    finally:
        if world > 1:
            dist.destroy_process_group()


def measure(world: int, width: int, height: int, text_tokens: int) -> list[dict]:
    """Each rank's measured bytes for one forward at ``world`` ranks (Ulysses), in fresh processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by glibc when each spawned rank starts
    with tempfile.TemporaryDirectory(prefix="xdit-memory-") as tmp:
        result = os.path.join(tmp, "rank")
        mp.spawn(_rank, args=(world, port, (width, height, text_tokens), result), nprocs=world, join=True)
        return [json.loads(Path(f"{result}.{rank}").read_text()) for rank in range(world)]


def predicted(world: int, width: int, height: int, text_tokens: int) -> int:
    from diffusers import FluxTransformer2DModel

    from ..memory import model as memory_model
    from ..models import registry

    with torch.device("meta"):
        meta = FluxTransformer2DModel(**registry.BUILTINS[MODEL].config)
    tokens = -(-((width // 16) * (height // 16) + text_tokens) // world)
    estimate = memory_model.estimate(meta, storage_bytes_per_value=4, compute_dtype=torch.float32, shard_ranks=1,
                                     tokens_per_rank=tokens, rows=1, ulysses=world)
    return estimate.activations + estimate.workspace


def run_memory_check(width: int, height: int, text_tokens: int) -> int:
    image_tokens = (width // 16) * (height // 16)
    print(f"{MODEL} (Flux.1-dev width 3072, 1 double + 1 single block), float32, CPU, one forward of "
          f"{image_tokens} image + {text_tokens} text tokens; bytes of the forward alone, MiB per rank\n")
    print("| layout | tokens per rank | predicted (activations + workspace) | measured: tensors (MemTracker) | "
          "measured: RSS peak | tensors / predicted |\n|---|---|---|---|---|---|")
    for world in (1, 2):
        ranks = measure(world, width, height, text_tokens)
        guess = predicted(world, width, height, text_tokens)
        tensors, rss = max(r["tensor_peak"] for r in ranks), max(r["rss_peak"] for r in ranks)
        layout = "serial" if world == 1 else f"ulysses={world}"
        tokens = -(-(image_tokens + text_tokens) // world)
        print(f"| {layout} | {tokens} | {guess / 2**20:.0f} | {tensors / 2**20:.0f} | {rss / 2**20:.0f} | "
              f"{tensors / guess:.2f} |")
    return 0
