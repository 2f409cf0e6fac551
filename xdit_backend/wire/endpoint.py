"""A backend's socket seen from outside: connect, make one call, tell whether anything answers.

The errors a backend reports live here too. The client builds on this module and the launcher
uses it to probe, ask and stop a backend, so neither of those two imports the other.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Callable
from pathlib import Path

from . import protocol
from .protocol import Connection, Message

PROBE_TIMEOUT_S = 5.0  # how long connecting, or waiting for a probe's hello, may take


class BackendError(Exception):
    """An error reported by (or about) the backend: ``kind``, ``message``, ``hint``, ``rank``."""

    def __init__(self, kind: str, message: str, hint: str = "", rank: int | None = None, traceback: str = "",
                 node_hint: str = ""):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.hint = hint
        self.node_hint = node_hint  # the fix in the ComfyUI nodes' words, where it differs (errors.UserError)
        self.rank = rank
        self.traceback = traceback

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message

    @classmethod
    def from_message(cls, reply: Message) -> BackendError:
        f = reply.fields
        kind = f.get("kind", "error")
        error_cls = {"cancelled": Cancelled}.get(kind, cls)
        return error_cls(kind, f.get("message", ""), f.get("hint", ""), f.get("rank"), f.get("traceback", ""),
                         f.get("node_hint", ""))


class NoBackend(BackendError):
    """Nothing answers at the socket."""


class BackendDied(BackendError):
    """The backend went away during a request (a rank died or lost its peers)."""


class Cancelled(BackendError):
    """The request was cancelled; its partial result was dropped."""


def connect(socket_path: Path, timeout: float = PROBE_TIMEOUT_S) -> Connection:
    """A connection to the backend's Unix socket; NoBackend when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(socket_path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise NoBackend("no_backend", f"no backend answers at {socket_path} ({exc.strerror})",
                        "start one with `xdit-backend start`, or let the client start it (auto_start)") from None
    except OSError:
        sock.close()
        raise
    return Connection(sock, direction="reply")


def exchange(conn: Connection, message: Message, timeout: float, where: Path) -> Message:
    """Send one request on ``conn`` and return its one reply (BackendError for an error reply);
    the connection is closed after."""
    message.fields.setdefault("id", uuid.uuid4().hex)
    try:
        conn.send(message)
        reply = conn.receive(idle_timeout=timeout)
    except (protocol.ConnectionClosed, protocol.FrameError, OSError) as exc:
        raise BackendError("connection", f"the backend at {where} stopped answering ({exc})",
                           "check `xdit-backend status`; the log is next to the socket",
                           node_hint="queue again (a backend that died is started again; the xDiT Backend node's "
                                     "status action shows it); its log is next to the socket") from None
    finally:
        conn.close()
    if reply.type == "error":
        raise BackendError.from_message(reply)
    return reply


def ask(socket_path: Path, message: Message, timeout: float = 60.0) -> Message:
    """One call to the backend at ``socket_path`` (which must be running)."""
    return exchange(connect(socket_path), message, timeout, socket_path)


def hello_or_none(open_connection: Callable[[], Connection], timeout: float = PROBE_TIMEOUT_S) -> dict | None:
    """The backend's hello, or None when nothing (or nothing sane) answers; never starts one."""
    try:
        conn = open_connection()
    except (NoBackend, OSError):
        return None
    try:
        conn.send(Message("hello", {"id": "probe", "client": "xdit_backend.client"}))
        reply = conn.receive(idle_timeout=timeout)
        return reply.fields if reply.type == "hello" else None
    except (protocol.ConnectionClosed, protocol.FrameError, OSError):
        return None
    finally:
        conn.close()


def answers(socket_path: Path) -> dict | None:
    """The hello of the backend at ``socket_path``, or None when none answers there."""
    return hello_or_none(lambda: connect(socket_path))
