"""What the person waiting on a model's first run is told while its weights are read: a line at each tenth of
them (rank 0's share: all its tensors, or its rows of a sharded model's, or its PipeFusion stage's), at most one a
second, so a load that takes a moment says nothing more and a slow one (a large file, a network mount) is never a
silent 0 %. Rank 0 reads as its peers do, at the same time, so its share stands for the whole backend's."""

from __future__ import annotations

import os
import time
from typing import Callable

from ..launch.status_text import human_bytes


INTERVAL_ENV = "XDIT_TEST_LOAD_NOTES_EVERY_S"  # tests only: a tiny model loads in less than the second


def interval_s() -> float:
    return float(os.environ.get(INTERVAL_ENV, "1.0"))


class LoadProgress:
    """``progress(done, total)`` for registry.build_source: ``say(text)`` at a new tenth of ``total``, once
    ``min_interval_s`` has passed since the last line (or since the load began)."""

    def __init__(self, say: Callable[[str], None], name: str, size_bytes: int | None = None,
                 min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.say = say
        self.name = name
        self.size_bytes = size_bytes  # the file's, where the model is one file: said as "x of y GB"
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.tenths_said = 0
        self.said_at = clock()

    def __call__(self, done: int, total: int) -> None:
        tenths = 10 * done // max(total, 1)
        now = self.clock()
        if tenths <= self.tenths_said or now - self.said_at < self.min_interval_s:
            return
        self.tenths_said, self.said_at = tenths, now
        read = (f" ({human_bytes(self.size_bytes * done / total)} of {human_bytes(self.size_bytes)})"
                if self.size_bytes else "")
        self.say(f"loading {self.name}: {100 * done // max(total, 1)} %{read}")
