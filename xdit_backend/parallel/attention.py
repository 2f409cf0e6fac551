"""The local attention kernel, chosen per call, returning the log-sum-exp the ring merge needs.

Every kernel takes q, k, v as [B, S, H, D] and returns (out [B, Sq, H, D], lse [B, H, Sq] float32).
``choose_kernel`` picks one from the call's dtype and head size D and the device's facts
(``DeviceFacts``: CUDA capability, whether flash-attn imports, whether cuDNN attention exists):

- CPU: PyTorch's CPU flash kernel ("cpu-flash"), any float dtype and head size.
- CUDA, float16/bfloat16:
  - Hopper (sm 9.x) with cuDNN ≥ 9 and D ≤ 128: cuDNN attention ("cudnn-attention"), which returns
    the LSE too and runs well above FA2 on Hopper, if it passes ``cudnn_check`` in this process: the
    shapes sequence parallelism makes (CUDNN_CASES: head sizes 64, 72 and 128, queries ≠ keys, an odd key
    count, zero-padded heads) against the flash kernel, out and LSE. A shape it refuses or computes wrong
    turns it off for the process, the next rule picks, and ``status`` says why (``DeviceFacts.note``).
    UNVERIFIED: no GPU has run it yet (the selftest's attention section runs these shapes and a compiled call).
  - sm ≥ 8.0 and D ≤ 256: flash-attn's ``flash_attn_func`` ("flash-attn") when ``import flash_attn``
    succeeds, else PyTorch's flash kernel ("sdpa-flash"). An install that ``find_spec`` finds but
    whose import fails (a flash-attn built for another torch: "undefined symbol") counts as absent.
  - otherwise (sm < 8.0, D > 256): the memory-efficient kernel ("sdpa-efficient"); it has no
    bfloat16 below sm 8.0, where ``compute_dtype("auto")`` gives float16.
- CUDA, float32: the memory-efficient kernel (the flash kernels take 16-bit floats only).
On CUDA D must be a multiple of 8: the aten kernels are called directly, without the padding
F.scaled_dot_product_attention would add (every family's head size is: 64, 72 or 128).
FlashAttention-3 is not used: its Python interface has changed between releases.

The choice is a few comparisons, made on every call (inside a compiled block: once, at trace
time); a cache keyed by (dtype, D) would be state a compiled block guards on. What costs
something (the capability query, the flash-attn import) is cached per process.
yunchang's own torch paths are not used: its TORCH_MATH returns a zero log-sum-exp, which makes
ring merges wrong (measured on this project's machines; tests/backend/test_parallel.py holds every ring
layout to the serial result).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
HALF = (torch.float16, torch.bfloat16)
STATUS_HEAD_DIM = 128  # Flux's, SD3's and Wan's head size: the one ``status`` reports the choice for


@dataclass(frozen=True)
class DeviceFacts:
    """What the kernel rules need to know of a device, besides the call's dtype and head size."""

    type: str  # "cpu" or "cuda"
    capability: tuple[int, int] | None = None  # CUDA compute capability, (9, 0) on an H100
    flash_attn: bool = False  # flash-attn imports
    cudnn_attention: bool = False  # this torch has cuDNN ≥ 9 (its fused attention with the LSE) and it passed
    note: str | None = None  # why a kernel the rules would pick is not used (cudnn_check's finding)

    def describe(self) -> str:
        where = f"sm {self.capability[0]}.{self.capability[1]}" if self.capability else self.type
        return f"{where}; {self.note}" if self.note else where


