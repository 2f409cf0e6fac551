"""Starting, watching and stopping a backend: N ranks on torch.distributed.run (torchrun's engine).

``serve`` runs the elastic agent in this process, with every rank a child of one fork server that
imported the rank's modules (torch, torch.distributed, diffusers' transformer classes) once: a rank
starts in a fraction of a second with the imports shared copy-on-write, instead of each of N ranks
importing them again (about 7 s of CPU each, see RANK_PRELOAD). The fork server is a fresh process that
touches no GPU, so CUDA starts in each rank as before. The rendezvous is c10d on port 0, so the OS picks a
free port (never a fixed 29500).
The ranks' environment is built by worker_env.py from this process's (GPUs, allocator, NCCL, threads).
The launcher keeps a state file beside the socket (options, pid, status, and the ranks that
failed, with their messages), which is how ``start`` and the client can say which rank died.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from ..errors import EXIT_PEER_LOST, UsageError
from ..wire import endpoint, paths
from ..wire.protocol import Message
from .options import LaunchError, LaunchOptions, cuda_device_count  # noqa: F401  (what start and serve take and raise)
from .watch import StoppedRankWatch
from .worker_env import usable_cpus, worker_environment


def ensure_token(path: Path) -> str:
    """The TCP token in ``path``, created (32 random bytes, urlsafe, mode 0600) when missing."""
    import secrets

    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(32))
    return path.read_text().strip()


RANK_MODULE = "xdit_backend.service.worker"  # its main(argv) is a rank
# What every rank imports before its first request, imported once by the fork server the ranks are forked
# from (a module that fails to import there is skipped: the rank imports it itself). diffusers' transformer
# package imports all its model classes (~2.5 s of the ~5 s diffusers costs on top of torch's ~2 s).
RANK_PRELOAD = (RANK_MODULE, "diffusers.models.transformers")


def rank_main(argv: list[str]) -> None:
    """A rank: run in a child of the fork server (a module-level function, so it pickles by name)."""
    importlib.import_module(RANK_MODULE).main(argv)


def rank_preload(device: str) -> list[str]:
    """The modules the fork server imports for ranks on ``device``. On CUDA, diffusers is left to each rank:
    importing it asks ``torch.accelerator.is_available()`` (diffusers.utils.torch_utils sets ``torch_device`` at
    import), which on a CUDA build counts the GPUs and so starts CUDA's driver in the fork server, and no rank
    forked from it could use its GPU (seen on the first GPU run, torch 2.11 + diffusers 0.42.1). The ranks then
    import it in parallel, a few seconds of start on the many cores a GPU host has."""
    return list(RANK_PRELOAD) if device == "cpu" else [RANK_MODULE]


# --------------------------------------------------------------------------- state file


def read_state(socket_path: Path) -> dict | None:
    try:
        return json.loads(paths.state_file(socket_path).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _write_state(socket_path: Path, **state) -> None:
    target = paths.state_file(socket_path)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(target)


def failure_summary(state: dict | None) -> str | None:
    """One line naming the rank that failed first and what it said, from a launcher state."""
    if not state or state.get("status") != "failed" or not state.get("root_cause"):
        return None
    cause = state["root_cause"]
    return f"rank {cause['rank']} {cause['what']}"


def _root_cause(failures: list[dict]) -> dict:
    """The failure that explains the others.

    Effects rank last: a rank that only lost a peer (EXIT_PEER_LOST), and a rank ended by SIGTERM,
    which is how the agent stops the survivors once one rank has failed (it records them as failures
    too, with timestamps in whole seconds, so time alone cannot tell cause from effect).
    """

    def effect(failure: dict) -> int:
        return {EXIT_PEER_LOST: 2, -signal.SIGTERM: 1}.get(failure["exitcode"], 0)

    return min(failures, key=lambda f: (effect(f), f["timestamp"], f["rank"]))


def _describe_failure(rank: int, failure) -> dict:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    if "To enable traceback" in str(message):  # torchelastic's text when the rank wrote no error file
        message = "it failed before it could report why (see the log)"
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()} (pid {failure.pid})"
    elif failure.exitcode == EXIT_PEER_LOST:
        what = f"stopped after losing contact with another rank (pid {failure.pid})"
    else:
        what = f"exited with code {failure.exitcode} (pid {failure.pid})"
    if message and failure.exitcode >= 0:
        what += f": {message}"
    return {"rank": rank, "exitcode": failure.exitcode, "pid": failure.pid, "what": what,
            "timestamp": failure.timestamp}


# --------------------------------------------------------------------------- serve (foreground)


def serve(options: LaunchOptions) -> int:
    """Run the backend in the foreground until it is stopped or a rank fails; returns an exit code."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    options = options.resolved()
    sock = options.socket
    paths.ensure_private_dir(sock.parent)
    live = endpoint.answers(sock)
    if live is not None:
        raise LaunchError(f"a backend (pid {live['pid']}) already answers at {sock}; stop it with "
                          f"`xdit-backend stop --socket {sock}` or choose another --socket")
    _hand_down(_ranks_environment(options))  # before the fork server starts: it and every rank inherit this
    multiprocessing.set_forkserver_preload(rank_preload(options.device))
    start_fork_server()  # while this process runs one thread: the rendezvous' store and the watch add more
    if options.tcp:
        ensure_token(Path(options.token_file))  # resolved() named it
    rank_logs = paths.rank_logs(sock)
    shutil.rmtree(rank_logs, ignore_errors=True)
    shutil.rmtree(paths.rank_pids(sock), ignore_errors=True)
    state = {"pid": os.getpid(), "options": options.to_json(), "log": str(paths.log_file(sock)),
             "started": time.time()}
    _write_state(sock, status="starting", **state)

    # One node: c10d rendezvous on a port the OS picks. Several: torchrun's static rendezvous at
    # node 0's endpoint, where --node-rank fixes each node's ranks (node 0 gets global rank 0).
    several = options.nnodes > 1
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=options.nproc,
        run_id="xdit-multinode" if several else uuid.uuid4().hex,
        rdzv_backend="static" if several else "c10d",
        rdzv_endpoint=options.rdzv_endpoint if several else "127.0.0.1:0",  # port 0: the OS picks one
        rdzv_configs={"rank": options.node_rank} if several else {},
        max_restarts=0,  # a failed rank fails the backend; the client restarts it on the next request
        monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=str(rank_logs)),
        start_method="forkserver",  # the ranks fork from one process that imported RANK_PRELOAD
    )
    watch = StoppedRankWatch(paths.rank_pids(sock), patience=options.heartbeat / 2).start()
    try:
        elastic_launch(config, rank_main)(options.to_argv())  # each rank reads the same options
    except ChildFailedError as exc:
        failures = [_describe_failure(rank, f) for rank, f in sorted(exc.failures.items())]
        if watch.cause:  # the watch found this rank stopped and killed it: its SIGKILL says less
            failures = [watch.cause if f["rank"] == watch.cause["rank"] else f for f in failures]
        cause = watch.cause or _root_cause(failures)
        _write_state(sock, status="failed", failures=failures, root_cause=cause, **state)
        print(f"xdit-backend: rank {cause['rank']} {cause['what']}", file=sys.stderr)
        return 1
    except SignalException as exc:  # Ctrl-C or SIGTERM: the agent has stopped every rank
        _write_state(sock, status="stopped", signal=exc.sigval.name, **state)
        return 128 + int(exc.sigval)
    finally:
        watch.close()
        shutil.rmtree(paths.rank_pids(sock), ignore_errors=True)  # the ranks are gone: nothing to watch
        if sock.exists() and endpoint.answers(sock) is None:
            sock.unlink(missing_ok=True)
    _write_state(sock, status="stopped", **state)
    return 0


