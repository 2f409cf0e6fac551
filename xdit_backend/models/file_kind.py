"""What a model or LoRA path is, told before anything reads it: a FIFO, a device or a socket would block the
first read (rank 0's loop with it), and a symlink loop would surface as a RuntimeError from deep in pathlib."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def not_a_file(path: str) -> str | None:
    """What ``path`` is when it is neither a regular file nor a folder, told without opening it (``stat`` does not
    block on a FIFO): "a symlink loop", "a FIFO (named pipe)", "a socket", "a device"; None otherwise (a missing
    path too: whoever reads it says so)."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return "a symlink loop" if exc.errno == errno.ELOOP else f"unreadable ({exc.strerror})"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    return "a socket" if stat.S_ISSOCK(mode) else "a device"
