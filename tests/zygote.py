"""A process that has imported what a backend imports and forks the tests' backends from itself.

A backend started as users start one (``xdit-backend start``) spends ~15 CPU-s before it serves: its launcher
imports torch and torch.distributed.elastic (~4 s), its fork server torch, the worker and diffusers' transformer
package (~11 s). On the 2-core CI machine, 30-odd such starts were a third of the suite. Each pytest worker
starts one zygote instead, when its first test asks for a backend: the zygote imports all that once, and for each
backend forks a launcher (``launcher.serve``, in a new session, its output in the backend's log). The launcher's
fork server, which forks the ranks, is in turn a fork of the launcher, taken before the launcher runs a second
thread (``_fork_the_fork_server``). Ranks were once forked from the launcher itself, which by then runs
torch.distributed's store threads: one 4-rank backend in a few dozen never became ready, its last rank waiting
forever on a resolver lock it had inherited held (launcher.start_fork_server). What a rank runs is what it runs
under a user's fork server.

The way users start a backend stays under test: ``Backends.start(..., fresh=True)``, the CLI's ``start`` in
test_lifecycle, the selftest, the multi-node tests and the ComfyUI host tests all start fresh processes.

Two settings torch reads once, when it is imported, are applied again in each rank from the environment the
launcher built for it (worker_env.py): the intra-op threads (``OMP_NUM_THREADS``) and Inductor's compile workers
(``TORCHINDUCTOR_COMPILE_THREADS``). A rank's ``/proc/PID/environ`` is the zygote's (the environment a process
was executed with), not the one it runs with.

Protocol: a Unix socket, one JSON request and one JSON answer per connection:
``{"spawn": [argv, env, log_path]}`` → ``{"pid": n}``; ``{"poll": pid}`` → ``{"exit": code or null}``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class Zygote:
    """The client side: starts the zygote on first use, asks it to fork launchers, stops it."""

    def __init__(self):
        self.socket_path: Path | None = None
        self.process: subprocess.Popen | None = None

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> Forked:
        """``launcher.start``'s ``spawn``: ``serve argv`` with ``env``, its output appended to ``log_path``."""
        self._ensure_running()
        return Forked(self, self._ask({"spawn": [argv, env, str(log_path)]})["pid"])

    def exit_code(self, pid: int) -> int | None:
        return self._ask({"poll": pid})["exit"]

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
            shutil.rmtree(self.socket_path.parent, ignore_errors=True)

    def _ensure_running(self, timeout: float = 120.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        self.stop()
        self.socket_path = Path(tempfile.mkdtemp(prefix="xdit-zygote-", dir="/tmp")) / "zygote.sock"
        log = open(self.socket_path.with_suffix(".log"), "ab")
        self.process = subprocess.Popen([sys.executable, __file__, str(self.socket_path)], stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while not self.socket_path.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the tests' zygote did not start (log: {self.socket_path.with_suffix('.log')})")
            time.sleep(0.05)

    def _ask(self, request: dict) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(self.socket_path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            return json.loads(conn.makefile("rb").readline())


class Forked:
    """A launcher the zygote forked: what ``launcher.start`` reads of a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)


# --------------------------------------------------------------------------- the zygote process


def main(socket_path: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs  # noqa: F401  (what serve imports)
    from torch.distributed.launcher.api import elastic_launch  # noqa: F401

    from xdit_backend import cli  # noqa: F401  (the launcher's options and parser)
    from xdit_backend.launch import launcher

    for name in launcher.rank_preload("cpu"):  # the zygote serves CPU backends only
        importlib.import_module(name)
    exits: dict[int, int] = {}

    def reap(*_) -> None:  # at once, so that a launcher that ended is gone for launcher.stop's liveness check
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            exits[pid] = os.waitstatus_to_exitcode(status)

    signal.signal(signal.SIGCHLD, reap)
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path + ".part")
    os.rename(socket_path + ".part", socket_path)  # the socket appears ready
    server.listen()
    server.settimeout(1.0)
    while os.getppid() == parent:  # the pytest worker that started it is alive
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(None)
            request = json.loads(conn.makefile("rb").readline())
            if "spawn" in request:
                answer = {"pid": _fork_launcher(*request["spawn"], server)}
            else:
                answer = {"exit": exits.get(request["poll"])}
            conn.sendall(json.dumps(answer).encode() + b"\n")


def _fork_launcher(argv: list[str], env: dict[str, str], log_path: str, server: socket.socket) -> int:
    def launcher() -> int:
        server.close()
        os.setsid()  # its own process group, as `start` gives a launcher: `stop` ends it and its ranks together
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its agent waits for its own ranks
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(env)
        return _serve(argv)

    return _fork(launcher)


def _fork(child: Callable[[], int]) -> int:
    """A fork of this process that runs ``child()`` and exits with the code it returns (1, with the traceback, if it
    raises); its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = child()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(argv: list[str]) -> int:
    """``xdit-backend serve argv``, its fork server forked from this process."""
    from xdit_backend import cli
    from xdit_backend.launch import launcher
    from xdit_backend.launch.options import LaunchError, LaunchOptions

    launcher.rank_main = _rank_main  # what serve hands the agent
    launcher.start_fork_server = _fork_the_fork_server
    try:
        return launcher.serve(LaunchOptions.from_args(cli.build_parser().parse_args(["serve", *argv])))
    except LaunchError as exc:
        print(f"xdit-backend: {exc}", file=sys.stderr)
        return 1


def _rank_main(argv: list[str]) -> None:
    """A rank (module-level: the agent pickles it for the fork server by name, ``__main__._rank_main``)."""
    from xdit_backend.launch import launcher

    _threads_from_environment()
    importlib.import_module(launcher.RANK_MODULE).main(argv)


def _fork_the_fork_server() -> None:
    """``launcher.start_fork_server``, with the fork server a fork of this launcher instead of a new interpreter
    that would import torch, the worker and diffusers again. It must be forked while this process runs one thread:
    a fork taken while another thread holds a lock keeps it held (launcher.start_fork_server)."""
    from multiprocessing import forkserver, util

    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise RuntimeError(f"the launcher runs {threads} threads where it forks the ranks' fork server; it must run "
                           "one (launcher.serve starts the fork server before its rendezvous)")
    spawn = util.spawnv_passfds
    util.spawnv_passfds = _fork_and_run
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn


def _fork_and_run(path: str, args: list[str], passfds: list[int]) -> int:
    """``multiprocessing.util.spawnv_passfds`` (``path args`` with only stdio and ``passfds`` open), run in a fork
    of this process: ``args`` end with ``-c CODE`` (the fork server's main, or the resource tracker's)."""
    code = args[args.index("-c") + 1]

    def run() -> int:
        keep = sorted({0, 1, 2, *passfds})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)  # as the exec would: the launcher's ends of these pipes above all
        try:
            exec(compile(code, "<fork server>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:  # how the fork server ends once the launcher is gone
            return exc.code if isinstance(exc.code, int) else 0
        return 0

    return _fork(run)


def _threads_from_environment() -> None:
    """What torch read from the environment when the zygote imported it, read again from the rank's."""
    import torch
    import torch._inductor.config

    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS"):
        torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])


if __name__ == "__main__":
    main(sys.argv[1])
