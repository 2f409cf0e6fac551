"""GGUF's block codec and file opening: what the storage layer needs to keep a GGUF matrix as its raw
blocks, dequantize it and size a file, apart from the reader that maps a file onto a model (gguf_file.py).

The ``gguf`` package is an optional extra (``pip install 'comfyui-xdit[gguf]'``). The blocks are dequantized on
their device by torch code: the types city96's Flux, Wan and Qwen files use (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
Q5_K, Q6_K) by the kernels below, the rarer ones by diffusers' GGUF kernels. Ours make no tensor from host data:
diffusers' build their shift tables with ``torch.tensor([...], device=…)`` in every call, a blocking host→device
copy, so 1–3 host synchronisations per Linear per forward on a GPU (review gpu-paths-2 B8); here the bit fields
come out with shifts and masks by Python integers. Each kernel takes the blocks [n, bytes per block] (uint8) and
gives their values [n, values per block] in float32, in GGML's order (ggml-quants.c, dequantize_row_*).
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
    """diffusers' GGUF kernels, by GGML type (int): every type the backend reads (ours, KERNELS, are among them)."""
    from diffusers.quantizers.gguf.utils import dequantize_functions

    return dequantize_functions


def dequantize(data: torch.Tensor, gguf_type: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Raw GGML blocks (uint8 [rows, bytes per row], on any device) → the tensor ``shape`` in ``dtype``."""
    block_size, type_size = gguf_package().GGML_QUANT_SIZES[gguf_type]
    blocks = data.reshape(-1, type_size)  # [blocks, bytes per block]
    kernel = KERNELS.get(type_name(gguf_type))
    if kernel is None:  # a rarer type: diffusers' kernel
        values = dequantizers()[gguf_type](blocks, block_size, type_size, torch.float32)
    else:
        values = kernel(blocks)  # [blocks, values per block], float32
    return values.reshape(shape).to(dtype)


def type_name(gguf_type: int) -> str:
    return gguf_package().GGMLQuantizationType(gguf_type).name


# --------------------------------------------------------------------------- kernels (no host data)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes [start, start + 2) of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """``packed`` uint8 [..., k] → its ``width``-bit fields [..., 8 // width, k], the lowest bits first."""
    mask = (1 << width) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, width)], dim=-2)


def _nibbles_halves(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0-style packing: byte j holds value j (low nibble) and value j + 16 (high): [n, 16] → [n, 32]."""
    return _bits(qs, 4).flatten(-2)


def _high_bits_32(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1's fifth bits: a little-endian uint32 [n, 4 bytes] → bit j of value j, [n, 32]."""
    return _bits(qh, 1).transpose(-1, -2).flatten(-2)  # [n, 8 bits, 4 bytes] → [n, 4 bytes, 8 bits] → [n, 32]


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """34 bytes: d (f16), 32 int8: d · q."""
    return _half(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """18 bytes: d, 16 bytes of nibbles: d · (q − 8)."""
    return _half(blocks, 0) * (_nibbles_halves(blocks[:, 2:]).float() - 8)


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """20 bytes: d, m, 16 bytes of nibbles: d · q + m."""
    return _half(blocks, 0) * _nibbles_halves(blocks[:, 4:]).float() + _half(blocks, 2)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """22 bytes: d, 4 bytes of fifth bits, 16 bytes of nibbles: d · (q − 16)."""
    q = _nibbles_halves(blocks[:, 6:]) | (_high_bits_32(blocks[:, 2:6]) << 4)  # [n, 32]
    return _half(blocks, 0) * (q.float() - 16)


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """24 bytes: d, m, 4 bytes of fifth bits, 16 bytes of nibbles: d · q + m."""
    q = _nibbles_halves(blocks[:, 8:]) | (_high_bits_32(blocks[:, 4:8]) << 4)  # [n, 32]
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes → the eight sub-blocks' 6-bit scales and mins, float32 [n, 8] each.
    Bytes 0–3: scales 0–3 (low 6 bits), 4–7: mins 0–3; bytes 8–11 hold the low 4 bits of scales 4–7 and
    their mins in the high 4, whose top 2 bits are the top 2 bits of bytes 0–3 (scales) and 4–7 (mins)."""
    first, second, third = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # [n, 4] each
    scales = torch.cat([first & 63, (third & 15) | ((first >> 6) << 4)], dim=1)
    mins = torch.cat([second & 63, (third >> 4) | ((second >> 6) << 4)], dim=1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """K-quant nibbles: each 32 bytes hold two sub-blocks of 32 (low nibbles first): [n, 128] → [n, 8, 32]."""
    return _bits(qs.unflatten(1, (4, 32)), 4).flatten(1, 2)  # [n, 4, 2, 32] → [n, 8, 32]


def _k_apply(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """d · scale · q − dmin · min per sub-block: q [n, 8, 32] → [n, 256]."""
    scales, mins = _k_scales(blocks[:, 4:16])
    d, dmin = _half(blocks, 0) * scales, _half(blocks, 2) * mins  # [n, 8]
    return (d.unsqueeze(-1) * q.float() - dmin.unsqueeze(-1)).flatten(1)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """144 bytes: d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles: 256 values in 8 sub-blocks."""
    return _k_apply(blocks, _k_nibbles(blocks[:, 16:]))


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """176 bytes: d, dmin, 12 bytes of scales and mins, 32 bytes of fifth bits (bit k of byte l: value l of
    sub-block k), 128 bytes of nibbles."""
    high = _bits(blocks[:, 16:48], 1)  # [n, 8 sub-blocks, 32]
    return _k_apply(blocks, _k_nibbles(blocks[:, 48:]) | (high << 4))


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values), d.
    Each half of 128 values: 64 low-nibble bytes (values l and l + 32 low, l + 64 and l + 96 high) and 32
    bytes whose 2-bit fields 0–3 go to values l, l + 32, l + 64, l + 96."""
    low = _bits(blocks[:, :128].unflatten(1, (2, 2, 32)), 4)  # [n, 2 halves, 2 chunks, 2 nibbles, 32]
    low = low.transpose(2, 3).flatten(2, 3)  # [n, 2, 4 quarters (nibble, chunk), 32]
    high = _bits(blocks[:, 128:192].unflatten(1, (2, 32)), 2)  # [n, 2 halves, 4 quarters, 32]
    q = (low | (high << 4)).flatten(1).float() - 32  # [n, 256]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = _half(blocks, 208) * scales  # [n, 16]
    return (d.unsqueeze(-1) * q.unflatten(1, (16, 16))).flatten(1)


KERNELS = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
           "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}  # GGML type name → kernel