def start_fork_server() -> None:
    """Start multiprocessing's fork server, the process every rank is forked from, if it is not running.

    Here it is a new interpreter (an exec), which inherits no lock. ``serve`` starts it before this process
    runs a second thread, for the tests' zygote, which replaces this function with one that forks the fork
    server from this process instead (tests/zygote.py). A process forked while another thread holds a lock
    keeps that lock held forever: torch.distributed's store serves the rendezvous from threads that resolve
    the address of each rank that connects, and a rank forked from the launcher at such a moment waited
    forever in its first ``getaddrinfo`` on glibc's resolver lock (a 4-rank test backend that never became
    ready, CI of 302dccf)."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _ranks_environment(options: LaunchOptions) -> dict[str, str]:
    """Every rank's environment (worker_env.py), logged where it differs from this process's."""
    built = worker_environment(os.environ, options, cpu_count=usable_cpus(),
                               gpu_count=cuda_device_count() if options.device == "cuda" else 0)
    for note in built.notes:
        print(f"xdit-backend: {note}", file=sys.stderr)
    env = {**built.env, paths.LAUNCHER_PID_ENV: str(os.getpid())}
    decided = {name: value for name, value in env.items() if os.environ.get(name) != value}
    print("xdit-backend: set for the ranks: " + " ".join(f"{k}={v}" for k, v in sorted(decided.items())),
          file=sys.stderr)
    return env


def _hand_down(env: dict[str, str]) -> None:
    """Make ``env`` this process's environment: torch.distributed.elastic starts every rank with a
    copy of the agent's ``os.environ`` (plus RANK and the like), and this process runs only the agent."""
    os.environ.clear()
    os.environ.update(env)


