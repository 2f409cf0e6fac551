"""Reading original-layout single files (BFL, Stability, PixArt, Wan) into diffusers tensors.

Each family's converter (``<family>_checkpoint.py``) is a table: for every diffusers parameter,
the ``Source`` it comes from in the original file. Fused tensors (a qkv projection) give each
diffusers tensor a band of rows. Tensors are read through memory-mapped slices, one at a time, so
a rank reads only the rows of the parameters it keeps; weights.put moves each to the device and
casts it there (float8 files included).
"""

from __future__ import annotations

import re

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch


PREFIXES = ("model.diffusion_model.", "diffusion_model.", "")  # ComfyUI's: bare, or inside a checkpoint


def find_prefix(keys, markers: tuple[str, ...]) -> str | None:
    """The prefix under which ``keys`` hold every one of a layout's ``markers``, or None."""
    keys = set(keys)
    return next((prefix for prefix in PREFIXES if all(prefix + marker in keys for marker in markers)), None)


def count_blocks(keys, name: str, prefix: str = "") -> int:
    """How many blocks a file holds in its list ``name``: the distinct N of keys ``prefix + name.N.…``."""
    pattern = re.compile(re.escape(prefix + name) + r"\.(\d+)\.")
    return len({int(m.group(1)) for key in keys if (m := pattern.match(key))})


@dataclass(frozen=True)
class Source:
    """Where one diffusers tensor comes from: a key of the original file, and which part of it."""

    key: str
    rows: tuple[int, int] | None = None  # [start, stop) along dim 0 of the original tensor; None: all of it
    swap_halves: bool = False  # original (shift, scale) modulation, diffusers (scale, shift)

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """This source's part of the whole original tensor (or of a LoRA delta shaped like it)."""
        return self.convert(tensor[self.row_slice])

    @property
    def row_slice(self) -> slice:
        return slice(None) if self.rows is None else slice(*self.rows)

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


def read_tensor(handle, source: Source) -> torch.Tensor:
    """One diffusers tensor from an open safetensors file (``safe_open``), on the CPU in the file's
    dtype: only its rows are read."""
    return source.convert(handle.get_slice(source.key)[source.row_slice])


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
