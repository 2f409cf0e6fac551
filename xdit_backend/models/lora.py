"""LoRA files merged into a model's weights at load: W += strength · (B·A) · (alpha / rank).

Key layouts accepted, as ComfyUI users have them (Flux shown; every family the same way):
- diffusers / PEFT: ``[transformer.]transformer_blocks.0.attn.to_q.lora_A.weight`` / ``lora_B``;
- ComfyUI: the original names, ``diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight``;
- kohya (sd-scripts): ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` / ``lora_up`` / ``alpha``.
A LoRA on a fused original tensor (qkv, linear1) lands on the diffusers rows it covers, through
the family's table the checkpoint loader uses (``<family>_checkpoint.sources``). The file is read
on the CPU; each module's B·A is computed in float32 on the device of the weight it is added to.
Keys that match nothing are reported, never dropped silently. Weights still on the meta device
belong to another PipeFusion stage: they count as matched and are left to the stage that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import UserError
from . import storage
from .checkpoint import Source

_DOWN = ("lora_A.weight", "lora_down.weight")
_UP = ("lora_B.weight", "lora_up.weight")
_PREFIXES = ("base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model.", "lora_unet_")


@dataclass(frozen=True)
class LoraSpec:
    path: str
    strength: float


def merge(transformer, loras: list[LoraSpec], table: dict[str, Source]) -> list[dict]:
    """Merge every LoRA into ``transformer`` in place; ``table``: the original source of each of its
    state_dict keys (without a file prefix). Returns one report per file."""
    params = dict(transformer.named_parameters())
    by_original: dict[str, list[tuple[str, Source]]] = {}
    for key, source in table.items():
        if key in params:
            by_original.setdefault(source.key.removesuffix(".weight"), []).append((key, source))
    kohya = {name.replace(".", "_"): name for name in by_original}
    return [_merge_one(transformer, params, by_original, kohya, lora) for lora in loras]


def _merge_one(transformer, params, by_original, kohya, lora: LoraSpec) -> dict:
    try:
        tensors = load_file(lora.path)
    except Exception as exc:
        raise UserError(f"LoRA {lora.path} is not a readable safetensors file ({exc})",
                        "check the path and the file (an interrupted download?)") from None
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        for suffix in (*_DOWN, *_UP, "alpha"):
            if key.endswith("." + suffix):
                modules.setdefault(key[: -len(suffix) - 1], {})[suffix] = tensor
                break
        else:
            modules.setdefault(key, {})["unknown"] = tensor
    merged, unmatched = 0, []
    for module, parts in modules.items():
        down = next((parts[k] for k in _DOWN if k in parts), None)
        up = next((parts[k] for k in _UP if k in parts), None)
        targets = _targets(_strip(module), params, by_original, kohya)
        if down is None or up is None or not targets:
            unmatched.append(module)
            continue
        rank = down.shape[0]
        scale = float(parts["alpha"]) / rank if "alpha" in parts else 1.0
        delta = None
        for key, source in targets:
            weight = params[key]
            if weight.is_meta:  # another PipeFusion stage's block
                continue
            if delta is None:  # [out, in] in the target's layout, float32, on the weight's device (a GPU's)
                up, down = up.to(weight.device, torch.float32), down.to(weight.device, torch.float32)
                delta = (up @ down) * scale * lora.strength
            part = source.select(delta) if source else delta
            owner = transformer.get_submodule(key.rpartition(".")[0])
            if part.shape != storage.weight_shape(owner):
                unmatched.append(module)
                break
            with torch.no_grad():  # in the weight's storage form (float8 re-rounded with its scale)
                storage.add_to_weight(owner, part)
        else:
            merged += 1
    return {"file": lora.path, "strength": lora.strength, "merged_modules": merged,
            "unmatched_keys": len(unmatched), "unmatched_examples": unmatched[:5]}


def _strip(module: str) -> str:
    for prefix in _PREFIXES:
        module = module.removeprefix(prefix)
    return module


def _targets(module: str, params, by_original, kohya):
    """(diffusers key, original source or None) pairs the LoRA module writes to."""
    if f"{module}.weight" in params:  # diffusers / PEFT names
        return [(f"{module}.weight", None)]
    original = module if module in by_original else kohya.get(module)
    return by_original.get(original, []) if original else []


def parse(entries: list) -> list[LoraSpec]:
    """LoRA entries of a request, checked: [{"path": str, "strength": number}, …] (at most 16)."""
    if not isinstance(entries, list) or len(entries) > 16:
        raise UserError("loras must be a list of at most 16 {path, strength} entries")
    specs = []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"path", "strength"} or not isinstance(entry.get("path"), str):
            raise UserError(f"LoRA entry {entry!r} must hold a path and, optionally, a strength",
                            'e.g. {"path": "models/loras/style.safetensors", "strength": 0.8}')
        strength = entry.get("strength", 1.0)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not -10 <= strength <= 10:
            raise UserError(f"LoRA strength {strength!r} must be a number in -10..10")
        path = Path(entry["path"]).expanduser()
        if not path.is_file():
            raise UserError(f"no LoRA file at {entry['path']}", "ComfyUI keeps them in models/loras")
        specs.append(LoraSpec(str(path.resolve()), float(strength)))
    return specs


def identity(loras: list[LoraSpec]) -> tuple:
    """The LoRA part of a model's cache key: each file's version and strength."""
    return tuple((lora.path, Path(lora.path).stat().st_mtime_ns, lora.strength) for lora in loras)