# --------------------------------------------------------------------------- start / stop (background)


def start(options: LaunchOptions, timeout: float = 180.0, environment: dict[str, str] | None = None,
          spawn=None) -> dict:
    """Start ``serve`` in the background and return the backend's status once every rank is ready;
    ``environment``: variables added to this process's for the backend and its ranks; ``spawn(argv, env,
    log_path)``: what starts ``serve argv`` in a new session, a ``subprocess.Popen`` by default (the tests fork
    it from a process that has imported everything, tests/zygote.py); it returns what has ``pid`` and ``poll()``."""
    options = options.resolved()
    sock = options.socket
    paths.ensure_private_dir(sock.parent)
    live = endpoint.answers(sock)
    if live is not None:
        raise UsageError(f"a backend (pid {live['pid']}) already answers at {sock}",
                         "use it as it is (`xdit-backend status`), or stop it first (`xdit-backend stop`) to start "
                         "one with other flags")
    log_path = paths.log_file(sock)
    paths.state_file(sock).unlink(missing_ok=True)
    process = (spawn or _spawn_serve)(options.to_argv(), {**os.environ, **(environment or {})}, log_path)
    if options.node_rank > 0:  # the socket and the queue live on node 0: this node only runs its ranks
        time.sleep(1.0)
        if process.poll() is not None:
            raise LaunchError(f"node {options.node_rank} failed to start: {_last_line(log_path)} (log: {log_path})")
        return {"pid": process.pid, "node_rank": options.node_rank, "log": str(log_path),
                "waiting_for": f"node 0 at {options.rdzv_endpoint}; its socket serves the whole backend"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if endpoint.answers(sock) is not None:
            return endpoint.ask(sock, Message("status")).fields["status"]
        exit_code = process.poll()
        if exit_code is not None:
            summary = failure_summary(read_state(sock)) or _last_line(log_path) or (
                f"the launcher exited with code {exit_code}")
            raised = _last_exception(log_path)
            detail = f"; the log ends with: {raised}" if raised and raised not in summary else ""
            raise LaunchError(f"the backend failed to start: {summary}{detail} (log: {log_path})")
        time.sleep(0.1)
    _terminate_group(process.pid)
    raise LaunchError(f"the backend did not become ready within {timeout:.0f} s (log: {log_path})")


def _spawn_serve(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "xdit_backend.cli", "serve", *argv],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # its own process group: `stop` can end it and every rank together
        )


def _last_exception(log_path: Path) -> str:
    """The last 'SomethingError: …' line a rank printed, if any."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    found = [line.strip() for line in lines if re.match(r"^\w*(Error|Exception): ", line.strip())]
    return found[-1] if found else ""


def _last_line(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return ""
    return lines[-1] if lines else ""


def stop(socket_path: Path, timeout: float = 30.0) -> bool:
    """Ask the backend to shut down, wait for its launcher to exit; returns False if none was running."""
    state = read_state(socket_path) or {}
    pid = state.get("pid")
    try:
        endpoint.ask(socket_path, Message("shutdown"), timeout=60.0)
        asked = True
    except (endpoint.BackendError, OSError):
        asked = False
    if pid is None or not _alive(pid):
        return asked
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        _terminate_group(pid)
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of this process counts as gone
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


def _terminate_group(pid: int, grace: float = 10.0) -> None:
    """SIGTERM the launcher's process group (it and its ranks), then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)  # started by `start`: the launcher leads its own process group
        except ProcessLookupError:
            try:
                os.kill(pid, sig)  # a foreground `serve` in someone's terminal: just the launcher
            except ProcessLookupError:
                return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):
            return
