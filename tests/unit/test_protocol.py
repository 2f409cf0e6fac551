"""Framing, message schemas and tensor payloads, in memory (no backend)."""

import io
import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load as safetensors_load

from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import FrameError, Message

REQUESTS = [
    Message("hello", {"id": "h", "client": "test"}),
    Message("status", {"id": "s"}),
    Message("sample", {"id": "x", "model": "flux-tiny", "width": 64, "height": 32, "batch": 2, "steps": 3,
                       "seed": 2**64 - 1, "cfg": 3.5, "guidance": 4, "shift": 1.15},
            {"latent": torch.randn(2, 16, 4, 8), "context": torch.randn(2, 8, 64).half()}),
    Message("cancel", {"id": "c", "target": "x"}),
    Message("unload", {"id": "u", "model": "flux-tiny"}),
    Message("shutdown", {"id": "d"}),
    Message("echo", {"id": "e"}, {name: torch.ones(3, dtype=dtype) for name, dtype in
                                 [("f32", torch.float32), ("bf16", torch.bfloat16), ("i64", torch.int64),
                                  ("u8", torch.uint8), ("b", torch.bool), ("scalar", torch.float32)]}),
]
REPLIES = [
    Message("hello", {"id": "h", "protocol": 1, "world_size": 2, "pid": 7}),
    Message("status", {"id": "s", "status": {"world_size": 2, "ranks": [{"rank": 0}]}}),
    Message("progress", {"id": "x", "step": 1, "total": 3, "elapsed_s": 0.5}),
    Message("result", {"id": "x", "elapsed_s": 1.0, "info": {}}, {"samples": torch.randn(1, 16, 4, 4)}),
    Message("error", {"id": "x", "kind": "cancelled", "message": "m", "hint": "h", "rank": 1, "traceback": "t"}),
]


def frame(header: dict | bytes, payload: bytes = b"", version: int = protocol.PROTOCOL_VERSION,
          magic: bytes = protocol.MAGIC) -> bytes:
    """A frame built by hand, independent of protocol.encode."""
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack(">4sHI", magic, version, len(head)) + head + struct.pack(">Q", len(payload)) + payload


def st_payload(entries: dict, data: bytes) -> bytes:
    head = json.dumps(entries).encode()
    return struct.pack("<Q", len(head)) + head + data


def assert_same(a: Message, b: Message) -> None:
    assert (a.type, a.fields) == (b.type, b.fields)
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype
        assert torch.equal(a.tensors[name], b.tensors[name])


@pytest.mark.parametrize("message", REQUESTS, ids=lambda m: m.type)
def test_request_round_trip(message):
    """Every request type survives encode → decode unchanged."""
    assert_same(protocol.decode_bytes(protocol.encode_bytes(message), direction="request"), message)


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: m.type)
def test_reply_round_trip(message):
    """Every reply type survives encode → decode unchanged."""
    assert_same(protocol.decode_bytes(protocol.encode_bytes(message), direction="reply"), message)


def test_payload_is_a_safetensors_blob():
    """The payload is read by the safetensors library itself, so any safetensors writer can talk to us."""
    message = REQUESTS[2]
    data = protocol.encode_bytes(message)
    header_len = struct.unpack(">I", data[6:10])[0]
    payload = data[10 + header_len + 8:]
    loaded = safetensors_load(payload)
    for name, tensor in message.tensors.items():
        assert torch.equal(loaded[name], tensor)


def test_reads_a_payload_written_by_safetensors():
    """A blob written by safetensors.torch.save decodes to the same tensors."""
    from safetensors.torch import save

    tensors = {"latent": torch.randn(1, 16, 2, 2), "pooled": torch.randn(1, 32).bfloat16()}
    message = protocol.decode_bytes(frame({"type": "echo", "id": "a"}, save(tensors)))
    for name, tensor in tensors.items():
        assert torch.equal(message.tensors[name], tensor)


