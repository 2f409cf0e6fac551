"""Weights kept on the device in their storage precision, upcast one layer at a time at compute.

A Linear layer's weight is kept as the file stores it (float8_e4m3fn / float8_e5m2, ComfyUI's
scaled fp8 with its scale, GGUF's raw quantized blocks) or, with a request's ``weight_dtype``
fp8_e4m3fn / fp8_e5m2, a 16- or 32-bit file's weight is stored in that fp8 format (as ComfyUI's
UNETLoader does). Such a layer becomes a ``StoredLinear``: its forward builds the compute-dtype
weight into a temporary, ``F.linear(x, upcast(self.weight), bias)``, so only one layer's weight
exists at full precision at a time, never the whole model.

The contract with weight sharding (parallel/shard.py, FSDP2): a stored weight is an ordinary
``nn.Parameter`` of a plain dtype (float8, uint8 GGUF blocks) whose dim 0 is the output rows, and
the forward only reads ``self.weight``, never replaces it; so FSDP2 may shard it on dim 0 and swap
the Parameter for its gathered one. A scale is a small non-persistent buffer beside it (a scalar,
or one per output row [out, 1]), not sharded.

Everything else (biases, norms, modulation tables, convolutions, the family's
``_keep_in_fp32_modules``) is put in the compute dtype (or float32); with weight_dtype fp8_* it is first
rounded through that fp8, as ComfyUI's UNETLoader builds the whole model in it (Comfy-Org/ComfyUI
comfy/sd.py load_diffusion_model_state_dict: ``unet_dtype`` is the model's dtype, every layer made in it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..errors import UserError
from . import gguf_blocks, safetensors_file

FP8 = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}  # weight_dtype → storage
FLOAT8 = frozenset(FP8.values())


@dataclass(frozen=True)
class Quantized:
    """A weight as the file stores it when it is more than a tensor (a reader's answer for one key).

    data:  float8 values (scaled fp8), or GGUF's raw uint8 blocks [rows, bytes per row];
    scale: scaled fp8: the weight is data.to(dtype) * scale; a scalar or one per row [rows];
    gguf_type: GGUF's quantization type (gguf.GGMLQuantizationType) of ``data``, else None.
    """

    data: torch.Tensor
    scale: torch.Tensor | None = None
    gguf_type: int | None = None

    def dequantized(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``, shaped ``shape`` (on ``data``'s device)."""
        if self.gguf_type is not None:
            return gguf_blocks.dequantize(self.data, self.gguf_type, shape, dtype)
        weight = self.data.to(dtype)
        return weight if self.scale is None else weight * _row_scale(self.scale, weight.dim()).to(dtype)


class StoredLinear(torch.nn.Linear):
    """A Linear whose weight stays in its storage form (float8, scaled float8, GGUF blocks); the
    forward upcasts it into a temporary in the input's dtype. Made by ``place`` from a loaded
    nn.Linear (its class is switched: the Parameter objects and their names stay)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.upcast(x.dtype), bias)

    def upcast(self, dtype: torch.dtype) -> torch.Tensor:
        """This layer's weight [out, in] in ``dtype``: a new tensor, the stored one untouched."""
        stored = Quantized(self.weight, self._buffers.get("weight_scale"), getattr(self, "gguf_type", None))
        return stored.dequantized(torch.Size((self.out_features, self.in_features)), dtype)

    def upcast_local(self, dtype: torch.dtype) -> torch.Tensor:
        """``upcast`` of the rows this rank holds: all of them, or its shard's when the weight is sharded."""
        local, start = _local_rows(self.weight)
        scale = self._buffers.get("weight_scale")
        if scale is not None and scale.dim():  # one per row: the shard's rows
            scale = scale[start:start + local.shape[0]]
        stored = Quantized(local, scale, getattr(self, "gguf_type", None))
        return stored.dequantized(torch.Size((local.shape[0], self.in_features)), dtype)

    def storage(self) -> str:
        """The stored form's name: float8_e4m3fn, "float8_e4m3fn scaled", "gguf Q4_K"."""
        gguf_type = getattr(self, "gguf_type", None)
        if gguf_type is not None:
            return f"gguf {gguf_blocks.type_name(gguf_type)}"
        name = str(self.weight.dtype).removeprefix("torch.")
        return f"{name} scaled" if "weight_scale" in self._buffers else name


def non_finite(transformer: torch.nn.Module) -> list[str]:
    """The loaded tensors that hold NaN or infinite values, by name: stored weights as they compute (upcast:
    a bad fp8 value, scale or GGUF block scale shows), the rest as they are; meta tensors (another PipeFusion
    stage's) skipped. One flag per tensor stays on the device; the host reads them once, at the end."""
    flags, names = [], []
    for name, module in transformer.named_modules():
        for leaf, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None or tensor.is_meta:
                continue
            if isinstance(module, StoredLinear) and leaf == "weight":
                if _local_rows(tensor)[0].numel() == 0:  # a shard left empty (fewer rows than ranks)
                    continue
                value = module.upcast_local(torch.float32)  # one layer's temporary at a time
            elif tensor.is_floating_point():
                value = _local_rows(tensor)[0]
            else:
                continue
            flags.append(torch.isfinite(value).all())
            names.append(f"{name}.{leaf}" if name else leaf)
    if not flags:
        return []
    return [names[i] for i in (~torch.stack(flags)).nonzero().flatten().tolist()]


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The rows of ``tensor`` this rank holds and the first one's index: all from 0, or a sharded parameter's
    (FSDP2's dim-0 shard: ⌈rows/S⌉ a rank)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    mesh = tensor.device_mesh
    return tensor.to_local(), mesh.get_local_rank() * math.ceil(tensor.shape[0] / mesh.size())


def _row_scale(scale: torch.Tensor, dims: int) -> torch.Tensor:
    """A scalar scale as it is, a per-row [rows] scale as [rows, 1, …] to broadcast over a weight."""
    return scale if scale.dim() == 0 else scale.reshape(-1, *([1] * (dims - 1)))


def place(module: torch.nn.Module, leaf: str, value, device: torch.device, dtype: torch.dtype,
          fp8: torch.dtype | None, stored: bool) -> torch.Tensor:
    """The tensor to put as ``module``'s ``leaf`` for a reader's ``value`` (a tensor, or Quantized).

    ``stored``: the weight may keep a storage form (a Linear's weight outside the float32 modules);
    ``fp8``: the request's weight_dtype for 16/32-bit weights (None: "default", the file's precision): Linear
    weights are stored in it, every other floating tensor is rounded through it and kept in ``dtype``, as
    ComfyUI's UNETLoader rounds every parameter of the model it builds in that dtype.
    A Linear given a storage form becomes a StoredLinear (its scale registered beside the weight);
    everything else comes back in ``dtype``, moved to ``device`` before it is cast."""
    linear = stored and leaf == "weight" and isinstance(module, torch.nn.Linear)
    if isinstance(value, Quantized):
        if not linear:  # a convolution's or a float32 module's: dequantized at load
            # its rows as read: all of them, or a rank's share (GGUF blocks are whole rows; ComfyUI's scaled fp8
            # scales Linear weights only, so a per-row scale never meets a share here)
            shape = torch.Size((value.data.shape[0], *module._parameters[leaf].shape[1:]))
            moved = Quantized(value.data.to(device), _moved(value.scale, device), value.gguf_type)
            if fp8 is None:
                return moved.dequantized(shape, dtype)
            return rounded_to(moved.dequantized(shape, torch.float32), fp8).to(dtype)
        data = value.data.to(device)
        _store(module, value.gguf_type)
        if value.scale is not None:
            scale = _row_scale(value.scale.to(device, torch.float32), 2)  # a scalar, or [out, 1]
            module.register_buffer("weight_scale", scale, persistent=False)
        return data
    tensor = value.to(device)  # moved first: a cast on the device, not on the host
    if not tensor.is_floating_point():
        return tensor
    if linear and tensor.dtype in FLOAT8:
        _store(module, None)
        return tensor
    if linear and fp8 is not None:
        _store(module, None)
        return rounded_to(tensor, fp8)
    if fp8 is not None:  # as ComfyUI, which builds the whole model in that fp8: biases, norms, embeddings rounded
        return rounded_to(tensor, fp8).to(dtype)
    return tensor.to(dtype)


def rounded_to(tensor: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``fp8``, saturated at its largest value (a plain cast overflows to NaN: e4m3fn has no
    infinity)."""
    limit = torch.finfo(fp8).max
    return tensor.to(torch.float32).clamp_(-limit, limit).to(fp8)


def _store(module: torch.nn.Linear, gguf_type: int | None) -> None:
    module.__class__ = StoredLinear
    if gguf_type is not None:
        module.gguf_type = gguf_type


def _moved(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def storage_dtype(transformer: torch.nn.Module, compute: torch.dtype) -> str:
    """What the model's Linear weights are stored in, by share of their values, largest first
    ("float8_e4m3fn", "float8_e4m3fn scaled+bfloat16", "gguf Q4_K+gguf Q8_0", "bfloat16"); the
    compute dtype's name when no Linear weight is loaded (a stage on meta)."""
    counts: dict[str, int] = {}
    for module in transformer.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.is_meta:
            stored = isinstance(module, StoredLinear)
            name = module.storage() if stored else str(module.weight.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + module.in_features * module.out_features
    if not counts:
        return str(compute).removeprefix("torch.")
    return "+".join(sorted(counts, key=lambda name: -counts[name]))


def check_fp8(device: torch.device, path: str) -> None:
    """Refuse, before loading, a device where float8 weights cannot be kept and upcast."""
    try:
        float8_round_trip(device)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise UserError(f"{path}: its weights are float8, which this torch cannot keep on {device} ({exc})",
                        "use a bf16 or fp16 file of the model (or a GGUF file) with weight_dtype default; "
                        "float8 needs torch ≥ 2.1 on CUDA or the CPU") from None


def float8_round_trip(device: torch.device) -> None:
    torch.zeros(2, dtype=torch.float8_e4m3fn, device=device).to(torch.float32)


@functools.lru_cache(maxsize=32)
def file_matrix_bytes(path: str, mtime_ns: int) -> tuple[int, int, int]:
    """How a model file's matrices (tensors of 2 or more dims) will be held once loaded, read from its
    header (the model cache's fit check, before loading): (bytes and values of those kept in their
    stored form — float8, GGUF blocks —, values of those cast to the compute dtype)."""
    kept_bytes = kept_values = cast_values = 0
    if gguf_blocks.is_gguf(path):
        for tensor in gguf_blocks.open_reader(path).tensors:
            if len(tensor.shape) < 2:
                continue
            if tensor.tensor_type.name in gguf_blocks.PLAIN:
                cast_values += int(tensor.n_elements)
            else:  # quantized blocks, as stored
                kept_bytes, kept_values = kept_bytes + int(tensor.n_bytes), kept_values + int(tensor.n_elements)
        return kept_bytes, kept_values, cast_values
    with safetensors_file.open_file(path) as handle:
        for key in handle.keys():
            view = handle.get_slice(key)
            if len(view.get_shape()) < 2:
                continue
            values = math.prod(view.get_shape())
            if view.get_dtype().startswith("F8"):
                kept_bytes, kept_values = kept_bytes + values, kept_values + values
            else:
                cast_values += values
    return kept_bytes, kept_values, cast_values
