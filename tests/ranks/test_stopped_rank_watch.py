"""The launcher's watch (launch/watch.py) on real processes: one stopped longer than its patience is named and
killed; one stopped briefly, or running, is left alone."""

import os
import signal
import subprocess
import time

from xdit_backend.launch.watch import StoppedRankWatch, process_state, record_pid


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"])


def _record(directory, rank: int, process: subprocess.Popen) -> None:
    directory.mkdir(exist_ok=True)
    (directory / str(rank)).write_text(str(process.pid))


def test_a_process_stopped_past_the_patience_is_named_and_killed_and_the_others_left(tmp_path):
    stopped, running, briefly = _sleeper(), _sleeper(), _sleeper()
    pids = tmp_path / "pids"
    for rank, process in enumerate((running, stopped, briefly)):
        _record(pids, rank, process)
    watch = StoppedRankWatch(pids, patience=1.0).start()
    try:
        stopped.send_signal(signal.SIGSTOP)
        briefly.send_signal(signal.SIGSTOP)
        time.sleep(0.3)
        briefly.send_signal(signal.SIGCONT)  # a short stop: under the patience
        started = time.monotonic()
        assert stopped.wait(timeout=10) == -signal.SIGKILL
        assert time.monotonic() - started < 5
        assert watch.cause["rank"] == 1 and watch.cause["pid"] == stopped.pid
        assert "was stopped: SIGSTOP, Ctrl-Z or a debugger" in watch.cause["what"]
        assert process_state(running.pid) in ("S", "R") and process_state(briefly.pid) in ("S", "R")
    finally:
        watch.close()
        for process in (stopped, running, briefly):
            process.kill()
            process.wait()
    assert process_state(stopped.pid) is None  # reaped: gone


def test_a_rank_records_its_own_pid(tmp_path):
    record_pid(tmp_path / "pids", 3)
    assert (tmp_path / "pids" / "3").read_text() == str(os.getpid())
