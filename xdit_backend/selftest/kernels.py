"""The selftest's first sections: what this machine has, and the local attention kernels.

The kernels are checked against a float64 reference on the CPU: out and log-sum-exp, every dtype
the backend computes in, head dims up to 256, a text-like and an image-like shape; on a GPU also the shapes
sequence parallelism makes (attention.CUDNN_CASES) and one compiled call. The ring is then
simulated on one GPU: the K/V cut into chunks, each through our kernel, combined with yunchang's own
``update_out_and_lse``, the same merge its ring runs between ranks, so its LSE convention is checked
without NCCL.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess

import torch

from ..parallel import attention
from .runner import Checks, Context

# tolerances against float64: relative L2 of the output, max |Δ lse|
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-3, 5e-3), torch.bfloat16: (1e-2, 3e-2)}
HEAD_DIMS = (16, 32, 64, 72, 128, 256)
SHAPES = ((77, 300), (576, 1024))  # (queries, keys): a prompt-like and an image-like attention
HEADS = 2


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def _driver() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def environment(ctx: Context, checks: Checks) -> None:
    checks.record(torch=torch.__version__, diffusers=_version("diffusers"), yunchang=_version("yunchang"),
                  flash_attn=_version("flash-attn"), device=str(ctx.device),
                  PYTORCH_CUDA_ALLOC_CONF=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                  CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if ctx.device.type != "cuda":
        return
    checks.record(cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())), driver=_driver(),
                  gpu=torch.cuda.get_device_name(ctx.device),
                  capability=".".join(map(str, torch.cuda.get_device_capability(ctx.device))),
                  bf16=torch.cuda.is_bf16_supported(), gpus=torch.cuda.device_count(),
                  memory_gib=round(torch.cuda.get_device_properties(ctx.device).total_memory / 2**30, 1))
    checks.expect(torch.distributed.is_nccl_available(), "this torch has no NCCL")


def _reference(q, k, v, scale):
    """float64 attention on the inputs' device (the largest cases take seconds on a CPU), returned on the CPU:
    out [B, Sq, H, D], lse [B, H, Sq]."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    scores = q @ k.transpose(-1, -2) * scale  # [B, H, Sq, Sk]
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Sq]
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).cpu(), lse.cpu()


def _inputs(ctx, sq, sk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, s, HEADS, d, generator=g) for s in (sq, sk, sk))  # [B, S, H, D]
    return tuple(t.to(ctx.device, dtype) for t in (q, k, v))


def _dtypes(ctx) -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16) if ctx.device.type == "cpu" else (torch.bfloat16, torch.float16, torch.float32)


def attention_kernels(ctx: Context, checks: Checks) -> None:
    kernel = attention.local_attention(ctx.device)
    facts = attention.device_facts(ctx.device)
    checks.record(device_facts=facts.describe(), **{
        f"kernel_{str(dtype)[6:]}": attention.choose_kernel(facts, dtype, 128) for dtype in _dtypes(ctx)})
    shapes = ((77, 300),) if ctx.quick else SHAPES
    worst: dict[str, list[float]] = {}
    for dtype in _dtypes(ctx):
        out_tol, lse_tol = TOLERANCE[dtype]
        for d in HEAD_DIMS:
            for seed, (sq, sk) in enumerate(shapes):
                q, k, v = _inputs(ctx, sq, sk, d, dtype, seed)
                out, lse = kernel(q, k, v)
                ref_out, ref_lse = _reference(q, k, v, d ** -0.5)
                where = f"{str(dtype)[6:]} D={d} {sq}×{sk}"
                if not checks.expect(tuple(lse.shape) == (1, HEADS, sq) and lse.dtype == torch.float32,
                                     f"{where}: lse is {tuple(lse.shape)} {lse.dtype}, not [B, H, Sq] float32"):
                    continue
                rel = ((out.double().cpu() - ref_out).norm() / ref_out.norm()).item()
                lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
                checks.expect(rel <= out_tol and lse_err <= lse_tol,
                              f"{where}: out rel {rel:.2e} (≤ {out_tol:g}), lse {lse_err:.2e} (≤ {lse_tol:g})")
                errors = worst.setdefault(str(dtype)[6:], [0.0, 0.0])
                errors[0], errors[1] = max(errors[0], rel), max(errors[1], lse_err)
    checks.record(**{f"{name}_worst_out_rel": e[0] for name, e in worst.items()},
                  **{f"{name}_worst_lse_abs": e[1] for name, e in worst.items()})
    if not ctx.quick:
        _sequence_parallel_shapes(ctx, checks, kernel)