def choose_kernel(facts: DeviceFacts, dtype: torch.dtype, head_dim: int) -> str:
    """The kernel's name (a key of KERNELS) for one attention call: the rules of the module docstring."""
    if facts.type == "cpu":
        return "cpu-flash"
    if facts.type != "cuda":
        raise ValueError(f"no local attention kernel for device type {facts.type!r}: the backend runs on cpu or cuda")
    if dtype not in (*HALF, torch.float32):
        raise ValueError(f"attention in {dtype} has no fused CUDA kernel with a log-sum-exp; "
                         "use float32, float16 or bfloat16")
    if head_dim % 8:
        raise ValueError(f"attention head size {head_dim} is not a multiple of 8, which the fused CUDA kernels need")
    if dtype == torch.bfloat16 and facts.capability < (8, 0):
        raise ValueError(f"bfloat16 attention needs a GPU of sm 8.0 or newer, and this one is {facts.describe()}; "
                         "use dtype float16 (or auto, which picks it there)")
    if dtype in HALF and facts.capability[0] == 9 and facts.cudnn_attention and head_dim <= 128:
        return "cudnn-attention"
    if dtype in HALF and facts.capability >= (8, 0) and head_dim <= 256:
        return "flash-attn" if facts.flash_attn else "sdpa-flash"
    return "sdpa-efficient"


@functools.cache
def flash_attn_imports() -> bool:
    """Whether flash-attn imports here, with its compiled extension (yunchang decides the same way)."""
    try:
        from flash_attn import flash_attn_func  # noqa: F401  (loads flash_attn_2_cuda)
    except (ImportError, OSError):  # absent, or built for another torch/CUDA: "undefined symbol …"
        return False
    return True


@functools.cache
def device_facts(device: torch.device) -> DeviceFacts:
    if device.type != "cuda":
        return DeviceFacts(device.type)
    facts = DeviceFacts("cuda", tuple(torch.cuda.get_device_capability(device)), flash_attn_imports(),
                        torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000)
    if choose_kernel(facts, torch.float16, STATUS_HEAD_DIM) != "cudnn-attention":  # float16: valid on any GPU
        return facts
    failure = cudnn_check(_cudnn_attention, _sdpa_flash, device)
    return facts if failure is None else replace(facts, cudnn_attention=False, note=f"cuDNN attention off: {failure}")


# (queries, keys, heads, zero heads, D): what sequence parallelism hands the kernel. A Flux 1008² share of
# 4481 tokens (3969 image + 512 text) whole (ulysses) and halved (ring: 2241 queries, keys of both halves),
# PixArt's D = 72, an odd key count (padded keys cut back), and ulysses' zero-padded heads.
CUDNN_CASES = ((4481, 4481, 12, 0, 128), (2241, 4481, 24, 0, 128), (2241, 2241, 24, 0, 128), (333, 1027, 8, 0, 64),
               (256, 1031, 16, 0, 72), (512, 512, 12, 2, 128))
CHECK_TOLERANCE = (2e-2, 5e-2)  # bfloat16: relative L2 of out, max |Δ lse| between the two kernels


def case_inputs(case: tuple, generator: torch.Generator, device: torch.device, dtype: torch.dtype) -> tuple:
    """q, k, v [1, S, H, D] of a CUDNN_CASES entry (queries, keys, heads, zero heads, D): random, the last heads
    zero as ulysses pads them, drawn on the CPU and moved."""
    sq, sk, heads, zero_heads, d = case
    q, k, v = (torch.randn(1, s, heads, d, generator=generator) for s in (sq, sk, sk))  # [B, S, H, D]
    for t in (q, k, v):
        t[:, :, heads - zero_heads:] = 0
    return tuple(t.to(device, dtype) for t in (q, k, v))


