"""Step ends on the device's own clock: CUDA events on a GPU (recorded in the stream and read once
at the end, so timing adds no synchronisation inside the loop), wall time on the CPU. Used by the
backend's ``profile`` records (executor.py), ``bench overhead`` and the selftest."""

from __future__ import annotations

import time

import torch


class StepClock:
    """Step ends: CUDA events on a GPU (read once at the end), wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            self.marks.append(torch.cuda.Event(enable_timing=True))
            self.marks[-1].record()
        else:
            self.marks.append(time.perf_counter())

    def steps(self) -> list[float]:
        """Seconds between consecutive marks (on CUDA, read once the device has run them)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]
