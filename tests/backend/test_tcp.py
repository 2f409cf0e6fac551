"""TCP mode: loopback only, and nothing is served before the token (compared in constant time)."""

import socket

import pytest
from conftest import SMALL, free_port
from unit.test_protocol import frame

from xdit_backend.client import BackendError, Client
from xdit_backend.launch import launcher
from xdit_backend.launch.options import tcp_address
from xdit_backend.wire import paths, protocol


@pytest.fixture(scope="module")
def tcp_backend():
    from conftest import Backends

    manager = Backends()
    address = f"127.0.0.1:{free_port()}"
    client = manager.start(1, tcp=address)
    token = paths.token_path(client.socket_path).read_text().strip()
    yield client, address, token
    manager.cleanup()


def test_the_token_file_is_private_and_random(tcp_backend):
    client, _, token = tcp_backend
    path = paths.token_path(client.socket_path)
    assert path.stat().st_mode & 0o777 == 0o600 and len(token) >= 40


def test_with_the_token_a_tcp_client_samples(tcp_backend):
    client, address, token = tcp_backend
    result, _ = Client(tcp=address, token=token).sample(SMALL)
    unix, _ = client.sample(SMALL)
    assert (result["samples"] == unix["samples"]).all()


@pytest.mark.parametrize("token", ["", "wrong", None])
def test_without_the_right_token_nothing_is_served(tcp_backend, token):
    _, address, real = tcp_backend
    with pytest.raises(BackendError) as info:
        Client(tcp=address, token=token if token is not None else real[:-1]).status()
    assert info.value.kind == "forbidden" and "token" in info.value.message


def test_a_first_frame_other_than_hello_is_refused_and_the_connection_closed(tcp_backend):
    _, address, _ = tcp_backend
    host, port = tcp_address(address)
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(frame({"type": "status", "id": "s"}))
        reply = protocol.Connection(sock, direction="reply").receive(idle_timeout=10)
        assert reply.type == "error" and reply.fields["kind"] == "forbidden"
        assert sock.recv(1) == b""


def test_tcp_binds_loopback_only(tmp_path):
    with pytest.raises(launcher.LaunchError, match="loopback only"):
        launcher.LaunchOptions(socket=tmp_path / "b.sock", tcp="0.0.0.0:8765").resolved()
