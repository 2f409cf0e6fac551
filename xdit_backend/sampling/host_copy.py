"""Host values onto the device without making the host wait for it.

The sampler loop computes on the host what depends on σ alone (the sigmas are host values), and
the per-step noise may be drawn with the CPU generator (noise.StepNoise). What of that must reach the device each step
(noise, uni_pc's solved coefficients) goes through ``to_device``: a blocking host→device copy
(``t.to("cuda")``) synchronises the stream, so the CPU stops queueing kernels until the GPU has run
out of work. A copy from pinned (page-locked) memory with ``non_blocking=True`` is queued on the
stream like a kernel, and PyTorch's pinned-memory allocator keeps the source alive until it has run.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``, copied asynchronously: through pinned memory on CUDA."""
    device = torch.device(device)
    if device.type == "cpu" or tensor.device.type != "cpu":
        return tensor.to(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
