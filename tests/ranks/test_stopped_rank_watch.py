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


def test_a_process_in_io_wait_without_progress_is_named_as_hung_and_one_making_progress_is_left(tmp_path,
                                                                                                monkeypatch):
    """A hung network mount needs root to make; the kernel's view of one is what the watch reads: state D with
    I/O counters that do not move. Here /proc's answers for two real processes are those of a hung read (rank 0)
    and of a slow disk (rank 1: D too, but its counters move)."""
    from xdit_backend.launch import watch as watch_module

    hung, slow = _sleeper(), _sleeper()
    pids = tmp_path / "pids"
    for rank, process in enumerate((hung, slow)):
        _record(pids, rank, process)
    reads = {slow.pid: 0}

    def counters(pid):
        if pid == slow.pid:
            reads[pid] += 4096
            return (reads[pid], 0, reads[pid], 0, 0, 0, 0)
        return (100, 0, 100, 0, 7, 3, 1)

    monkeypatch.setattr(watch_module, "process_state", lambda pid: "D")
    monkeypatch.setattr(watch_module, "io_counters", counters)
    watch = StoppedRankWatch(pids, patience=30.0, hung_after=1.0).start()
    watch.interval = 0.1
    try:
        assert hung.wait(timeout=10) == -signal.SIGKILL
        assert watch.cause["rank"] == 0 and "waited on I/O for" in watch.cause["what"]
        assert "hung network mount" in watch.cause["what"]
        assert slow.poll() is None  # a slow disk: left reading
    finally:
        watch.close()
        for process in (hung, slow):
            process.kill()
            process.wait()
