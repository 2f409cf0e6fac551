"""The local attention kernel, chosen by device, returning the log-sum-exp the ring merge needs.

Every kernel takes q, k, v as [B, S, H, D] and returns (out [B, Sq, H, D], lse [B, H, Sq] float32):
- flash-attn's ``flash_attn_func`` when it is installed (CUDA, fp16/bf16);
- PyTorch's fused SDPA kernels on CUDA (flash for fp16/bf16, memory-efficient otherwise);
- PyTorch's CPU flash kernel on the CPU.
yunchang's own torch paths are not used: its TORCH_MATH returns a zero log-sum-exp, which makes
ring merges wrong (measured on this project's machines; tests/test_parallel.py holds every ring
layout to the serial result).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _cpu_flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, scale=scale)  # [B, H, S, D]
    return out.transpose(1, 2), lse.float()  # [B, Sq, H, D], [B, H, Sq]


def _cuda_sdpa(q, k, v, scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qh, kh, vh, 0.0, False, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True, 0.0, False,
                                                                          scale=scale)[:2]
    return out.transpose(1, 2), lse[..., : q.shape[1]].float()  # lse may be padded along the sequence


def _flash_attn(q, k, v, scale):
    from flash_attn import flash_attn_func

    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    return out, lse.float()


def kernel_name(device: torch.device) -> str:
    if device.type == "cuda":
        return "flash-attn" if importlib.util.find_spec("flash_attn") else "sdpa"
    return "cpu-flash"


_KERNELS = {"flash-attn": _flash_attn, "sdpa": _cuda_sdpa, "cpu-flash": _cpu_flash}


def local_attention(device: torch.device) -> Kernel:
    """A kernel with the calling convention yunchang's ring passes to ``attn_processor``."""
    impl = _KERNELS[kernel_name(device)]

    def attend(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_unused):
        if causal or dropout_p:
            raise NotImplementedError("the local kernels are for non-causal inference attention without dropout")
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        return impl(q, k, v, scale)

    return attend

