"""ComfyUI's scaled-fp8 and mixed-precision files: float8 weights with a scale beside each.

Two layouts, as ComfyUI writes and reads them:
- scaled fp8 (comfy/model_detection.py, comfy/ops.py ``scaled_fp8_ops``): a ``scaled_fp8`` marker
  tensor (its dtype names the float8), and per Linear ``<layer>.weight`` in float8 with
  ``<layer>.scale_weight`` (float32) and, optionally, ``<layer>.scale_input``;
- mixed precision (ComfyUI's ``comfy_quant`` metadata, QUANTIZATION.md): some layers in bf16, the
  quantized ones with ``<layer>.comfy_quant`` (the UTF-8 JSON ``{"format": "float8_e4m3fn"}`` as
  uint8) or listed in the header's ``_quantization_metadata``, and ``<layer>.weight_scale``
  (``weight_scale_2`` / ``input_scale`` optional).
The weight is ``weight.to(dtype) * scale`` (a scalar, or one per output row). The input scales
serve only ComfyUI's fp8 matrix-multiply fast path and are not needed to upcast: they are skipped.
A fused original tensor (Flux's qkv) is split by rows: a scalar scale applies to every part, a
per-row scale is split with the rows (checkpoint.TensorSource.select).
"""

from __future__ import annotations

import json

import torch

from ..errors import UserError
from .checkpoint import TensorSource, read_tensor
from .storage import Quantized

MARKER = "scaled_fp8"
WEIGHT_SCALES = ("scale_weight", "weight_scale")
SKIPPED = ("scale_input", "input_scale", "comfy_quant")  # read (comfy_quant) or not needed to upcast
FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_SUFFIXES = (*WEIGHT_SCALES, *SKIPPED)


def model_shapes(shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """A file's tensors without the quantization bookkeeping (marker, scales, formats): what the
    families' layout detection reads."""
    return {key: shape for key, shape in shapes.items()
            if key.rpartition(".")[2] not in (*_SUFFIXES, MARKER)}


def check(shapes: dict[str, list[int]], path: str) -> None:
    """Every scale belongs to a weight of the file."""
    orphans = [key for key in shapes if key.rpartition(".")[2] in WEIGHT_SCALES
               and key.rpartition(".")[0] + ".weight" not in shapes]
    if orphans:
        raise UserError(f"{path}: scales without their weight: {', '.join(orphans[:3])}"
                        f"{f' (and {len(orphans) - 3} more)' if len(orphans) > 3 else ''}",
                        "the file is incomplete or was converted wrongly: re-download it, or use its bf16 or fp8 file")


def formats(handle, path: str) -> dict[str, torch.dtype]:
    """The float8 format of each mixed-precision layer (by layer name, the file's prefix included),
    from its ``comfy_quant`` tensor or the header's ``_quantization_metadata``; other formats are refused."""
    declared = {}
    header = (handle.metadata() or {}).get("_quantization_metadata")
    if header:
        declared.update(json.loads(header).get("layers", {}))
    for key in handle.keys():
        layer, _, leaf = key.rpartition(".")
        if leaf == "comfy_quant":
            declared[layer] = json.loads(bytes(handle.get_tensor(key).to(torch.uint8).tolist()))
    unknown = {layer: conf.get("format") for layer, conf in declared.items() if conf.get("format") not in FORMATS}
    if unknown:
        layer, name = next(iter(unknown.items()))
        raise UserError(f"{path}: layer {layer} is quantized as {name!r} ({len(unknown)} such layers); "
                        f"the backend keeps {', '.join(FORMATS)} with their scales",
                        "use the model's fp8 (scaled or not), bf16 or GGUF file")
    return {layer: FORMATS[conf["format"]] for layer, conf in declared.items()}


class ScaledReader:
    """One diffusers tensor from a single file, with its scale when the file has one (``Quantized``)."""

    def __init__(self, handle, path: str):
        self.handle = handle
        self.keys = set(handle.keys())
        self.formats = formats(handle, path)

    def read(self, source: TensorSource):
        tensor = read_tensor(self.handle, source)
        layer, _, leaf = source.key.rpartition(".")
        if leaf != "weight":
            return tensor
        if layer in self.formats and tensor.dtype == torch.uint8:  # fp8 bytes kept in a uint8 container
            tensor = tensor.view(self.formats[layer])
        scale_key = next((f"{layer}.{name}" for name in WEIGHT_SCALES if f"{layer}.{name}" in self.keys), None)
        if scale_key is None:
            return tensor
        scale = self.handle.get_tensor(scale_key).to(torch.float32)
        if scale.numel() > 1:  # one per output row of the original tensor: this part's rows
            scale = source.select(scale.reshape(-1))  # [rows]
        else:
            scale = scale.reshape(())
        return Quantized(tensor, scale)
