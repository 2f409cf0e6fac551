"""The launcher's watch over its own ranks: a rank whose process is stopped is named and ended.

A rank stopped by SIGSTOP, Ctrl-Z or a debugger answers nothing, and neither the ranks nor torch's agent
can say which one it is: the others wait in a collective until it times out (half of --collective-timeout,
300 s at the defaults), and the agent's SIGTERM to the survivors lands on the stopped rank too, which then
"was killed by SIGTERM" when it resumes. The launcher sees it at once in the kernel's process state (``T``:
stopped, ``t``: stopped by a tracer): a rank stopped for half the heartbeat is recorded as the cause, with
its state, and killed, so the agent ends the backend with that rank named, well before any collective times
out (half the heartbeat never reaches half of --collective-timeout: options.py keeps 2 · heartbeat within
it). The next request restarts the backend, as after any rank's death.

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


class StoppedRankWatch:
    """A daemon thread that looks at every recorded rank's process state every ``interval`` seconds and,
    when one has stayed stopped for ``patience`` seconds, records it (``cause``) and kills it."""

    def __init__(self, directory: Path, patience: float):
        self.directory = directory
        self.patience = patience
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
        while not self._done.wait(self.interval):
            now = time.monotonic()
            for rank, pid in self._ranks():
                state = process_state(pid)
                if state not in STOPPED_STATES:
                    stopped_since.pop(pid, None)
                    continue
                since = stopped_since.setdefault(pid, now)
                if now - since >= self.patience:
                    self.cause = {"rank": rank, "pid": pid, "exitcode": -int(signal.SIGKILL),
                                  "timestamp": time.time(),
                                  "what": f"stopped answering: its process (pid {pid}) was {STOPPED_STATES[state]} "
                                          f"for {now - since:.0f} s, so the launcher killed it"}
                    try:
                        os.kill(pid, signal.SIGKILL)  # a stopped process dies of SIGKILL at once
                    except ProcessLookupError:
                        pass
                    return
