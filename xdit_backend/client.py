"""The client: talk to a backend over its socket, start one when asked, stream progress, cancel.

Used by the CLI and by the ComfyUI nodes. It starts no process group and imports no module that
does (control, worker and the rest of the ranks' side): torch is loaded for tensors only, when a
message carries some.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .launch import launcher
from .launch.options import LaunchOptions, tcp_address
from .wire import endpoint, paths, protocol
from .wire.content_hash import content_hash
from .wire.endpoint import BackendDied, BackendError, Cancelled, NoBackend  # noqa: F401  (the client's errors)
from .wire.protocol import Connection, Message

if TYPE_CHECKING:
    import torch

POLL_S = 0.1  # how often a waiting client checks its cancel callback
DEATH_REPORT_WAIT_S = 15.0  # how long to wait for the launcher to record which rank failed


ProgressCallback = Callable[[int, int, float], None]
NoteCallback = Callable[[str], None]  # a line of what the wait is (a backend starting, a model loading)


class Client:
    """One backend, addressed by its socket. Each call opens its own connection, so a Client can
    be shared between threads."""

    def __init__(self, socket_path: str | Path | None = None, *, auto_start: bool = False,
                 launch: LaunchOptions | None = None, connect_timeout: float = endpoint.PROBE_TIMEOUT_S,
                 tcp: str | None = None, token: str | None = None):
        self.socket_path = paths.resolve_socket(socket_path)
        self.tcp = tcp  # "127.0.0.1:PORT": connect over loopback TCP instead, proving ``token`` first
        self.token = token
        self.auto_start = auto_start
        self.launch = launch
        self.connect_timeout = connect_timeout
        self.inputs_sent: set[str] = set()  # content hashes this client sent to the backend (``evaluate``)

    # ------------------------------------------------------------------ connections

    def _connect(self) -> Connection:
        return self._connect_tcp() if self.tcp else endpoint.connect(self.socket_path, self.connect_timeout)

    def _connect_tcp(self) -> Connection:
        try:
            sock = socket.create_connection(tcp_address(self.tcp), timeout=self.connect_timeout)
        except OSError as exc:
            raise NoBackend("no_backend", f"no backend answers at tcp {self.tcp} ({exc})",
                            "start it with --tcp, or check the port") from None
        conn = Connection(sock, direction="reply")
        conn.send(Message("hello", {"id": uuid.uuid4().hex, "client": "xdit_backend.client", "token": self.token or ""}))
        reply = conn.receive(idle_timeout=self.connect_timeout)
        if reply.type == "error":
            conn.close()
            raise BackendError.from_message(reply)
        return conn

    def _connect_or_start(self, on_note: NoteCallback | None = None) -> Connection:
        try:
            return self._connect()
        except NoBackend:
            if not self.auto_start:
                raise
        started = time.monotonic()
        if on_note:
            on_note(f"starting the xDiT backend at {self.socket_path}: each rank imports torch and the model code "
                    "first (tens of seconds)")
        status = launcher.start(self._launch_options())
        if on_note:
            on_note(f"backend ready in {time.monotonic() - started:.0f} s: {status.get('world_size')} ranks")
        return self._connect()

    def _launch_options(self) -> LaunchOptions:
        """What to start: the options given, else the last backend's at this socket, else defaults."""
        if self.launch is not None:
            return self.launch
        previous = launcher.read_state(self.socket_path)
        if previous and "options" in previous:
            return LaunchOptions.from_json(previous["options"])
        return LaunchOptions(socket=self.socket_path)

    def _call(self, message: Message, timeout: float = 60.0) -> Message:
        """Send one request and return its one reply (raising BackendError for an error reply)."""
        return endpoint.exchange(self._connect_or_start(), message, timeout, self.socket_path)

    # ------------------------------------------------------------------ calls

    def hello(self) -> dict:
        return self._call(Message("hello", {"client": "xdit_backend.client"})).fields

    def hello_or_none(self) -> dict | None:
        """The backend's hello, or None when nothing (or nothing sane) answers; never starts one."""
        return endpoint.hello_or_none(self._connect, self.connect_timeout)

    def status(self) -> dict:
        return self._call(Message("status")).fields["status"]

    def echo(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Send tensors to the backend and back (a check and a measure of the transport)."""
        return self._call(Message("echo", {}, tensors)).tensors

    def unload(self, model: str | None = None, timeout: float = 600.0) -> list[str]:
        """Unload ``model``, or every model; waits (at most ``timeout`` s) for the requests queued before it."""
        fields = {"model": model} if model else {}
        return self._call(Message("unload", fields), timeout=timeout).fields["info"]["unloaded"]

    def shutdown(self, wait: float = 30.0) -> None:
        """Stop the backend. Its reply comes before its ranks have left and its socket closed: this returns once
        the socket no longer answers (so a status asked next finds no backend), or after ``wait`` seconds."""
        self._call(Message("shutdown"), timeout=60.0)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.hello_or_none() is not None:
            time.sleep(0.05)

    def cancel(self, request_id: str) -> bool:
        return self._call(Message("cancel", {"target": request_id})).fields["info"]["cancelled"]

    def sample(self, fields: dict, tensors: dict[str, torch.Tensor] | None = None, *,
               on_progress: ProgressCallback | None = None, should_cancel: Callable[[], bool] | None = None,
               timeout: float | None = None,
               on_note: NoteCallback | None = None) -> tuple[dict[str, torch.Tensor], dict]:
        """Run one generation; returns (tensors, info). Raises Cancelled, BackendDied or BackendError.

        ``on_progress(step, total, elapsed_s)`` is called for every step; ``should_cancel()`` is polled
        while waiting and, once it returns True, the request is cancelled on every rank; ``on_note(text)`` gets
        what the wait before the first step is (a backend starting, a model loading, blocks compiling).
        """
        return self._request("sample", fields, tensors or {}, on_progress, should_cancel, timeout, on_note)

    def evaluate(self, fields: dict, tensors: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor], *,
                 should_cancel: Callable[[], bool] | None = None) -> tuple[torch.Tensor, dict]:
        """One model call (the xDiT MODEL): ``tensors`` x, timestep (and guidance), ``inputs`` the conditioning by
        key. Each input goes by its content hash, inline only the first time this client sends it; when the
        backend no longer holds one (evicted, restarted) the call is sent again with every input inline.
        Returns (the output, info)."""
        names = {key: content_hash(tensor) for key, tensor in inputs.items()}
        by_name = {names[key]: tensor.contiguous() for key, tensor in inputs.items()}
        request = {**fields, "inputs": names}
        inline = {name: t for name, t in by_name.items() if name not in self.inputs_sent}
        try:
            result, info = self._request("evaluate", request, {**tensors, **inline}, None, should_cancel, None)
        except BackendError as exc:
            if exc.kind != "missing_inputs":
                raise
            self.inputs_sent.clear()
            result, info = self._request("evaluate", request, {**tensors, **by_name}, None, should_cancel, None)
        self.inputs_sent.update(by_name)
        return result["output"], info

    def _request(self, kind: str, fields: dict, tensors: dict, on_progress: ProgressCallback | None,
                 should_cancel: Callable[[], bool] | None, timeout: float | None,
                 on_note: NoteCallback | None = None) -> tuple[dict, dict]:
        request_id = uuid.uuid4().hex
        conn = self._connect_or_start(on_note)
        deadline = time.monotonic() + timeout if timeout else None
        cancel_sent = False
        try:
            conn.send(Message(kind, {"id": request_id, **fields}, tensors))
            while True:
                if not cancel_sent and ((should_cancel and should_cancel())
                                        or (deadline and time.monotonic() > deadline)):
                    conn.send(Message("cancel", {"id": uuid.uuid4().hex, "target": request_id}))
                    cancel_sent = True
                try:
                    reply = conn.receive(idle_timeout=POLL_S)
                except socket.timeout:
                    continue
                except (protocol.ConnectionClosed, protocol.FrameError, OSError):
                    raise self._died(request_id) from None
                if reply.id != request_id and not (reply.type == "error" and not reply.id):
                    continue  # the acknowledgement of our cancel
                if reply.type == "progress" and on_progress:
                    on_progress(reply.fields["step"], reply.fields["total"], reply.fields["elapsed_s"])
                elif reply.type == "note" and on_note:
                    on_note(reply.fields["text"])
                elif reply.type == "result":
                    return reply.tensors, reply.fields.get("info", {})
                elif reply.type == "error":
                    if reply.fields.get("kind") == "rank_failed":
                        raise self._died(request_id, reply.fields.get("message", ""))
                    error = BackendError.from_message(reply)
                    if isinstance(error, Cancelled) and deadline and time.monotonic() > deadline:
                        raise BackendError("timeout", f"request {request_id} took longer than {timeout:.0f} s "
                                           "and was cancelled", "allow more time, or use fewer steps") from None
                    raise error
        finally:
            conn.close()

    def _died(self, request_id: str, said: str = "") -> BackendDied:
        """Build the error for a backend that went away, naming the rank the launcher saw fail."""
        deadline = time.monotonic() + DEATH_REPORT_WAIT_S
        state = None
        while time.monotonic() < deadline:
            state = launcher.read_state(self.socket_path)
            if state and state.get("status") in ("failed", "stopped"):
                break
            time.sleep(0.1)
        summary = launcher.failure_summary(state)
        rank = state["root_cause"]["rank"] if summary else None
        what = summary or said or "the connection closed without a reply"
        log = (state or {}).get("log", str(paths.log_file(self.socket_path)))
        return BackendDied("rank_failed", f"the backend failed during request {request_id}: {what}",
                           f"the next request restarts the backend; details in {log}", rank)
