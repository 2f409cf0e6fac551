"""The tensors of a message, as a safetensors blob: written without copying tensor data into one buffer, and
read by checking every entry (dtype, shape, offsets, overlaps) before any tensor is built over the payload.
Nothing here unpickles anything; float8 is for model files, not messages."""

from __future__ import annotations

import json
import struct

import torch

_ST_HEADER_LENGTH = struct.Struct("<Q")  # safetensors: little-endian header length

# safetensors dtype names accepted on the wire (float8 is for model files, not messages).
WIRE_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


class PayloadError(ValueError):
    """A payload that is not a well-formed, in-bounds safetensors blob (the frame is refused, the
    connection goes on)."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint


def encode(tensors: dict[str, torch.Tensor]) -> list[bytes | memoryview]:
    """A safetensors blob as a list of parts, without copying tensor data into one buffer."""
    if not tensors:
        return []
    entries, parts, offset = {}, [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {tensor.dtype}, not one the protocol carries")
        data = tensor.detach().to("cpu").contiguous()
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else b""
        entries[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        parts.append(raw)
        offset += len(raw)
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # tensor data starts 8-byte aligned, as safetensors does
    return [_ST_HEADER_LENGTH.pack(len(header)), header, *parts]


def decode(payload: bytearray, max_header_bytes: int, max_tensors: int, max_dims: int) -> dict[str, torch.Tensor]:
    """Validate a safetensors blob completely, then build zero-copy views over it."""
    if not payload:
        return {}
    if len(payload) < _ST_HEADER_LENGTH.size:
        raise PayloadError("payload is shorter than a safetensors header")
    (st_len,) = _ST_HEADER_LENGTH.unpack_from(payload)
    data_start = _ST_HEADER_LENGTH.size + st_len
    if st_len > max_header_bytes or data_start > len(payload):
        raise PayloadError(f"safetensors header length {st_len} does not fit the payload")
    try:
        entries = json.loads(bytes(payload[_ST_HEADER_LENGTH.size : data_start]))
    except (ValueError, RecursionError):
        raise PayloadError("safetensors header is not valid JSON") from None
    if not isinstance(entries, dict):
        raise PayloadError("safetensors header must be a JSON object")
    entries.pop("__metadata__", None)
    if len(entries) > max_tensors:
        raise PayloadError(f"{len(entries)} tensors exceed the limit of {max_tensors}")

    data_len = len(payload) - data_start
    specs, spans = [], []
    for name, entry in entries.items():
        dtype, shape, (begin, end) = _check_tensor_entry(name, entry, max_dims)
        if not 0 <= begin <= end <= data_len:
            raise PayloadError(f"tensor {name!r} lies outside the payload")
        if _numel(shape) * dtype.itemsize != end - begin:
            raise PayloadError(
                f"tensor {name!r}: shape {shape} of {dtype} needs {_numel(shape) * dtype.itemsize} bytes, "
                f"the payload gives {end - begin}"
            )
        specs.append((name, dtype, shape, begin, end))
        spans.append((begin, end))
    spans.sort()
    if any(prev_end > begin for (_, prev_end), (begin, _) in zip(spans, spans[1:])):
        raise PayloadError("tensors overlap in the payload")

    tensors = {}
    for name, dtype, shape, begin, end in specs:
        count = (end - begin) // dtype.itemsize
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        offset = data_start + begin
        tensor = torch.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
        tensors[name] = tensor if offset % dtype.itemsize == 0 else tensor.clone()
    return tensors


def _check_tensor_entry(name, entry, max_dims: int):
    if not isinstance(name, str) or not name or len(name) > 64:
        raise PayloadError("tensor names must be strings of 1 to 64 characters")
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise PayloadError(f"tensor {name!r}: entry must hold exactly dtype, shape, data_offsets")
    dtype = WIRE_DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    if dtype is None:
        raise PayloadError(
            f"tensor {name!r}: dtype {entry['dtype']!r} is not carried by the protocol",
            f"use one of {', '.join(WIRE_DTYPES)}",
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if (
        not isinstance(shape, list)
        or len(shape) > max_dims
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)
    ):
        raise PayloadError(f"tensor {name!r}: shape must be a list of at most {max_dims} non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise PayloadError(f"tensor {name!r}: data_offsets must be two integers")
    return dtype, shape, offsets


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
