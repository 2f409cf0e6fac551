"""The device a rank computes on: the dtype it computes in, how much memory it has and what this rank
holds of it, in bytes.

GPU: ``torch.cuda.mem_get_info`` (the driver's free and total: other processes, ComfyUI's included,
count) and the caching allocator's allocated and peak bytes. CPU: the machine's MemTotal and
MemAvailable from /proc/meminfo (what can be allocated without swapping), this process's resident
set as allocated, and its peak resident set.
"""

from __future__ import annotations

import os
import resource

import torch

from . import schema

DTYPES = {name: getattr(torch, name) for name in schema.DTYPE_NAMES if name != "auto"}  # float32 → torch.float32, …


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype weights are held and computed in. "auto": float32 on the CPU; on CUDA bfloat16 where
    the GPU computes in it natively (sm 8.0 and newer), else float16 (a V100 or T4 only emulates
    bfloat16, and its fused attention kernels have none)."""
    if name != "auto":
        return DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


MEMINFO = "/proc/meminfo"


def free_and_total(device: torch.device) -> tuple[int, int]:
    """(bytes free, bytes total) on ``device``."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    info = _meminfo()
    return info["MemAvailable"], info["MemTotal"]


def allocated_and_peak(device: torch.device) -> tuple[int, int]:
    """(bytes this process holds now, the most it has held) on ``device``."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    with open("/proc/self/statm") as statm:  # in pages: size, resident, …
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB, updated lazily
    return resident, max(resident, peak)


def snapshot(device: torch.device, parameters: int) -> dict:
    """This rank's ``memory`` in ``status``; ``parameters``: the bytes its loaded models' weights,
    buffers and LoRAs hold (executor.held_bytes)."""
    free, total = free_and_total(device)
    allocated, peak = allocated_and_peak(device)
    return {"total": total, "free": free, "allocated": allocated, "peak": peak, "parameters": parameters}


def _meminfo() -> dict[str, int]:
    """/proc/meminfo's fields in bytes (its ``kB`` are KiB)."""
    fields = {}
    with open(MEMINFO) as meminfo:
        for line in meminfo:
            name, _, value = line.partition(":")
            parts = value.split()
            fields[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields
