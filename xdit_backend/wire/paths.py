"""Where a backend lives on disk: its socket, its private directory, its state file, log and token."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

SOCKET_ENV = "XDIT_SOCKET"
LAUNCHER_PID_ENV = "XDIT_LAUNCHER_PID"  # set by the launcher for its ranks: rank 0's status reports it


def inside_roots(path: str, roots) -> bool:
    """Whether ``path`` lies inside one of ``roots`` once every symlink and ``..`` is resolved (no
    traversal, no symlink escape); with no roots, every path does."""
    if not roots:
        return True
    real = Path(path).expanduser().resolve()
    return any(real.is_relative_to(Path(root).resolve()) for root in roots)


def default_socket() -> Path:
    """``$XDIT_SOCKET``, else ``$XDG_RUNTIME_DIR/comfyui-xdit/backend.sock``, else a per-user /tmp dir."""
    if os.environ.get(SOCKET_ENV):
        return Path(os.environ[SOCKET_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "comfyui-xdit" if runtime else Path(tempfile.gettempdir()) / f"comfyui-xdit-{os.getuid()}"
    return base / "backend.sock"


def resolve_socket(path: str | os.PathLike | None) -> Path:
    return Path(path).expanduser().absolute() if path else default_socket()


def state_file(socket_path: Path) -> Path:
    """The launcher's record of this backend: options, pid, status, failures."""
    return socket_path.with_name(socket_path.name + ".state.json")


def log_file(socket_path: Path) -> Path:
    """Where a background backend's output (launcher and every rank) goes."""
    return socket_path.with_name(socket_path.name + ".log")


def token_path(socket_path: Path) -> Path:
    """The TCP token's default file (``--token-file``)."""
    return socket_path.with_name(socket_path.name + ".token")


def rank_logs(socket_path: Path) -> Path:
    """The launcher's per-rank error files (torch.distributed.elastic writes them)."""
    return socket_path.with_name(socket_path.name + ".ranks")


def rank_pids(socket_path: Path) -> Path:
    """Where each rank records its pid when it starts, for the launcher's watch (launch/watch.py)."""
    return socket_path.with_name(socket_path.name + ".pids")


def nccl_trace_prefix(socket_path: Path) -> Path:
    """Where a rank's NCCL flight recorder dumps when a collective times out (the rank's number is
    appended). Beside the socket, not in rank_logs, which the next start clears."""
    return socket_path.with_name(socket_path.name + ".nccl_trace_rank_")


class UnsafeDirectoryError(Exception):
    pass


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` as 0700, or check that an existing one is ours and private."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise UnsafeDirectoryError(
            f"socket directory {directory} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}); "
            f"choose another place with --socket or ${SOCKET_ENV}"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UnsafeDirectoryError(
            f"socket directory {directory} has mode {stat.S_IMODE(info.st_mode):o}; other users could reach "
            f"the backend. Run `chmod 700 {directory}` or choose another place with --socket"
        )
