"""Where a test run's CPU time goes: run a command (by default the README's test command) while sampling
/proc twice a second, then print the CPU seconds of every Python process it started, by kind (pytest
workers, backend launchers, ranks, spawned gloo ranks, CLI calls) and by the test that started it.

On the 2-core CI machine the suite is CPU-bound (the sum of these figures over 2 is the wall time), so
this, not --durations (wall times inflated by whatever else runs), says which tests cost the most.

    python tools/suite_cpu.py                      # python -m pytest
    python tools/suite_cpu.py -- python -m pytest tests/backend -q
    python tools/suite_cpu.py --json /tmp/cpu.json   # also every process: kind, test, CPU seconds

A process's figure is its last sample, so up to half a second of a short-lived process is missed.
"""

import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (  # (kind, a fragment of its command line), first match wins
    ("rank", "service.worker"), ("launcher", "cli serve"),
    ("zygote: its backends", "zygote.py"),  # tests/zygote.py and the launchers and ranks it forked  # a rank: the fork server that preloads the worker, or a child
    ("spawned gloo rank", "multiprocessing"), ("selftest", "cli selftest"), ("CLI call", " cli "),
    ("pytest worker", "execnet"), ("pytest worker", "exec(eval("), ("pytest", "pytest"),
)


def kind_of(command: str) -> str:
    return next((kind for kind, fragment in KINDS if fragment in command), "other")


def sample(root: int, seen: dict, done: threading.Event) -> None:
    """Every 0.5 s: pid → [command, test that started it, CPU seconds] for each Python process descended
    from ``root`` (other processes on the machine are left out)."""
    tracked = {str(root)}
    while not done.is_set():
        for pid in sorted(filter(str.isdigit, os.listdir("/proc")), key=int):  # parents before children, mostly
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if pid not in tracked and fields[1] not in tracked:  # fields[1]: the parent's pid
                    continue
                tracked.add(pid)
                cpu = (int(fields[11]) + int(fields[12])) / TICK  # utime + stime
                if pid not in seen:
                    command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    test = next((e.split(b"=", 1)[1].decode(errors="replace") for e in environ
                                 if e.startswith(b"PYTEST_CURRENT_TEST=")), "")
                    seen[pid] = [command.replace(" -m xdit_backend.cli", " cli"), test.split(" (")[0]] \
                        if "python" in command else None
                if seen[pid] is not None:
                    seen[pid][2:] = [cpu]
            except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
                pass
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else [sys.executable, "-m", "pytest"]
    dump = argv[argv.index("--json") + 1] if "--json" in argv[:argv.index("--") if "--" in argv else None] else None
    seen, done = {}, threading.Event()
    began = time.monotonic()
    run = subprocess.Popen(command)
    sampler = threading.Thread(target=sample, args=(run.pid, seen, done), daemon=True)
    sampler.start()
    code = run.wait()
    wall = time.monotonic() - began
    done.set()
    sampler.join()
    processes = [p for p in seen.values() if p is not None and len(p) == 3]
    by_kind, count, by_file = collections.Counter(), collections.Counter(), collections.Counter()
    for command_line, test, cpu in processes:
        kind = kind_of(command_line)
        by_kind[kind] += cpu
        count[kind] += 1
        if kind not in ("pytest worker", "pytest"):
            by_file[test.split("::")[0] or "(no test)"] += cpu
    total = sum(by_kind.values())
    print(f"\n{wall:.0f} s wall, {total:.0f} s of CPU in {len(processes)} Python processes "
          f"({total / wall:.2f} cores busy on average)")
    for kind, cpu in by_kind.most_common():
        print(f"  {cpu:8.1f} s  {count[kind]:4d} × {kind}")
    print("CPU of the processes each test file started (a shared backend counts for the file that started it):")
    for name, cpu in by_file.most_common(25):
        print(f"  {cpu:8.1f} s  {name}")
    if dump:
        Path(dump).write_text(json.dumps([{"kind": kind_of(c), "test": t, "cpu": cpu, "command": c}
                                          for c, t, cpu in processes], indent=0))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
