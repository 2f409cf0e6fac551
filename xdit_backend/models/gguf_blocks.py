"""GGUF's block codec and file opening: what the storage layer needs to keep a GGUF matrix as its raw
blocks, dequantize it and size a file, apart from the reader that maps a file onto a model (gguf_file.py).

The ``gguf`` package is an optional extra (``pip install 'comfyui-xdit[gguf]'``); the blocks are
dequantized by diffusers' GGUF kernels (torch, so on the GPU).
"""

from __future__ import annotations

import torch

from ..errors import UserError

MAGIC = b"GGUF"
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # GGML type name → torch


def is_gguf(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == MAGIC


def gguf_package():
    try:
        import gguf
    except ImportError:
        raise UserError("reading a GGUF model file needs the gguf package, which is not installed",
                        "pip install 'comfyui-xdit[gguf]' (or pip install gguf) in the backend's environment") from None
    return gguf


def open_reader(path: str):
    """``gguf.GGUFReader`` on ``path`` (memory-mapped); a damaged file is named."""
    try:
        return gguf_package().GGUFReader(path)
    except UserError:
        raise
    except Exception as exc:  # the reader raises ValueError, struct errors, numpy errors on damaged files
        raise UserError(f"{path} is not a readable GGUF file ({exc})", "the file may be truncated (an "
                        "interrupted download?): check its size, or re-download it") from None


def dequantizers() -> dict:
    from diffusers.quantizers.gguf.utils import dequantize_functions

    return dequantize_functions


def dequantize(data: torch.Tensor, gguf_type: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Raw GGML blocks (uint8 [rows, bytes per row], on any device) → the tensor ``shape`` in ``dtype``."""
    block_size, type_size = gguf_package().GGML_QUANT_SIZES[gguf_type]
    blocks = data.reshape(-1, type_size)  # [blocks, bytes per block]
    values = dequantizers()[gguf_type](blocks, block_size, type_size, torch.float32)  # [blocks, values per block]
    return values.reshape(shape).to(dtype)


def type_name(gguf_type: int) -> str:
    return gguf_package().GGMLQuantizationType(gguf_type).name