def _sequence_parallel_shapes(ctx: Context, checks: Checks, kernel) -> None:
    """The shapes sequence parallelism hands the kernel (attention.CUDNN_CASES: a 1008² Flux share whole and
    halved, D = 72, an odd key count, zero-padded heads) in bfloat16 against float64, and one of them through
    torch.compile (what a compiled sequence-parallel block runs) against the eager call."""
    out_tol, lse_tol = TOLERANCE[torch.bfloat16]
    generator = torch.Generator().manual_seed(3)
    for case in attention.CUDNN_CASES:
        sq, sk, heads, zero_heads, d = case
        q, k, v = attention.case_inputs(case, generator, ctx.device, torch.bfloat16)
        out, lse = kernel(q, k, v)
        ref_out, ref_lse = _reference(q, k, v, d ** -0.5)
        rel = ((out.double().cpu() - ref_out).norm() / ref_out.norm()).item()
        lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
        checks.expect(rel <= out_tol and lse_err <= lse_tol, f"bfloat16 {sq}×{sk}, {heads} heads ({zero_heads} zero), "
                      f"D={d}: out rel {rel:.2e} (≤ {out_tol:g}), lse {lse_err:.2e} (≤ {lse_tol:g})")
    compiled_out, compiled_lse = torch.compile(kernel, fullgraph=True)(q, k, v)  # the last case
    rel = ((compiled_out.float() - out.float()).norm() / out.float().norm()).item()
    lse_err = (compiled_lse - lse).abs().max().item()
    checks.record(compiled_vs_eager_out_rel=rel, compiled_vs_eager_lse_abs=lse_err)
    checks.expect(rel <= out_tol and lse_err <= lse_tol, f"compiled attention: out rel {rel:.2e} from eager, "
                                                          f"lse {lse_err:.2e}")


def ring(ctx: Context, checks: Checks) -> None:
    from yunchang.ring.utils import update_out_and_lse  # the merge yunchang's ring runs between ranks

    kernel = attention.local_attention(ctx.device)
    chunks = 4
    for dtype in _dtypes(ctx):
        out_tol, lse_tol = TOLERANCE[dtype]
        q, k, v = _inputs(ctx, 256, 1024, 64, dtype, 7)
        out, lse = None, None
        for kc, vc in zip(k.chunk(chunks, dim=1), v.chunk(chunks, dim=1)):  # [B, Sk/4, H, D] each, a ring step
            block_out, block_lse = kernel(q, kc, vc)  # out [B, Sq, H, D], lse [B, H, Sq]
            out, lse = update_out_and_lse(out, lse, block_out, block_lse)  # out [B, Sq, H, D], lse [B, Sq, H, 1]
        lse = lse.squeeze(-1).transpose(1, 2)  # [B, Sq, H, 1] → [B, H, Sq], as yunchang's ring returns it
        ref_out, ref_lse = _reference(q, k, v, 64 ** -0.5)
        rel = ((out.double().cpu() - ref_out).norm() / ref_out.norm()).item()
        lse_err = (lse.double().cpu() - ref_lse).abs().max().item()
        name = str(dtype)[6:]
        checks.record(**{f"{name}_out_rel": rel, f"{name}_lse_abs": lse_err})
        checks.expect(rel <= out_tol and lse_err <= lse_tol,
                      f"{name}: {chunks}-step ring out rel {rel:.2e} (≤ {out_tol:g}), lse {lse_err:.2e} (≤ {lse_tol:g})")