MALFORMED = {
    "wrong magic": (frame({"type": "hello"}, magic=b"HTTP"), True, "not an xDiT frame"),
    "wrong version": (frame({"type": "hello"}, version=99), True, "protocol version 99"),
    "header too long": (struct.pack(">4sHI", b"XDIT", 1, 1 << 30), True, "exceeds the limit"),
    "payload too long": (frame({"type": "hello"})[:-8] + struct.pack(">Q", 1 << 40), True, "exceeds the limit"),
    "not json": (frame(b"{nope"), False, "not valid JSON"),
    "not an object": (frame(b"[1, 2]"), False, "must be a JSON object"),
    "NaN in header": (frame(b'{"type": "sample", "cfg": NaN}'), False, "NaN is not a number JSON allows"),
    "too deep": (frame(b'{"type": "hello", "client": ' + b"[" * 50 + b"]" * 50 + b"}"), False, "nests deeper"),
    "unknown type": (frame({"type": "launch_missiles"}), False, "unknown message type"),
    "unknown field": (frame({"type": "hello", "evil": 1}), False, "unknown field 'evil'"),
    "wrong field type": (frame({"type": "sample", "steps": "20"}), False, "expected integer"),
    "bool as integer": (frame({"type": "sample", "steps": True}), False, "expected integer"),
    "unsupported dtype": (frame({"type": "echo"}, st_payload({"a": {"dtype": "F8_E4M3", "shape": [1],
                                                                    "data_offsets": [0, 1]}}, b"\0")),
                          False, "not carried"),
    "shape does not match bytes": (frame({"type": "echo"}, st_payload({"a": {"dtype": "F32", "shape": [1 << 20],
                                                                             "data_offsets": [0, 4]}}, b"\0" * 4)),
                                   False, "needs 4194304 bytes"),
    "offsets outside payload": (frame({"type": "echo"}, st_payload({"a": {"dtype": "F32", "shape": [4],
                                                                          "data_offsets": [0, 16]}}, b"\0" * 4)),
                                False, "outside the payload"),
    "overlapping tensors": (frame({"type": "echo"}, st_payload({
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12)), False, "overlap"),
    "truncated": (frame({"type": "hello"})[:-3], True, "truncated"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_frames_are_refused_with_a_reason(name):
    """Each malformed frame raises FrameError with a message that says what is wrong."""
    data, fatal, words = MALFORMED[name]
    with pytest.raises(FrameError) as info:
        protocol.decode_bytes(data, direction="request")
    assert words in info.value.message
    assert info.value.fatal == fatal


def test_no_tensor_is_built_for_a_lying_shape(monkeypatch):
    """Validation happens before any tensor is allocated: frombuffer is never reached."""
    monkeypatch.setattr(torch, "frombuffer", lambda *a, **k: pytest.fail("a tensor was built"))
    data, _, _ = MALFORMED["shape does not match bytes"]
    with pytest.raises(FrameError):
        protocol.decode_bytes(data)


class _FakeSocket:
    """Enough of a socket for Connection.receive: serves bytes in small chunks."""

    def __init__(self, data: bytes, chunk: int):
        self.stream, self.chunk = io.BytesIO(data), chunk

    def settimeout(self, _):
        pass

    def recv(self, n):
        return self.stream.read(min(n, self.chunk))

    def recv_into(self, view):
        data = self.stream.read(min(len(view), self.chunk))
        view[: len(data)] = data
        return len(data)


@settings(max_examples=60, deadline=None)
@given(
    fields=st.fixed_dictionaries({"client": st.text(max_size=50)}),
    shape=st.lists(st.integers(0, 5), max_size=4),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8]),
    chunk=st.integers(1, 97),
)
def test_framing_round_trip_property(fields, shape, dtype, chunk):
    """Any message read from a stream in arbitrary chunk sizes equals what was sent."""
    tensor = (torch.arange(max(1, torch.Size(shape).numel())) % 7).to(dtype)[: torch.Size(shape).numel()]
    message = Message("hello", {"id": "p", **fields}, {"t": tensor.reshape(shape)})
    conn = protocol.Connection(_FakeSocket(protocol.encode_bytes(message), chunk), direction="request")
    assert_same(conn.receive(), message)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data):
    """Arbitrary bytes either decode or raise FrameError: never another exception."""
    try:
        protocol.decode_bytes(data)
    except FrameError:
        pass


def test_a_long_reply_string_is_read_and_a_long_request_string_refused():
    """Issue 25 (11): the client took any reply field over 4096 characters (a long error message or traceback)
    for a dead backend ("the next request restarts the backend") while the backend was fine."""
    long = "x" * (protocol.DEFAULT_LIMITS.max_string_chars + 1000)
    reply = protocol.decode_bytes(protocol.encode_bytes(Message("error", {"kind": "model_error", "message": long})),
                                  direction="reply")
    assert reply.fields["message"] == long
    with pytest.raises(protocol.FrameError, match="field 'model' is longer than 4096 characters"):
        protocol.decode_bytes(protocol.encode_bytes(Message("sample", {"model": long})))


def test_the_frame_errors_a_comfyui_user_meets_give_the_fix_in_the_nodes_words():
    """Issue 30: a backend left running across an upgrade of the pack, or a request over the payload limit: the fix
    for the command line names its command, the one for ComfyUI the xDiT Backend node's action."""
    for name in ("wrong version", "payload too long"):
        with pytest.raises(FrameError) as info:
            protocol.decode_bytes(MALFORMED[name][0], direction="request")
        assert "xdit-backend" in info.value.hint or "--" in info.value.hint
        assert "xDiT Backend node: stop backend" in info.value.node_hint, name
