"""The backend's safetensors reader (models/safetensors_file.py) against safetensors' own: the same keys,
metadata, shapes, dtypes and rows for every dtype the backend reads; a damaged file refused with the reason;
and a file larger than this machine's memory (a sparse one: no disk is used) opened and read, which
safetensors' private mapping cannot do (issue 25 item 2)."""

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xdit_backend.models.safetensors_file import DTYPES, open_file


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {f"m.{name}": (torch.randn(5, 3, 2, generator=g) * 50).to(dtype) for name, dtype in DTYPES.items()}
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4)
    return tensors


def test_the_reader_answers_as_safetensors_does(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_tensors(), str(path), metadata={"format": "pt", "note": "x"})
    with safe_open(str(path), "pt") as theirs, open_file(path) as ours:
        assert sorted(ours.keys()) == sorted(theirs.keys()) and ours.metadata() == theirs.metadata()
        for key in theirs.keys():
            view, expected = ours.get_slice(key), theirs.get_slice(key)
            assert view.get_shape() == expected.get_shape() and view.get_dtype() == expected.get_dtype()
            assert torch.equal(ours.get_tensor(key), theirs.get_tensor(key)), key
            if view.get_shape() and view.get_shape()[0]:
                for rows in (slice(1, 3), slice(0, 5), slice(4, 9), slice(5, 5)):
                    assert torch.equal(view[rows], expected[rows]), (key, rows)


def test_a_truncated_file_is_refused_saying_so(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="shorter than its header says"):
        open_file(path)


def test_a_file_larger_than_the_machines_memory_is_read(tmp_path):
    meminfo = dict(line.split(":") for line in open("/proc/meminfo"))
    memory = (int(meminfo["MemTotal"].split()[0]) + int(meminfo["SwapTotal"].split()[0])) * 1024
    columns = 1 << 17
    rows = memory // (2 * columns) + 8192  # bf16: RAM + swap and 2 GiB more
    header = json.dumps({"w": {"dtype": "BF16", "shape": [rows, columns], "data_offsets": [0, rows * columns * 2]}})
    header = header.encode() + b" " * (-len(header) % 8)
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as file:  # sparse: the size without the disk
        file.write(struct.pack("<Q", len(header)) + header)
        file.truncate(8 + len(header) + rows * columns * 2)
    assert path.stat().st_size > memory
    with open_file(path) as handle:
        assert handle.get_slice("w").get_shape() == [rows, columns]
        last = handle.get_slice("w")[rows - 2:rows]
    assert last.shape == (2, columns) and last.dtype == torch.bfloat16 and not last.any()
