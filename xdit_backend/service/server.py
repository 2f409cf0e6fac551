"""Rank 0's socket server: connections, the request queue, cancellation and replies.

One thread accepts connections and one thread reads each connection. Requests that need the
ranks (``sample``, ``unload``, ``shutdown``) are queued and executed one at a time, in order, by
rank 0's main thread (leader.Leader). Everything else (``hello``, ``status``, ``echo``,
``cancel``) is answered by the connection's own thread at once, even while a sample runs.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..wire import protocol
from ..wire.protocol import Connection, FrameError, Message, error_message

log = logging.getLogger("xdit_backend.service.server")

QUEUED_TYPES = ("sample", "evaluate", "unload", "shutdown")
MAX_CONNECTIONS = 64
_REFUSAL_DRAIN_S = 1.0  # how long a refused peer may go on sending before its socket is closed


class Job:
    """One queued request and the connection its replies go to."""

    def __init__(self, message: Message, conn: Connection):
        self.message = message
        self.conn = conn
        self.cancel_reason = ""
        self._cancelled = threading.Event()
        self.started = time.monotonic()
        self.arrival = -1  # its place in the order requests were queued (set by the server)
        self.execution = -1  # its place in the order they were run

    @property
    def id(self) -> str:
        return self.message.id

    @property
    def type(self) -> str:
        return self.message.type

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str) -> None:
        if not self._cancelled.is_set():
            self.cancel_reason = reason
            self._cancelled.set()

    def reply(self, message: Message) -> None:
        message.fields["id"] = self.id
        try:
            self.conn.send(message)
        except OSError:
            self.cancel("the client disconnected")

    def fail(self, kind: str, message: str, hint: str = "", **extra) -> None:
        self.reply(error_message(kind, message, hint, **extra))

    def note(self, text: str) -> None:
        """A line for the person waiting, before the steps start: a model to load, blocks to compile."""
        self.reply(Message("note", {"text": text}))

    def progress(self, step: int, total: int) -> None:
        self.reply(Message("progress", {"step": step, "total": total, "elapsed_s": time.monotonic() - self.started}))


class SocketServer:
    """Listens on a Unix socket that only its owner can reach, and feeds a FIFO of jobs."""

    def __init__(self, path: Path, status: Callable[[], dict], limits: protocol.Limits = protocol.DEFAULT_LIMITS,
                 tcp: tuple[str, int] | None = None, token: str | None = None):
        self.path = path
        self.tcp = tcp  # (loopback host, port): a second listener whose clients must send the token first
        self.token = token
        self.status = status
        self.limits = limits
        self._queue: collections.deque[Job] = collections.deque()
        self._ready = threading.Condition()
        self._jobs: dict[str, Job] = {}  # queued and running, by request id
        self._running: Job | None = None
        self._arrived = self._executed = 0  # requests queued and started so far: the FIFO, on record
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._listener: socket.socket | None = None
        self._tcp_listener: socket.socket | None = None
        self.shutting_down = ""  # why new requests are refused, once the backend is going away

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        if self.path.exists():
            self.path.unlink()  # a stale socket of a backend that died (the launcher checked none answers)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is created 0600
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept_loop, args=(listener, False), name="xdit-accept", daemon=True).start()
        if self.tcp:
            host, port = self.tcp
            tcp = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
            self._tcp_listener = tcp
            threading.Thread(target=self._accept_loop, args=(tcp, True), name="xdit-accept-tcp", daemon=True).start()

    def close(self) -> None:
        if self._tcp_listener is not None:
            self._tcp_listener.close()
            self._tcp_listener = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ the queue, for rank 0's main thread

    def next_job(self, timeout: float) -> Job | None:
        """The oldest queued job (now running), or None after ``timeout`` seconds without one."""
        with self._ready:
            if not self._queue:
                self._ready.wait(timeout)
            if not self._queue:
                return None
            job = self._queue.popleft()
            job.execution = self._executed
            self._executed += 1
            self._running = job
            return job

    def finish(self, job: Job) -> None:
        with self._ready:
            self._jobs.pop(job.id, None)
            if self._running is job:
                self._running = None

    def queue_state(self) -> dict:
        with self._ready:
            return {"queued": len(self._queue), "running": self._running.id if self._running else None}

    def refuse_new(self, why: str) -> None:
        """From now on every new request is answered with ``why`` (the backend is going away)."""
        with self._ready:
            self.shutting_down = why

    def refuse_new_if_idle(self, why: str) -> bool:
        """``refuse_new(why)`` and True, unless a request is queued: one that arrived after rank 0 stopped
        waiting for a job and before it decided to stop. Then nothing changes and False: it is served."""
        with self._ready:
            if self._queue:
                return False
            self.shutting_down = why
            return True

    def fail_all(self, kind: str, message: str, hint: str = "", *, spare: Job | None = None, **extra) -> None:
        """Answer every queued and running job but ``spare`` with the same error (the backend is going away)."""
        with self._ready:
            jobs = [job for job in self._jobs.values() if job is not spare]
            self._queue.clear()
            self._jobs.clear()
        for job in jobs:
            job.cancel(message)
            job.fail(kind, message, hint, **extra)

    def _enqueue(self, job: Job) -> str | None:
        with self._ready:
            if self.shutting_down:
                return self.shutting_down
            if not job.id:
                return f"a {job.type!r} request needs an 'id'"
            if job.id in self._jobs:
                return f"request id {job.id!r} is already queued or running"
            self._jobs[job.id] = job
            job.arrival = self._arrived
            self._arrived += 1
            if job.type == "shutdown":
                self.shutting_down = "the backend is shutting down"
                self._queue.appendleft(job)
            else:
                self._queue.append(job)
            self._ready.notify()
        return None

    def _cancel(self, target: str, reason: str) -> bool:
        with self._ready:
            job = self._jobs.get(target)
            if job is None or job.type == "shutdown":
                return False
            if job in self._queue:
                self._queue.remove(job)
                self._jobs.pop(target, None)
                queued = True
            else:
                queued = False
        job.cancel(reason)
        if queued:  # never started: answer now; a running job is answered by the main thread
            job.fail("cancelled", f"request {target} was cancelled before it started ({reason})")
        return True

    # ------------------------------------------------------------------ connections

    def _accept_loop(self, listener: socket.socket, tcp: bool) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                self._refuse(sock, "busy", f"more than {MAX_CONNECTIONS} connections are open", "retry later")
                continue
            threading.Thread(target=self._serve_connection, args=(sock, tcp), name="xdit-conn", daemon=True).start()

    def _refuse(self, sock: socket.socket, kind: str, message: str, hint: str) -> None:
        """Send the refusal, then read what the peer is still sending before closing.

        Closing at once races the peer's first send: it meets a closed socket (a broken pipe) and never
        reads the reason. Half-closing and draining for a moment lets its send land and its read see the reply.
        """
        conn = Connection(sock, self.limits, direction="request")
        try:
            conn.send(error_message(kind, message, hint))
            sock.shutdown(socket.SHUT_WR)
            _drain(sock, seconds=_REFUSAL_DRAIN_S, max_bytes=self.limits.max_header_bytes)
        except OSError:
            pass
        conn.close()

    def _serve_connection(self, sock: socket.socket, tcp: bool = False) -> None:
        conn = Connection(sock, self.limits, direction="request")
        mine: list[Job] = []
        try:
            if tcp:
                if not self._token_given(conn):
                    return
            else:
                uid = _peer_uid(sock)
                if uid != os.getuid():
                    self._refuse(sock, "forbidden", f"uid {uid} may not use this backend", "run the client as its owner")
                    return
            while True:
                try:
                    message = conn.receive(idle_timeout=self.limits.idle_timeout_s)
                except TimeoutError:
                    if any(job.id in self._jobs for job in mine):
                        continue  # its request is queued or running: the client waits for replies
                    return  # idle, with nothing of its own in flight: free the connection
                except protocol.ConnectionClosed:
                    return
                except FrameError as exc:
                    conn.send(error_message(exc.kind, exc.message, exc.hint, node_hint=exc.node_hint))
                    if exc.fatal:
                        return
                    continue
                self._dispatch(message, conn, mine)
        except OSError:
            return  # the peer went away mid-frame or mid-reply
        except Exception as exc:
            log.exception("connection handler failed")
            try:
                conn.send(error_message("internal", f"{type(exc).__name__}: {exc}", "see the backend log"))
            except OSError:
                pass
        finally:
            for job in mine:
                self._cancel(job.id, "the client disconnected")
            conn.close()
            self._connections.release()

    def _token_given(self, conn: Connection) -> bool:
        """Over TCP the first frame must be a hello carrying the token (compared in constant time)."""
        try:
            message = conn.receive(idle_timeout=protocol.DEFAULT_LIMITS.frame_timeout_s)
        except (protocol.ConnectionClosed, FrameError, OSError):
            message = None
        given = message.fields.get("token", "") if message is not None and message.type == "hello" else ""
        if not (self.token and hmac.compare_digest(given.encode(), self.token.encode())):
            self._refuse(conn.sock, "forbidden", "a TCP client must first send hello with the backend's token",
                         "read the token from the file the backend was started with (--token-file)")
            return False
        self._dispatch(message, conn, [])
        return True

    def _dispatch(self, message: Message, conn: Connection, mine: list[Job]) -> None:
        reply_id = {"id": message.id}
        if message.type == "hello":
            status = self.status()
            conn.send(Message("hello", {**reply_id, "protocol": protocol.PROTOCOL_VERSION,
                                        "world_size": status["world_size"], "pid": status["pid"]}))
        elif message.type == "status":
            conn.send(Message("status", {**reply_id, "status": {**self.status(), **self.queue_state()}}))
        elif message.type == "echo":
            conn.send(Message("result", {**reply_id, "elapsed_s": 0.0, "info": {}}, message.tensors))
        elif message.type == "cancel":
            found = self._cancel(message.fields.get("target", ""), "cancelled by the client")
            conn.send(Message("result", {**reply_id, "elapsed_s": 0.0, "info": {"cancelled": found}}))
        elif message.type in QUEUED_TYPES:
            job = Job(message, conn)
            refusal = self._enqueue(job)
            if refusal:
                conn.send(error_message("bad_request", refusal, id=message.id))
            else:
                mine[:] = [j for j in mine if not j.cancelled and j.id in self._jobs] + [job]
                if message.type == "shutdown" and self._running is not None:
                    self._running.cancel("the backend is shutting down")


def _drain(sock: socket.socket, seconds: float, max_bytes: int) -> None:
    """Read and drop what the peer sends, until it closes, ``seconds`` pass or ``max_bytes`` arrive."""
    deadline = time.monotonic() + seconds
    received = 0
    while received < max_bytes and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except (socket.timeout, OSError):
            return
        if not chunk:
            return
        received += len(chunk)


def _peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED: pid, uid, gid)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]
