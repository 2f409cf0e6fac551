"""Wire protocol: framing and message schemas; the tensors ride as a safetensors payload (tensor_payload.py).

One frame on the socket::

    b"XDIT" | u16 version | u32 header length | JSON header | u64 payload length | payload

all integers big-endian. The JSON header is an object with a ``type`` (the message type) and an
``id``; the payload is empty or a safetensors blob holding the message's tensors by name.
Nothing here unpickles anything, and nothing here knows about torch.distributed. torch itself is loaded
(by tensor_payload.py) only for a frame that carries tensors, so ``status`` and ``stop`` start in a blink.

Every size, dtype and shape is checked before a tensor is built. A frame that breaks the
framing (wrong magic or version, a length over the limit, a truncated frame) raises
``FrameError(fatal=True)``: the peer should get an error frame and the connection be closed.
A frame that was read whole but says something wrong raises ``FrameError(fatal=False)``: the
connection can go on.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .. import schema

if TYPE_CHECKING:
    import torch

MAGIC = b"XDIT"
PROTOCOL_VERSION = 1

_PRELUDE = struct.Struct(">4sHI")  # magic, protocol version, header length
_PAYLOAD_LENGTH = struct.Struct(">Q")


@dataclass(frozen=True)
class Limits:
    """Bounds applied to every frame before anything is allocated for it."""

    max_header_bytes: int = 1 << 20
    max_payload_bytes: int = 1 << 30
    max_json_depth: int = 8
    max_tensors: int = 64  # latent, sigmas, and per side the text tensors and up to schema.MAX_REFERENCES references
    max_tensor_dims: int = 6
    max_string_chars: int = 4096
    frame_timeout_s: float = 30.0  # once a frame has started, the rest must arrive in this time
    idle_timeout_s: float = 300.0  # a connection with nothing queued or running closes after this long idle


DEFAULT_LIMITS = Limits()

# Field types per message type: what a request may carry, and what a reply may carry.
# Unknown types and unknown fields are errors; semantic checks live in request.py.
_NUM = schema.NUMBER
REQUEST_FIELDS: dict[str, dict[str, type | tuple]] = {
    "hello": {"client": str, "token": str},  # the token: required as the first frame over TCP
    "status": {},
    "sample": schema.wire_types(),  # the request's fields, declared in schema.py
    "evaluate": schema.evaluate_wire_types(),  # one model call of ComfyUI's own sampler (the xDiT MODEL)
    "cancel": {"target": str},
    "unload": {"model": str},
    "shutdown": {},
    "echo": {},
}
REPLY_FIELDS: dict[str, dict[str, type | tuple]] = {
    "hello": {"protocol": int, "world_size": int, "pid": int},
    "status": {"status": dict},
    "progress": {"step": int, "total": int, "elapsed_s": _NUM},
    "note": {"text": str},  # a line for the person waiting, before the steps start (a model to load)
    "result": {"elapsed_s": _NUM, "info": dict},
    "error": {"kind": str, "message": str, "hint": str, "node_hint": str, "rank": int, "traceback": str},
}


class FrameError(Exception):
    """A frame that cannot be accepted; ``fatal`` when the stream cannot be read further."""

    def __init__(self, message: str, hint: str = "", *, fatal: bool, kind: str = "bad_frame", node_hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.node_hint = node_hint  # the fix in the ComfyUI nodes' words, where it differs (errors.UserError)
        self.fatal = fatal
        self.kind = kind


class ConnectionClosed(Exception):
    """The peer closed the connection cleanly between two frames."""


@dataclass
class Message:
    """A decoded frame: its type, its JSON fields (without ``type``) and its tensors."""

    type: str
    fields: dict = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.fields.get("id", "")


def error_message(kind: str, message: str, hint: str = "", *, id: str = "", node_hint: str = "", **extra) -> Message:
    """Build an ``error`` reply; ``node_hint``: the fix in the ComfyUI nodes' words, sent where it is given (where it
    differs from ``hint``); ``extra`` may carry ``rank`` and ``traceback``."""
    return Message("error", {"id": id, "kind": kind, "message": message, "hint": hint,
                             **({"node_hint": node_hint} if node_hint else {}), **extra})


# --------------------------------------------------------------------------- encoding


def encode(message: Message) -> list[bytes | memoryview]:
    """Serialise a message into the parts of one frame (send them in order)."""
    header = json.dumps({"type": message.type, **message.fields}, separators=(",", ":")).encode()
    payload = _tensor_payload().encode(message.tensors) if message.tensors else []
    prelude = _PRELUDE.pack(MAGIC, PROTOCOL_VERSION, len(header))
    return [prelude, header, _PAYLOAD_LENGTH.pack(sum(len(p) for p in payload)), *payload]


def encode_bytes(message: Message) -> bytes:
    """The whole frame as one bytes object (for in-process use and tests)."""
    return b"".join(bytes(p) for p in encode(message))


# --------------------------------------------------------------------------- decoding


def decode_bytes(frame: bytes, limits: Limits = DEFAULT_LIMITS, *, direction: str = "request") -> Message:
    """Decode one whole frame held in memory."""
    view = memoryview(frame)
    if len(view) < _PRELUDE.size:
        raise FrameError("truncated frame: shorter than its prelude", fatal=True)
    header_len = _check_prelude(bytes(view[: _PRELUDE.size]), limits)
    start = _PRELUDE.size
    end = start + header_len + _PAYLOAD_LENGTH.size
    if len(view) < end:
        raise FrameError("truncated frame: header cut short", fatal=True)
    header = bytes(view[start : start + header_len])
    (payload_len,) = _PAYLOAD_LENGTH.unpack(view[end - _PAYLOAD_LENGTH.size : end])
    _check_payload_length(payload_len, limits)
    if len(view) != end + payload_len:
        raise FrameError(f"frame length {len(view)} does not match its declared lengths", fatal=True)
    return _decode_message(header, bytearray(view[end:]), limits, direction)


def _check_prelude(prelude: bytes, limits: Limits) -> int:
    magic, version, header_len = _PRELUDE.unpack(prelude)
    if magic != MAGIC:
        raise FrameError(
            f"not an xDiT frame (magic {magic!r}, expected {MAGIC!r})",
            "only xdit_backend.client (or a peer speaking its protocol) can talk to this socket",
            fatal=True,
        )
    if version != PROTOCOL_VERSION:
        raise FrameError(
            f"protocol version {version} is not supported; this backend speaks version {PROTOCOL_VERSION}",
            "restart the backend after upgrading (xdit-backend stop), so client and backend match",
            fatal=True,
            kind="version",
            node_hint="the backend still running is the pack's older version: stop it (xDiT Backend node: stop "
                      "backend) and queue again, which starts the upgraded one",
        )
    if header_len > limits.max_header_bytes:
        raise FrameError(
            f"header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}",
            fatal=True,
        )
    return header_len


def _check_payload_length(payload_len: int, limits: Limits) -> None:
    if payload_len > limits.max_payload_bytes:
        raise FrameError(
            f"payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}",
            "send smaller tensors, or start the backend with a larger --max-payload-mb",
            fatal=True,
            node_hint="a smaller size, frame count or batch; or start the backend yourself with a larger limit "
                      "(xdit-backend start --max-payload-mb N: the nodes use a backend that runs), after stopping this "
                      "one (xDiT Backend node: stop backend)",
        )


def _decode_message(header: bytes, payload: bytearray, limits: Limits, direction: str) -> Message:
    try:
        fields = json.loads(header, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"header is not valid JSON: {str(exc)[:200]}", fatal=False) from None
    if not isinstance(fields, dict):
        raise FrameError("header must be a JSON object", fatal=False)
    _check_json_depth(fields, limits.max_json_depth)
    msg_type = fields.pop("type", None)
    schemas = REQUEST_FIELDS if direction == "request" else REPLY_FIELDS
    if msg_type not in schemas:
        raise FrameError(
            f"unknown message type {msg_type!r}",
            f"known {direction} types: {', '.join(sorted(schemas))}",
            fatal=False,
            kind="bad_request",
        )
    _check_fields(msg_type, fields, schemas[msg_type], limits, bound_strings=direction == "request")
    if not payload:
        return Message(msg_type, fields)
    tensor_payload = _tensor_payload()
    try:
        tensors = tensor_payload.decode(payload, limits.max_header_bytes, limits.max_tensors, limits.max_tensor_dims)
    except tensor_payload.PayloadError as exc:
        raise FrameError(exc.message, exc.hint, fatal=False) from None
    return Message(msg_type, fields, tensors)


def _tensor_payload():
    """tensor_payload.py, imported (with torch) at the first frame that carries tensors."""
    from . import tensor_payload

    return tensor_payload


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number JSON allows")


def _check_json_depth(value, max_depth: int) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            raise FrameError(f"header nests deeper than {max_depth} levels", fatal=False)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _check_fields(msg_type: str, fields: dict, schema: dict, limits: Limits, bound_strings: bool = True) -> None:
    """Every field known to ``msg_type``'s schema and of its type; with ``bound_strings`` (a request: what anyone
    may send) no string over ``limits.max_string_chars``. A reply's strings (an error's message, a rank's traceback)
    are the backend's own: only the header's size bounds them, so a long one is not taken for a broken backend."""
    msg_id = fields.get("id", "")
    if not isinstance(msg_id, str) or len(msg_id) > 128:
        raise FrameError("field 'id' must be a string of at most 128 characters", fatal=False)
    for name, value in fields.items():
        if name == "id":
            continue
        if name not in schema:
            allowed = ", ".join(["id", *schema]) or "id"
            raise FrameError(
                f"unknown field {name!r} in a {msg_type!r} message",
                f"fields a {msg_type!r} message may carry: {allowed}",
                fatal=False,
                kind="bad_request",
            )
        expected = schema[name]
        if isinstance(value, bool) and expected is not bool:  # JSON true is not a number here
            ok = False
        else:
            ok = isinstance(value, expected)
        if not ok:
            raise FrameError(
                f"field {name!r} of a {msg_type!r} message has type {type(value).__name__}, "
                f"expected {_type_name(expected)}",
                fatal=False,
                kind="bad_request",
            )
        if bound_strings and isinstance(value, str) and len(value) > limits.max_string_chars:
            raise FrameError(f"field {name!r} is longer than {limits.max_string_chars} characters", fatal=False)


def _type_name(expected) -> str:
    if isinstance(expected, tuple):
        return "number"
    return {str: "string", int: "integer", bool: "boolean", dict: "object"}.get(expected, expected.__name__)


# --------------------------------------------------------------------------- sockets


class Connection:
    """A framed, thread-safe-for-sending connection over a stream socket."""

    def __init__(self, sock: socket.socket, limits: Limits = DEFAULT_LIMITS, *, direction: str):
        self.sock = sock
        self.limits = limits
        self.direction = direction  # the kind of message this side receives: "request" or "reply"
        self._send_lock = threading.Lock()

    def send(self, message: Message) -> None:
        parts = encode(message)
        with self._send_lock:
            for part in parts:
                self.sock.sendall(part)

    def receive(self, idle_timeout: float | None = None) -> Message:
        """Read one frame; waits up to ``idle_timeout`` for it to begin (None: forever)."""
        self.sock.settimeout(idle_timeout)
        first = self.sock.recv(_PRELUDE.size)
        if not first:
            raise ConnectionClosed()
        deadline = time.monotonic() + self.limits.frame_timeout_s
        prelude = first + self._read_exactly(_PRELUDE.size - len(first), deadline)
        header_len = _check_prelude(prelude, self.limits)
        header = self._read_exactly(header_len, deadline)
        (payload_len,) = _PAYLOAD_LENGTH.unpack(self._read_exactly(_PAYLOAD_LENGTH.size, deadline))
        _check_payload_length(payload_len, self.limits)
        payload = bytearray(payload_len)
        self._read_into(memoryview(payload), deadline)
        return _decode_message(header, payload, self.limits, self.direction)

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        buffer = bytearray(size)
        self._read_into(memoryview(buffer), deadline)
        return bytes(buffer)

    def _read_into(self, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FrameError(
                    f"frame not completed within {self.limits.frame_timeout_s:.0f} s", fatal=True
                )
            self.sock.settimeout(remaining)
            try:
                n = self.sock.recv_into(view[got:])
            except socket.timeout:
                continue
            if n == 0:
                raise FrameError(f"truncated frame: connection closed after {got} of {len(view)} bytes", fatal=True)
            got += n

    def close(self) -> None:
        """Close, but never in the middle of a frame another thread is sending (a queued job's
        reply may be on its way when the client's side ends): the peer gets whole frames or none."""
        with self._send_lock:
            try:
                self.sock.close()
            except OSError:
                pass
