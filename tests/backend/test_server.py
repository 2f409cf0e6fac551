"""A live backend answers bad input with error frames and keeps serving."""

import os
import socket
import stat
import struct
import threading
import time

import pytest
import torch
from conftest import LONG, SMALL
from unit.test_protocol import MALFORMED, frame

from xdit_backend.client import BackendError, Cancelled
from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import Message


def raw_connection(client) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(client.socket_path))
    return sock


def read_reply(sock: socket.socket) -> Message:
    return protocol.Connection(sock, direction="reply").receive(idle_timeout=30)


def assert_still_serving(client):
    """A real request on the same server succeeds after the bad input."""
    result, _ = client.sample(SMALL)
    assert result["samples"].shape == (1, 16, 8, 8)
    assert torch.isfinite(result["samples"]).all()


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_frame_gets_error_frame_and_server_keeps_serving(backend1, name):
    """Each malformed frame is answered with an error frame; the next good request succeeds."""
    data, fatal, words = MALFORMED[name]
    with raw_connection(backend1) as sock:
        sock.sendall(data)
        if name == "truncated" or name == "header too long":
            sock.shutdown(socket.SHUT_WR)  # the rest of the frame never comes
        reply = read_reply(sock)
        assert reply.type == "error"
        assert words in reply.fields["message"]
        if fatal:  # the server ends a stream it can no longer read (EOF, or a reset if input was left unread)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
        else:  # the connection goes on: a good frame on it is answered
            sock.sendall(frame({"type": "hello", "id": "again"}))
            assert read_reply(sock).type == "hello"
    assert_still_serving(backend1)


def test_random_garbage_then_good_request(backend1):
    with raw_connection(backend1) as sock:
        sock.sendall(os.urandom(4096))
        reply = read_reply(sock)
        assert reply.type == "error" and reply.fields["kind"] == "bad_frame"
    assert_still_serving(backend1)


def test_huge_declared_payload_allocates_nothing(backend1):
    """A frame declaring a 1 TiB payload is refused from its length alone."""
    with raw_connection(backend1) as sock:
        sock.sendall(frame({"type": "echo"})[:-8] + struct.pack(">Q", 1 << 40))
        reply = read_reply(sock)
        assert "exceeds the limit" in reply.fields["message"]
        assert "--max-payload-mb" in reply.fields["hint"]  # the command line's fix; the nodes' names their node
        assert "xDiT Backend node: stop backend" in reply.fields["node_hint"]
    assert_still_serving(backend1)


def test_bad_request_fields_are_named(backend1):
    with pytest.raises(BackendError) as info:
        backend1.sample({**SMALL, "width": 70})
    assert "width 70 is not a multiple of 16" in info.value.message
    with pytest.raises(BackendError) as info:
        backend1.sample({**SMALL, "guidance": 1e9})
    assert "guidance 1000000000.0 is out of range" in info.value.message
    with pytest.raises(BackendError) as info:
        backend1.sample({**SMALL, "model": "no-such-model"})
    assert "no-such-model" in info.value.message and "flux-tiny" in info.value.hint
    with pytest.raises(BackendError) as info:
        backend1.sample(SMALL, {"context": torch.full((1, 8, 64), float("nan")), "pooled": torch.zeros(1, 32)})
    assert "NaN" in info.value.message
    with pytest.raises(BackendError) as info:
        backend1.sample(SMALL, {"context": torch.zeros(1, 8, 63), "pooled": torch.zeros(1, 32)})
    assert "needs shape [1, 8, 64]" in info.value.message
    assert_still_serving(backend1)


def test_client_disconnecting_mid_request_drops_its_work(backend1):
    """A client that goes away mid-sample gets its job cancelled; the backend serves the next one."""
    sock = raw_connection(backend1)
    sock.sendall(protocol.encode_bytes(Message("sample", {"id": "gone", **LONG})))
    assert read_reply(sock).type == "progress"
    sock.close()
    deadline = time.monotonic() + 30
    while backend1.status()["running"] is not None:
        assert time.monotonic() < deadline, "the abandoned request kept running"
        time.sleep(0.05)
    assert_still_serving(backend1)


def test_cancel_stops_the_request_and_the_next_one_is_right(backend1):
    first, _ = backend1.sample(SMALL)
    started = threading.Event()
    with pytest.raises(Cancelled) as info:
        backend1.sample(LONG, on_progress=lambda *a: started.set(), should_cancel=started.is_set)
    assert "cancelled" in info.value.message
    again, _ = backend1.sample(SMALL)
    assert torch.equal(first["samples"], again["samples"])


def test_status_is_answered_while_a_sample_runs(backend1):
    progressed = threading.Event()
    statuses = []

    def ask_status(*_):
        if not progressed.is_set():
            statuses.append(backend1.status())
            progressed.set()

    with pytest.raises(Cancelled):
        backend1.sample(LONG, on_progress=ask_status, should_cancel=progressed.is_set)
    assert statuses and statuses[0]["running"] is not None


