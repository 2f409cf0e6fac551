"""The launcher's watch over its own ranks: a rank whose process is stopped, or hung on a file system, is named
and ended.

A rank stopped by SIGSTOP, Ctrl-Z or a debugger answers nothing, and neither the ranks nor torch's agent
can say which one it is: the others wait in a collective until it times out (half of --collective-timeout,
300 s at the defaults), and the agent's SIGTERM to the survivors lands on the stopped rank too, which then
"was killed by SIGTERM" when it resumes. The launcher sees it at once in the kernel's process state (``T``:
stopped, ``t``: stopped by a tracer): a rank stopped for half the heartbeat is recorded as the cause, with
its state, and killed, so the agent ends the backend with that rank named, well before any collective times
out (half the heartbeat never reaches half of --collective-timeout: options.py keeps 2 · heartbeat within
it). The next request restarts the backend, as after any rank's death.

A rank hung in a read (a network mount that stopped answering while a model loads: its first look at the file is
bounded on rank 0, file_kind.answered_within, but every rank's reads of the weights are the kernel's) sits in
state ``D``, uninterruptible I/O, and again nobody can say which rank or why. A slow disk shows ``D`` too, for
minutes while a large file loads, but its read counters, page faults or CPU time move (``io_counters``); a rank
in ``D`` whose counters have not moved for ``hung_after`` seconds (60, file_kind.FIRST_LOOK_S) is recorded as hung
on its file system and killed (a hung NFS read is killable: NFS waits in TASK_KILLABLE, which shows as ``D``).

Each rank writes its pid into ``paths.rank_pids`` when it starts (worker.py); a multi-node backend's launcher
on each node watches that node's ranks. Without /proc (not Linux) the watch sees nothing and stays quiet.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

STOPPED_STATES = {"T": "stopped: SIGSTOP, Ctrl-Z or a debugger", "t": "stopped by a tracer (a debugger)"}
IO_WAIT = "D"  # uninterruptible sleep: waiting on I/O
HUNG_AFTER_S = 60.0  # in I/O wait with no byte read or written for this long: hung (file_kind.FIRST_LOOK_S)


def record_pid(directory: Path, rank: int) -> None:
    """Called by each rank at start: its pid in ``directory/<rank>``, for the launcher's watch."""
    directory.mkdir(mode=0o700, exist_ok=True)
    (directory / str(rank)).write_text(str(os.getpid()))


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R, S, D, T, t, Z…); None when it is gone or unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]  # after "pid (command)": the command may hold spaces and ")"


def io_counters(pid: int) -> tuple[int, ...] | None:
    """What moves while ``pid`` makes progress: the characters and bytes it read and wrote (/proc/<pid>/io), its
    major page faults and its CPU time (/proc/<pid>/stat: a memory-mapped file read over NFS counts in neither
    byte count, but faults its pages in and copies them). None when unreadable."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    # after "pid (command)": state is field 3, majflt 12, utime 14, stime 15 (proc(5)), here 0, 9, 11, 12
    return (*(int(fields.get(name, 0)) for name in ("rchar", "wchar", "read_bytes", "write_bytes")),
            int(stat[9]), int(stat[11]), int(stat[12]))


class StoppedRankWatch:
    """A daemon thread that looks at every recorded rank's process state every ``interval`` seconds and,
    when one has stayed stopped for ``patience`` seconds, or in I/O wait without reading or writing a byte for
    ``hung_after`` seconds, records it (``cause``) and kills it."""

    def __init__(self, directory: Path, patience: float, hung_after: float = HUNG_AFTER_S):
        self.directory = directory
        self.patience = patience
        self.hung_after = hung_after
        self.interval = min(1.0, patience / 5)
        self.cause: dict | None = None  # {"rank", "pid", "what"}: the rank this watch ended
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xdit-stopped-rank-watch", daemon=True)

    def start(self) -> StoppedRankWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        self._thread.join()

    def _ranks(self) -> list[tuple[int, int]]:
        try:
            return [(int(path.name), int(path.read_text())) for path in self.directory.iterdir()]
        except (OSError, ValueError):  # not written yet, or being written
            return []

    def _run(self) -> None:
        stopped_since: dict[int, float] = {}  # pid → when this watch first saw it stopped
        waiting: dict[int, tuple[float, tuple]] = {}  # pid → (since when, its I/O counters then), in I/O wait
        while not self._done.wait(self.interval):
            now = time.monotonic()
            for rank, pid in self._ranks():
                state = process_state(pid)
                what = None
                if state in STOPPED_STATES:
                    since = stopped_since.setdefault(pid, now)
                    if now - since >= self.patience:
                        what = f"its process (pid {pid}) was {STOPPED_STATES[state]} for {now - since:.0f} s"
                else:
                    stopped_since.pop(pid, None)
                counters = io_counters(pid) if state == IO_WAIT else None
                if counters is None:
                    waiting.pop(pid, None)
                elif waiting.get(pid, (0.0, None))[1] != counters:
                    waiting[pid] = (now, counters)  # in I/O wait, and it moved since: progress
                elif now - waiting[pid][0] >= self.hung_after:
                    what = (f"its process (pid {pid}) waited on I/O for {now - waiting[pid][0]:.0f} s without reading "
                            "or writing a byte: its file system is not answering (a hung network mount?)")
                if what is not None:
                    self.cause = {"rank": rank, "pid": pid, "exitcode": -int(signal.SIGKILL),
                                  "timestamp": time.time(), "what": f"stopped answering: {what}, so the launcher "
                                                                    "killed it"}
                    try:
                        os.kill(pid, signal.SIGKILL)  # a stopped process, or one in a killable wait, dies at once
                    except ProcessLookupError:
                        pass
                    return