def cudnn_check(kernel: Kernel, reference: Kernel, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                cases=CUDNN_CASES) -> str | None:
    """None when ``kernel`` gives ``reference``'s out and LSE on every case, else what went wrong where."""
    generator = torch.Generator().manual_seed(0)
    for case in cases:
        sq, sk, heads, zero_heads, d = case
        q, k, v = case_inputs(case, generator, device, dtype)
        where = f"{sq} queries × {sk} keys, {heads} heads ({zero_heads} zero), D={d}"
        try:
            out, lse = kernel(q, k, v, d ** -0.5)
        except RuntimeError as exc:
            return f"it refused {where} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
        want_out, want_lse = reference(q, k, v, d ** -0.5)
        if out.shape != want_out.shape or lse.shape != want_lse.shape:
            return f"it gave out {tuple(out.shape)} and lse {tuple(lse.shape)} for {where}"
        rel = ((out.float() - want_out.float()).norm() / want_out.float().norm().clamp_min(1e-6)).item()
        lse_error = (lse.float() - want_lse.float()).abs().max().item()
        if not (rel <= CHECK_TOLERANCE[0] and lse_error <= CHECK_TOLERANCE[1]):
            return f"it computed {where} wrong (out rel {rel:.2e}, lse {lse_error:.2e} from the flash kernel)"
    return None


def _cpu_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, scale=scale)  # [B, H, S, D]
    return out.transpose(1, 2), lse.float()  # [B, Sq, H, D], [B, H, Sq]


def _sdpa_flash(q, k, v, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, False, False, scale=scale)[:2]
    return out.transpose(1, 2), lse  # [B, Sq, H, D], [B, H, Sq] float32


def _sdpa_efficient(q, k, v, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, False,
                                                                      scale=scale)[:2]
    return out.transpose(1, 2), lse[..., : q.shape[1]]  # lse [B, H, Sq padded to 32] → [B, H, Sq]


def _cudnn_attention(q, k, v, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kh, vh, None, True, 0.0, False, False,
                                                                  scale=scale)[:2]
    # lse [B, H, Sq, 1] (possibly a transposed view; [B, H, Sq] in older torch) → [B, H, Sq]
    return out.transpose(1, 2), lse.reshape(q.shape[0], q.shape[2], q.shape[1]).float()


def _flash_attn(q, k, v, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)  # lse [B, H, Sq]
    return out, lse.float()


KERNELS = {"cpu-flash": _cpu_flash, "cudnn-attention": _cudnn_attention, "flash-attn": _flash_attn,
           "sdpa-flash": _sdpa_flash, "sdpa-efficient": _sdpa_efficient}


def local_attention(device: torch.device) -> Kernel:
    """A kernel with the calling convention yunchang's ring passes to ``attn_processor``; each call
    runs the kernel the rules pick for its q's dtype and head size on ``device``."""
    facts = device_facts(device)

    def attend(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_unused):
        if causal or dropout_p:
            raise NotImplementedError("the local kernels are for non-causal inference attention without dropout")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return KERNELS[choose_kernel(facts, q.dtype, q.shape[-1])](q, k, v, scale)

    return attend


def sdpa_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The backend F.scaled_dot_product_attention dispatches unmasked, non-causal [1, 1, 256, D] q, k, v
    of ``dtype`` to on ``device`` (PyTorch's own choice): what diffusers' processors run, which the
    serial, cfg and dp layouts use."""
    from torch.nn.attention import SDPBackend

    q = torch.zeros(1, 1, 256, head_dim, dtype=dtype, device=device)
    return "sdpa " + SDPBackend(torch._fused_sdp_choice(q, q, q)).name.lower()


def in_use(device: torch.device, dtype: torch.dtype, head_dim: int, ours: bool) -> str:
    """The attention that runs at ``head_dim`` in ``dtype``: our kernel's name when ``ours`` (the
    sequence-parallel and PipeFusion processors), else the SDPA backend diffusers' processors get."""
    return choose_kernel(device_facts(device), dtype, head_dim) if ours else sdpa_backend(device, dtype, head_dim)


def status_line(device: torch.device, dtype: torch.dtype) -> str:
    """``status``'s attention_kernel: what the rules pick on ``device`` for its default dtype."""
    facts = device_facts(device)
    name = str(dtype).removeprefix("torch.")
    return f"{choose_kernel(facts, dtype, STATUS_HEAD_DIM)} ({name}, head dim {STATUS_HEAD_DIM}, {facts.describe()})"
