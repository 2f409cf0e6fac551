"""A fixed-seed fuzzer against a live backend: 10 000 hostile inputs, each on its own connection.

Cases: random bytes; valid frames truncated or with bytes flipped; huge declared header and
payload lengths; wrong magic and versions; unknown kinds and fields, wrong field types; deeply
nested and huge JSON; tensors with lying dtypes, shapes and offsets, NaN and inf. The backend
must never crash, must answer with an error frame whenever it could read a whole header, and its
memory must stay bounded (rank 0's RSS before and after).
"""

import json
import random
import socket
import struct
import time
from pathlib import Path

import torch
from unit.test_protocol import frame, st_payload

from xdit_backend.wire import protocol

CASES = 10_000
SEED = 20261121


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def sample_frame(rng: random.Random) -> bytes:
    """A plausible sample request with a (possibly lying) safetensors payload."""
    dtype = rng.choice(["F32", "F16", "BF16", "I64", "U8", "F64", "X9"])
    shape = [rng.choice([0, 1, 2, 16, 2**31, -1]) for _ in range(rng.randint(0, 5))]
    start = rng.choice([0, 1, 8])
    end = start + rng.choice([0, 4, 64, 2**40])
    data = struct.pack("<4f", rng.choice([float("nan"), float("inf"), 1.0]), 0.0, -1.0, 2.0)
    payload = st_payload({"latent": {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}}, data)
    fields = {"type": "sample", "id": f"f{rng.random()}", "model": rng.choice(["flux-tiny", "../../etc/passwd", ""]),
              "steps": rng.choice([1, 0, -5, 10**9]), "width": rng.choice([64, 63, 0, 10**9])}
    return frame(fields, payload)


def nested_json(rng: random.Random) -> bytes:
    depth = rng.randint(1, 200)
    return frame(b'{"type": "hello", "client": ' + b"[" * depth + b"]" * depth + b"}")


def huge_json(rng: random.Random) -> bytes:
    return frame({"type": "hello", "client": "x" * rng.randint(1, 2_000_000)})


def make_case(rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(["bytes", "truncated", "flipped", "huge header", "huge payload", "magic", "version",
                       "unknown kind", "unknown field", "field type", "nested", "huge json", "tensor"])
    good = frame({"type": "hello", "id": "ok", "client": "fuzz"})
    if kind == "bytes":
        return kind, rng.randbytes(rng.randint(0, 300))
    if kind == "truncated":
        base = sample_frame(rng) if rng.random() < 0.5 else good
        return kind, base[: rng.randint(0, len(base) - 1)]
    if kind == "flipped":
        base = bytearray(sample_frame(rng) if rng.random() < 0.5 else good)
        for _ in range(rng.randint(1, 8)):
            base[rng.randrange(len(base))] = rng.randrange(256)
        return kind, bytes(base)
    if kind == "huge header":
        return kind, struct.pack(">4sHI", b"XDIT", 1, rng.randint(1 << 21, 2**32 - 1))
    if kind == "huge payload":
        return kind, good[:-8] + struct.pack(">Q", rng.randint(1 << 31, 2**64 - 1))
    if kind == "magic":
        return kind, frame({"type": "hello"}, magic=rng.randbytes(4))
    if kind == "version":
        return kind, frame({"type": "hello"}, version=rng.choice([0, 2, 99, 65535]))
    if kind == "unknown kind":
        return kind, frame({"type": rng.choice(["launch", "", "HELLO", "exec", "x" * 1000]), "id": "u"})
    if kind == "unknown field":
        return kind, frame({"type": "sample", "id": "f", "model": "flux-tiny", rng.choice(["__class__", "evil"]): 1})
    if kind == "field type":
        return kind, frame({"type": "sample", "id": "t", "steps": rng.choice(["20", None, [1], {"a": 1}, 1.5, True])})
    if kind == "nested":
        return kind, nested_json(rng)
    if kind == "huge json":
        return kind, huge_json(rng)
    return kind, sample_frame(rng)


def send_case(path: str, data: bytes) -> str:
    """Send one case, end the stream, and read what comes back: "error", "other", or "closed"."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(path)
    try:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server refused the frame before it was all sent: its error frame may be waiting
        try:
            reply = protocol.Connection(sock, direction="reply").receive(idle_timeout=20)
        except (protocol.ConnectionClosed, ConnectionResetError):
            return "closed"
        except protocol.FrameError:
            return "partial reply"
        return "error" if reply.type == "error" else "other"
    finally:
        sock.close()


def test_ten_thousand_hostile_inputs_never_break_the_backend(backend1):
    rng = random.Random(SEED)
    status = backend1.status()
    rank0 = status["ranks"][0]["pid"]
    backend1.sample({"model": "flux-tiny", "width": 64, "height": 64, "steps": 1})  # warm: model loaded
    before = rss_bytes(rank0)
    outcomes: dict[str, dict[str, int]] = {}
    started = time.monotonic()
    for i in range(CASES):
        kind, data = make_case(rng)
        outcome = send_case(str(backend1.socket_path), data)
        outcomes.setdefault(kind, {}).setdefault(outcome, 0)
        outcomes[kind][outcome] += 1
        if i % 2000 == 1999:
            assert backend1.hello()["protocol"] == protocol.PROTOCOL_VERSION  # still serving, mid-run
    elapsed = time.monotonic() - started
    after = rss_bytes(rank0)
    result, _ = backend1.sample({"model": "flux-tiny", "width": 64, "height": 64, "steps": 1, "seed": 5})
    assert torch.isfinite(result["samples"]).all()
    assert backend1.status()["ranks"][0]["pid"] == rank0  # the same process: nothing crashed or restarted
    print(f"\n{CASES} cases in {elapsed:.1f} s; rank 0 RSS {before / 2**20:.0f} → {after / 2**20:.0f} MiB; "
          + json.dumps(outcomes))
    # a whole header that could be read is answered with an error frame; a frame is never cut short
    for kind in ("magic", "version", "unknown kind", "unknown field", "field type", "nested", "huge header",
                 "huge payload"):
        assert set(outcomes.get(kind, {})) == {"error"}, (kind, outcomes[kind])
    assert not any("partial reply" in counts for counts in outcomes.values()), outcomes
    # "other" (a normal reply) only where the mutation can leave a valid request: a flipped byte in a
    # name, a JSON string under the header limit, a sample frame that happens to be valid
    assert {kind for kind, counts in outcomes.items() if "other" in counts} <= {"flipped", "huge json", "tensor"}
    # "closed" (no reply) only where no header arrived (an empty input, a cut before it), or for a valid
    # sample the server queued: ending the stream is leaving, and a client that leaves has its work dropped
    assert {kind for kind, counts in outcomes.items() if "closed" in counts} <= {"bytes", "truncated", "tensor"}
    assert after - before < 64 * 2**20, f"rank 0 grew by {(after - before) / 2**20:.0f} MiB"
