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
from .gguf_blocks import PLAIN, dequantizers, gguf_package
from .storage import Quantized


def shapes(reader, path: str) -> dict[str, list[int]]:
    """Each tensor's shape in torch's order (GGUF stores the dims reversed); every type must be one
    the backend can dequantize on the device, else the file is refused here, before loading."""
    supported = {gguf_package().GGMLQuantizationType(t).name for t in dequantizers()} | set(PLAIN)
    unknown = {tensor.name: tensor.tensor_type.name for tensor in reader.tensors
               if tensor.tensor_type.name not in supported}
    if unknown:
        name, kind = next(iter(unknown.items()))
        raise UserError(f"{path}: tensor {name} is quantized as {kind} ({len(unknown)} such tensors), which the "
                        f"backend cannot dequantize (it reads {', '.join(sorted(supported))})",
                        "use a Q8_0, Q6_K, Q5_K, Q4_K or Q4_0 GGUF file of the model, or its safetensors file")
    return {tensor.name: original_shape(reader, tensor) for tensor in reader.tensors}


def string_field(reader, name: str) -> str | None:
    """A string of the file's metadata (``config``: the JSON a model's safetensors header held, which ComfyUI-GGUF
    hands ComfyUI's loader as that header since city96/ComfyUI-GGUF#399), None where the file has none."""
    field = reader.get_field(name)
    if field is None:
        return None
    if field.types != [gguf_package().GGUFValueType.STRING]:
        raise UserError(f"the GGUF metadata field {name!r} is not a string ({field.types})",
                        "the file may be damaged or written by another tool; re-download it")
    return bytes(field.parts[field.data[-1]]).decode("utf-8")


def original_shape(reader, tensor) -> list[int]:
    """A tensor's torch shape: city96's ``comfy.gguf.orig_shape.<name>`` where the converter stored
    one (a tensor it reshaped), else the file's dims reversed."""
    field = reader.get_field(f"comfy.gguf.orig_shape.{tensor.name}")
    if field is not None:
        return [int(field.parts[index][0]) for index in field.data]
    return [int(n) for n in reversed(tensor.shape.tolist())]


def file_reader(reader) -> Callable[[TensorSource], object]:
    """``read(source)``: one diffusers tensor's rows (or its ``part``'s) from the GGUF file: a plain tensor (F32,
    F16, BF16) or a storage.Quantized of raw blocks [rows, bytes per row]."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shapes = {name: original_shape(reader, tensor) for name, tensor in tensors.items()}

    def read(source: TensorSource):
        tensor = tensors[source.key]
        with warnings.catch_warnings():  # the memory map is read-only; the rows are copied out of it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            rows = torch.from_numpy(tensor.data[source.read_slice].copy())
        kind = tensor.tensor_type.name
        if kind == "BF16":  # kept by the reader as bytes: [rows, 2 × values]
            rows = rows.view(torch.uint8).view(torch.bfloat16)
        if kind in PLAIN:
            if source.rows is None and source.part is None:
                rows = rows.reshape(shapes[source.key])
            return source.read_converted(rows)
        return Quantized(source.read_converted(rows.view(torch.uint8)), gguf_type=int(tensor.tensor_type))

    return read
