"""A safetensors file read through a shared, read-only memory map, whatever its size.

safetensors' own ``safe_open`` maps the whole file privately, and Linux charges a private mapping to the
commit limit (RAM + swap, with the default heuristic overcommit): a file larger than that cannot be opened at
all. Measured here (2 cores, 24 GiB, no swap, CommitLimit 11.8 GiB): a 31 GB file fails with "unable to mmap
31457280096 bytes … Cannot allocate memory"; a 64 GB Flux.2-dev bf16 file on a 24 GB host is the users' case.
A shared read-only mapping is not charged: its pages are the page cache's. The format is small enough to read
here (8 bytes of header length, a JSON header giving each tensor's dtype, shape and byte range, then the
bytes), so ``open_file`` answers what the backend asked safe_open (keys, metadata, a tensor's shape and dtype,
its rows) with the same names; a tensor's rows are copied out of the map, so only the pages of the rows read
are ever touched (a rank of a sharded model reads its own rows: parallel/shard.py).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct

import numpy as np
import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound


class SafetensorsFile:
    """An open safetensors file (a context manager, like safe_open's handle)."""

    def __init__(self, path: str):
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size < 8:
                raise ValueError(f"{size} bytes: shorter than the header's length field")
            (length,) = struct.unpack("<Q", file.read(8))
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(file.read(length))
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + length else None
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        self._metadata = header.pop("__metadata__", None)
        self._start = 8 + length
        self._tensors = header
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"tensor {key!r} has dtype {entry['dtype']}, which the backend does not read")
            expected = math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize
            if not 0 <= begin <= end <= size - self._start or end - begin != expected:
                raise ValueError(f"tensor {key!r} needs bytes {begin}..{end} ({expected} expected) of "
                                 f"{size - self._start}: the file is shorter than its header says")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def metadata(self) -> dict | None:
        return self._metadata

    def get_slice(self, key: str) -> TensorView:
        return TensorView(self, key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.get_slice(key)[:]

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorView:
    """One tensor of the file, not read yet: its shape and dtype, and ``view[start:stop]`` reads those rows
    (dim 0; a 0-dim tensor is read whole by ``view[:]``)."""

    def __init__(self, file: SafetensorsFile, key: str):
        self.file, self.key = file, key
        self.entry = file._tensors[key]

    def get_shape(self) -> list[int]:
        return list(self.entry["shape"])

    def get_dtype(self) -> str:
        return self.entry["dtype"]

    def __getitem__(self, rows: slice) -> torch.Tensor:
        shape, dtype = self.get_shape(), DTYPES[self.get_dtype()]
        if not shape:
            start, stop, inner = 0, 1, []
        else:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"rows {rows} of {self.key!r}: only a contiguous range of rows is read")
            stop, inner = max(start, stop), shape[1:]
        row_bytes = math.prod(inner) * dtype.itemsize
        offset = self.file._start + self.entry["data_offsets"][0] + start * row_bytes
        count = (stop - start) * row_bytes
        if count == 0:
            return torch.empty((stop - start, *inner), dtype=dtype)
        data = np.frombuffer(self.file._map, dtype=np.uint8, count=count, offset=offset).copy()  # off the map
        return torch.from_numpy(data).view(dtype).reshape([stop - start, *inner] if shape else [])


def open_file(path: str) -> SafetensorsFile:
    """``path`` opened for reading (errors: OSError, ValueError, json's, naming what is wrong)."""
    return SafetensorsFile(str(path))
