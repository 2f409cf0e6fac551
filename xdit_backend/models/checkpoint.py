"""Reading single files in a family's original key layout into diffusers tensors.

Each family's converter (``<family>_checkpoint.py``) implements ``Checkpoint``, the four functions
the registry calls; its ``sources`` is a table: for every diffusers parameter, the ``TensorSource``
it comes from in the original file. Fused tensors (a qkv projection) give each diffusers tensor a
band of rows. Tensors are read through memory-mapped slices, one at a time, so
a rank reads only the rows of the parameters it keeps; weights.put moves each to the device and
casts it there (float8 files included).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI's: bare, or inside a checkpoint


def find_prefix(keys, markers: tuple[str, ...]) -> str | None:
    """The prefix under which ``keys`` hold every one of a layout's ``markers``, or None."""
    keys = set(keys)
    return next((prefix for prefix in PREFIXES if all(prefix + marker in keys for marker in markers)), None)


def prefix_detector(*layouts: tuple[str, ...]) -> Callable[[Iterable[str]], str | None]:
    """A converter's ``detect_prefix`` for a family whose files are told by ``layouts``: marker keys
    that a file holds all of under one prefix (several when a family comes in several key layouts)."""

    def detect_prefix(keys: Iterable[str]) -> str | None:
        keys = set(keys)
        return next((prefix for markers in layouts if (prefix := find_prefix(keys, markers)) is not None), None)

    return detect_prefix


class FileShapes:
    """A file's tensor shapes seen under the prefix its family's keys sit at: ``shape(key)`` is the
    shape of ``prefix + key``, a list (a KeyError names a missing tensor); ``own``: the keys under the
    prefix, without it."""

    def __init__(self, shapes: dict[str, list[int]], prefix: str):
        self.shapes, self.prefix = shapes, prefix
        self.own = {key[len(prefix):] for key in shapes if key.startswith(prefix)}

    def __call__(self, key: str) -> list[int]:
        return list(self.shapes[self.prefix + key])

    def __contains__(self, key: str) -> bool:
        return self.prefix + key in self.shapes

    def unexpected(self, expected: dict[str, list[int]]) -> dict[str, list[int]]:
        """The tensors of ``expected`` (key → wanted shape) whose shape differs, with their shape."""
        return {key: self(key) for key, want in expected.items() if self(key) != want}


class Checkpoint(Protocol):
    """What the registry asks of a family's converter module (a module implements a protocol by its
    functions, PEP 544); each ``<family>_checkpoint.py`` provides these four.

    detect_prefix:      the key prefix under which a file holds the family's layout, or None (most
                        converters: ``detect_prefix = prefix_detector(MARKERS)``)
    config_from_shapes: diffusers' config, read off the tensor shapes (``path`` for the UserErrors)
    variant:            a name for what the shapes say, for messages
    sources:            the ``TensorSource`` of every diffusers key in a file under ``prefix``
    """

    def detect_prefix(self, keys: Iterable[str]) -> str | None: ...

    def config_from_shapes(self, shapes: dict[str, list[int]], prefix: str, path: str) -> dict: ...

    def variant(self, config: dict) -> str: ...

    def sources(self, diffusers_keys: Iterable[str], prefix: str, config: dict) -> dict[str, TensorSource]: ...


def count_blocks(keys, name: str, prefix: str = "") -> int:
    """How many blocks a file holds in its list ``name``: the distinct N of keys ``prefix + name.N.…``."""
    pattern = re.compile(re.escape(prefix + name) + r"\.(\d+)\.")
    return len({int(m.group(1)) for key in keys if (m := pattern.match(key))})


@dataclass(frozen=True)
class TensorSource:
    """Where one diffusers tensor comes from: a key of the original file, and which part of it."""

    key: str
    rows: tuple[int, int] | None = None  # [start, stop) along dim 0 of the original tensor; None: all of it
    swap_halves: bool = False  # original (shift, scale) modulation, diffusers (scale, shift)
    part: tuple[int, int] | None = None  # [start, stop) of the diffusers tensor's rows to read (a rank's shard)

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """This source's whole diffusers tensor from the whole original tensor (or of a LoRA delta shaped like
        it); ``part`` is not applied."""
        return self.convert(tensor[self.row_slice])

    @property
    def row_slice(self) -> slice:
        return slice(None) if self.rows is None else slice(*self.rows)

    @property
    def read_slice(self) -> slice:
        """The original rows a reader reads: the diffusers tensor's, or only ``part`` of them (the halves a
        swap exchanges are read whole and cut after: read_converted)."""
        if self.part is None or self.swap_halves:
            return self.row_slice
        start = 0 if self.rows is None else self.rows[0]
        return slice(start + self.part[0], start + self.part[1])

    def read_converted(self, read: torch.Tensor) -> torch.Tensor:
        """The diffusers rows wanted (``part``, or all) from the original rows read at ``read_slice``."""
        if self.part is not None and self.swap_halves:
            return self.convert(read)[self.part[0]:self.part[1]]
        return self.convert(read) if self.part is None else read

    def convert(self, rows: torch.Tensor) -> torch.Tensor:
        """The selected rows in diffusers' order."""
        if self.swap_halves:
            shift, scale = rows.chunk(2, dim=0)
            rows = torch.cat([scale, shift], dim=0)
        return rows


def bands(sizes: list[int]) -> list[tuple[int, int]]:
    """[start, stop) row ranges of consecutive parts with these sizes (a fused qkv: [D, D, D])."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(start, start + size) for start, size in zip(starts, sizes)]


def read_tensor(handle, source: TensorSource) -> torch.Tensor:
    """One diffusers tensor (or its ``part``) from an open safetensors file (safetensors_file.open_file), on the CPU in the
    file's dtype: only its rows are read."""
    return source.read_converted(handle.get_slice(source.key)[source.read_slice])


@contextmanager
def empty_weights(keep: Callable[[torch.nn.Module], bool] = lambda module: False):
    """Construct a model with its parameters on the meta device (nothing allocated, nothing
    initialised) but its buffers real: the tables a module computes at construction (Wan's
    RoPE, a fixed position embedding) are not in the file, so they must not be left on meta.
    Parameters of the modules ``keep`` accepts stay as their constructor made them."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not keep(module):
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
