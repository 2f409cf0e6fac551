"""Model files written from a built-in model's weights, in the single-file layouts users keep: fp8, ComfyUI's
scaled fp8, GGUF Q8_0 and a K-quant; each writer returns the tensors as the file's values dequantise, float32,
the reference a loaded model is compared with (the selftest's storage and syncs sections, and the tests).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models import registry

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


def family_table(name: str, keys) -> dict:
    """Each diffusers key's source in the family's original layout (checkpoint.TensorSource)."""
    source = registry.resolve(name)
    return registry.FAMILIES[source.family].checkpoint.sources(keys, "", source.config)


def original_layout(state: dict[str, torch.Tensor], table: dict) -> dict[str, torch.Tensor]:
    """A diffusers state dict in the original key layout single files hold: the family's table read
    backwards, a fused tensor (Flux's qkv) put together from its bands (``convert`` undoes itself)."""
    bands: dict[str, list] = {}
    for key, source in table.items():
        bands.setdefault(source.key, []).append(((source.rows or (0, 0))[0], source.convert(state[key])))
    return {key: torch.cat([t for _, t in sorted(parts, key=lambda part: part[0])]) for key, parts in bands.items()}


def _matrix(key: str, value: torch.Tensor) -> bool:
    return value.dim() == 2 and key.endswith(".weight")


def fp8_file(original: dict, path: Path) -> dict[str, torch.Tensor]:
    """Matrices in float8_e4m3fn, the rest bf16; returns the values written, float32 (the reference)."""
    stored = {k: v.to(FP8) if _matrix(k, v) else v.to(BF16) for k, v in original.items()}
    save_file(stored, str(path))
    return {k: v.float() for k, v in stored.items()}


def scaled_fp8_file(original: dict, path: Path) -> dict[str, torch.Tensor]:
    """ComfyUI's scaled fp8: each matrix / scale in float8_e4m3fn with scale = absmax / 448 beside it
    (``scale_weight``), the ``scaled_fp8`` marker, the rest bf16; returns float8 × scale, float32."""
    stored, reference = {"scaled_fp8": torch.empty(0, dtype=FP8)}, {}
    for key, value in original.items():
        if not _matrix(key, value):
            stored[key] = value.to(BF16)
            reference[key] = stored[key].float()
            continue
        scale = (value.abs().max() / torch.finfo(FP8).max).float()  # 0-dim
        stored[key], stored[key.removesuffix("weight") + "scale_weight"] = (value / scale).to(FP8), scale
        reference[key] = stored[key].float() * scale
    save_file(stored, str(path))
    return reference


K_QUANT_SCALE = 2e-5  # the random K-quant blocks' d and dmin: values within about ±0.02, as a random-init model's


def k_quant_blocks(rows: int, columns: int, kind, generator: torch.Generator, scale: float = K_QUANT_SCALE):
    """Random blocks of a K-quant type (gguf.GGMLQuantizationType; the gguf package cannot quantize these)
    [rows, bytes per row], numpy uint8, their float16 super-block scales finite: d and dmin first (Q4_K,
    Q5_K), d last (Q6_K), each in [scale, 2 · scale)."""
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[kind]
    raw = torch.randint(0, 256, (rows, columns // values, size), generator=generator, dtype=torch.uint8)
    scales = ((torch.rand(rows, columns // values, 2, generator=generator) + 1) * scale).half().view(torch.uint8)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        raw[..., size - 2:] = scales[..., :2]
    else:
        raw[..., :4] = scales
    return raw.reshape(rows, -1).numpy()


def gguf_file(original: dict, path: Path, kind: str = "Q8_0", plain=None,
              metadata: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """A GGUF file in city96's layout: matrices whose rows are whole blocks in ``kind`` (Q8_0 and the other legacy
    types: the gguf package's quantizer; a K-quant: random blocks, k_quant_blocks), the rest F32, as are the tensors
    ``plain(key, value)`` names (by default every one that is not a matrix), and ``metadata``'s strings (LTX-2's
    ``config``); returns what the gguf package dequantises, float32."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="flux")
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, text in (metadata or {}).items():
        writer.add_string(name, text)
    chosen = gguf.GGMLQuantizationType[kind]
    reference, block = {}, gguf.GGML_QUANT_SIZES[chosen][0]
    generator = torch.Generator().manual_seed(0)
    for key, value in original.items():
        data = value.float().numpy()
        kept_plain = plain(key, value) if plain else not _matrix(key, value)
        written = gguf.GGMLQuantizationType.F32 if kept_plain or data.shape[-1] % block else chosen
        if written == chosen and kind.endswith("_K"):
            stored = k_quant_blocks(*data.shape, chosen, generator)
        else:
            stored = gguf.quants.quantize(data, written)
        writer.add_tensor(key, stored, raw_dtype=written)
        reference[key] = torch.from_numpy(gguf.quants.dequantize(stored, written).copy()).reshape(value.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


FILES = {"fp8": (fp8_file, "safetensors"), "scaled_fp8": (scaled_fp8_file, "safetensors"),
         "gguf_q8_0": (gguf_file, "gguf"),  # the K-quant kernel (models/gguf_blocks.py), on random blocks:
         "gguf_q4_k": (functools.partial(gguf_file, kind="Q4_K"), "gguf")}


def written(name: str, form: str, directory: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The built-in ``name``'s weights written as ``form`` (a FILES key) into ``directory``: the file and its
    dequantised values (in the original layout's keys)."""
    state = registry.build(name, torch.device("cpu")).transformer.state_dict()
    original = original_layout({key: value.float() for key, value in state.items()}, family_table(name, state.keys()))
    write, suffix = FILES[form]
    path = directory / f"{name}-{form}.{suffix}"
    return path, write(original, path)
