"""What a model or LoRA path is, told before anything reads it: a FIFO, a device or a socket would block the
first read (rank 0's loop with it), and a symlink loop would surface as a RuntimeError from deep in pathlib.
A file system that does not answer at all (a hung network mount, a disk that will not wake) blocks even ``stat``:
``answered_within`` bounds the first look at a path, so rank 0's loop goes on and says why."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..errors import UserError

T = TypeVar("T")
FIRST_LOOK_S = 60.0  # how long the first look at a model path (stat, the file's header) may take


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


PICKLE_MAGICS = (b"PK\x03\x04", b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save's zip, pickles


def pickled(path: str) -> bool:
    """Whether ``path`` is a PyTorch pickle (``torch.save``'s zip archive, or an older raw pickle: a .ckpt, .pt,
    .pth or .bin), told from its first bytes."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    return any(head.startswith(magic) for magic in PICKLE_MAGICS)


def file_entries(entries, what: str, limit: int, example: dict, folder: str, names=()) -> list[tuple[str, float]]:
    """A request's list of files with strengths (LoRAs, model patches), checked: [{"path": str, "strength": number
    in -10..10 (1 when left out)}, …], at most ``limit``; each path a regular file (or one of ``names``, built-ins),
    returned resolved. ``what`` names an entry in the errors; ``folder`` is where ComfyUI keeps such files."""
    if not isinstance(entries, list) or len(entries) > limit:
        raise UserError(f"{what} entries must be a list of at most {limit} {{path, strength}} entries")
    checked = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"path", "strength"} or not isinstance(entry.get("path"), str):
            raise UserError(f"{what} entry {entry!r} must hold a path and, optionally, a strength", f"e.g. {example}")
        strength = entry.get("strength", 1.0)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not -10 <= strength <= 10:
            raise UserError(f"{what} strength {strength!r} must be a number in -10..10")
        if entry["path"] in names:
            checked.append((entry["path"], float(strength)))
            continue
        path = Path(entry["path"]).expanduser()
        odd = not_a_file(str(path))
        if odd:
            raise UserError(f"{what} {entry['path']} is {odd}, not a file that can be read",
                            f"give the path of a {what} file (.safetensors; ComfyUI keeps them in {folder})")
        if not path.is_file():
            built_in = f", or a built-in: {', '.join(names)}" if names else ""
            raise UserError(f"no {what} file at {entry['path']}", f"ComfyUI keeps them in {folder}{built_in}")
        checked.append((str(path.resolve()), float(strength)))
    return checked


_STILL_BLOCKED: dict[str, tuple[threading.Thread, float]] = {}  # what → its look still blocked, since when


def answered_within(seconds: float, look: Callable[[], T], what: str) -> T:
    """``look()`` (which reads the metadata or header of the files ``what`` names) on a thread of its own: its
    answer, its exception, or after ``seconds`` without either a UserError saying the file system did not
    answer. A thread blocked in the kernel cannot be stopped: it is a daemon thread, left blocked until the file
    system answers; while it is, the same ``what`` is refused at once (no wait, no second blocked thread)."""
    blocked = _STILL_BLOCKED.get(what)
    if blocked is not None and blocked[0].is_alive():
        raise _not_answering(what, time.monotonic() - blocked[1])
    answer: dict = {}

    def run() -> None:
        try:
            answer["value"] = look()
        except BaseException as exc:  # handed to the caller's thread as it is
            answer["error"] = exc

    thread = threading.Thread(target=run, name="xdit-first-look", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _STILL_BLOCKED[what] = (thread, started)
        raise _not_answering(what, seconds)
    _STILL_BLOCKED.pop(what, None)
    if "error" in answer:
        raise answer["error"]
    return answer["value"]


def _not_answering(what: str, seconds: float) -> UserError:
    return UserError(f"{what} did not answer within {seconds:.3g} s: its file system is not responding (a hung "
                     "network mount, a disk that does not wake up?)",
                     "check the mount (`ls` on the folder hangs the same way), or copy the model to a local disk")
