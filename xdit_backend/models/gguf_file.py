"""GGUF model files in city96's layout (ComfyUI-GGUF): the original key names, each tensor in a
GGML type (Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, … or F32 / F16 / BF16), its dims stored reversed.

Read with the ``gguf`` package (an optional extra: ``pip install 'comfyui-xdit[gguf]'``), memory
mapped, one tensor (or band of rows) at a time. A quantized matrix stays as its raw blocks, uint8
[rows, bytes per row]: GGML blocks run along the last dim, so dim 0 is still the output rows, and a
fused original tensor (Flux's qkv) splits by rows like any other (checkpoint.TensorSource). It is
dequantized one layer at a time at compute (storage.StoredLinear) by diffusers' GGUF kernels
(torch, so on the GPU). F32 / F16 / BF16 tensors are plain tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from ..errors import UserError
from .checkpoint import TensorSource
from .storage import Quantized

MAGIC = b"GGUF"
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # GGML type name → torch


def is_gguf(path: str) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == MAGIC


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("reading a GGUF model file needs the gguf package, which is not installed",
                        "pip install 'comfyui-xdit[gguf]' (or pip install gguf) in the backend's environment") from None
    return gguf


def open_reader(path: str):
    """``gguf.GGUFReader`` on ``path`` (memory-mapped); a damaged file is named."""
    try:
        return _gguf().GGUFReader(path)
    except UserError:
        raise
    except Exception as exc:  # the reader raises ValueError, struct errors, numpy errors on damaged files
        raise UserError(f"{path} is not a readable GGUF file ({exc})", "the file may be truncated (an "
                        "interrupted download?): check its size, or re-download it") from None


def _dequantizers() -> dict:
    from diffusers.quantizers.gguf.utils import dequantize_functions

    return dequantize_functions


def shapes(reader, path: str) -> dict[str, list[int]]:
    """Each tensor's shape in torch's order (GGUF stores the dims reversed); every type must be one
    the backend can dequantize on the device, else the file is refused here, before loading."""
    supported = {_gguf().GGMLQuantizationType(t).name for t in _dequantizers()} | set(PLAIN)
    unknown = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors
               if tensor.tensor_type.name not in supported}
    if unknown:
        name, kind = next(iter(unknown.items()))
        raise UserError(f"{path}: tensor {name} is quantized as {kind} ({len(unknown)} such tensors), which the "
                        f"backend cannot dequantize (it reads {', '.join(sorted(supported))})",
                        "use a Q8_0, Q6_K, Q5_K, Q4_K or Q4_0 GGUF file of the model, or its safetensors file")
    return {tensor.name: original_shape(reader, tensor) for tensor in reader.tensors}


def original_shape(reader, tensor) -> list[int]:
    """A tensor's torch shape: city96's ``comfy.gguf.orig_shape.<name>`` where the converter stored
    one (a tensor it reshaped), else the file's dims reversed."""
    field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
    if field is not None:
        return [int(field.parts[index][0]) for index in field.data]
    return [int(n) for n in reversed(tensor.shape.tolist())]


def file_reader(reader) -> Callable[[TensorSource], object]:
    """``read(source)``: one diffusers tensor's rows from the GGUF file: a plain tensor (F32, F16,
    BF16) or a storage.Quantized of raw blocks [rows, bytes per row]."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shapes = {name: original_shape(reader, tensor) for name, tensor in tensors.items()}

    def read(source: TensorSource):
        tensor = tensors[source.key]
        with warnings.catch_warnings():  # the memory map is read-only; the rows are copied out of it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            rows = torch.from_numpy(tensor.data[source.row_slice].copy())
        kind = tensor.tensor_type.name
        if kind == "BF16":  # kept by the reader as bytes: [rows, 2 × values]
            rows = rows.view(torch.uint8).view(torch.bfloat16)
        if kind in PLAIN:
            if source.rows is None:
                rows = rows.reshape(shapes[source.key])
            return source.convert(rows)
        return Quantized(source.convert(rows.view(torch.uint8)), gguf_type=int(tensor.tensor_type))

    return read


def dequantize(data: torch.Tensor, gguf_type: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Raw GGML blocks (uint8 [rows, bytes per row], on any device) → the tensor ``shape`` in ``dtype``."""
    block_size, type_size = _gguf().GGML_QUANT_SIZES[gguf_type]
    blocks = data.reshape(-1, type_size)  # [blocks, bytes per block]
    values = _dequantizers()[gguf_type](blocks, block_size, type_size, torch.float32)  # [blocks, values per block]
    return values.reshape(shape).to(dtype)


def type_name(gguf_type: int) -> str:
    return _gguf().GGMLQuantizationType(gguf_type).name