def test_echo_returns_the_tensors(backend1):
    latent = torch.randn(1, 16, 128, 128)
    assert torch.equal(backend1.echo({"latent": latent})["latent"], latent)


def test_socket_and_directory_are_private(backend1):
    assert stat.S_IMODE(backend1.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(backend1.socket_path.parent.stat().st_mode) == 0o700


def test_a_request_over_its_timeout_is_cancelled_with_a_clear_error(backend1):
    with pytest.raises(BackendError) as info:
        backend1.sample(LONG, timeout=1.0)
    assert info.value.kind == "timeout" and "longer than 1 s" in info.value.message
    assert_still_serving(backend1)


def test_weight_dtype_is_chosen_per_request_and_cached_apart(backend1):
    """bfloat16 weights give a nearby latent; each dtype is a loaded model of its own; unload drops both."""
    backend1.unload()  # the session's backend: only this test's models are listed below
    full, _ = backend1.sample({**SMALL, "dtype": "float32"})
    half, _ = backend1.sample({**SMALL, "dtype": "bfloat16"})
    assert half["samples"].dtype == torch.float32
    relative = (half["samples"] - full["samples"]).norm() / full["samples"].norm()
    assert 0 < relative < 0.05
    assert {"float32", "bfloat16"} <= {m["compute_dtype"] for m in backend1.status()["models"]}
    assert backend1.unload("flux-tiny") == ["flux-tiny"]
    assert backend1.status()["models"] == []
    with pytest.raises(BackendError, match="dtype 'float8' is not supported"):
        backend1.sample({**SMALL, "dtype": "float8"})


@pytest.mark.skipif(os.getuid() != 0, reason="needs root: the test connects as another user (uid 65534)")
def test_another_uid_is_refused_even_past_the_directory():
    """Behind the 0700 directory, the server itself refuses peers of another uid (SO_PEERCRED)."""
    import subprocess
    import sys

    from conftest import short_socket_dir

    from xdit_backend.service.server import SocketServer

    path = short_socket_dir() / "s.sock"
    server = SocketServer(path, lambda: {"world_size": 1, "pid": os.getpid()})
    server.start()
    try:
        os.chmod(path.parent, 0o711)  # open both doors on purpose, to reach the check behind them
        os.chmod(path, 0o666)
        # the whole reply, to the server's close (a reset, as it leaves unread bytes): one recv may get only its header
        # it sends only after the server has refused it: the send must still land and the reply still arrive
        probe = ("import os, socket, sys, time\nos.setuid(65534)\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
                 "time.sleep(0.3)\ns.sendall(bytes.fromhex(sys.argv[2]))\ns.settimeout(10)\nreply = b''\ntry:\n"
                 "    while chunk := s.recv(4096):\n        reply += chunk\nexcept ConnectionResetError:\n    pass\n"
                 "print(reply)")
        hello = frame({"type": "hello", "id": "x"}).hex()
        out = subprocess.run([sys.executable, "-c", probe, str(path), hello], capture_output=True, text=True, timeout=30)
        assert '"kind":"forbidden"' in out.stdout, out.stderr  # the reply's bytes, as the child printed them
        assert "uid 65534 may not use this backend" in out.stdout
    finally:
        server.close()



def test_an_idle_connection_is_closed_but_one_waiting_for_its_request_is_not():
    """Every read of the server has a bound: a silent connection is closed after the idle limit,
    while one whose request is still queued keeps waiting for its replies."""
    from conftest import short_socket_dir

    from xdit_backend.service.server import SocketServer

    path = short_socket_dir() / "idle.sock"
    server = SocketServer(path, lambda: {"world_size": 1, "pid": os.getpid()}, protocol.Limits(idle_timeout_s=1.0))
    server.start()
    try:
        idle, waiting = (socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2))
        for sock in (idle, waiting):
            sock.settimeout(10)
            sock.connect(str(path))
        waiting.sendall(frame({"type": "sample", "id": "queued", "model": "flux-tiny"}))  # nobody runs it
        time.sleep(2.5)
        assert idle.recv(1) == b""  # closed by the server
        waiting.settimeout(0.5)
        with pytest.raises(TimeoutError):  # still open: nothing to read yet, and no EOF
            waiting.recv(1)
    finally:
        server.close()


def test_a_result_with_non_finite_values_is_an_error_not_a_latent(backend1):
    """Issue 25 (9): an input whose values overflow the computation (here a latent of 1e30s to start from: inputs
    with NaN or inf are refused when the request is read) gave a NaN latent as a success."""
    latent = torch.full((1, 16, 8, 8), 1e30)
    with pytest.raises(BackendError) as error:
        backend1.sample({**SMALL, "denoise": 0.5}, {"latent": latent})
    assert error.value.kind == "model_error"
    assert error.value.message == "the result holds 1024 NaN and 0 infinite values of 1024; nothing is returned" and "NaN or infinite" in error.value.hint
    result, _ = backend1.sample(SMALL)  # still serving
    assert torch.isfinite(result["samples"]).all()
