"""LoRA files carried as patches on the one resident base, unmerged: a target Linear's output gets
y += s·(α/r)·(x·Aᵀ)·Bᵀ from a forward hook, and its weight is never touched.

Why unmerged (docs/benchmarks.md has the measurements): it works the same on every base, whatever
its weights are stored as (bf16, fp8, GGUF blocks, FSDP2 shards: the hook sees only the module's
input and output); a strength change is one scalar per file, written in place; removing a LoRA
removes its hooks, so the base gives its own result exactly; and the device holds only the LoRA's
own tensors next to the base, never a second copy of a weight.

Key layouts accepted, as ComfyUI users have them (Flux shown; every family the same way):
- diffusers / PEFT: ``[transformer.]transformer_blocks.0.attn.to_q.lora_A.weight`` / ``lora_B``;
- ComfyUI: the original names, ``diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight``;
- kohya (sd-scripts): ``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`` / ``lora_up`` / ``alpha``.
A LoRA on a fused original tensor (qkv, linear1) lands on the diffusers modules it covers, each
taking its band of B's rows through the family's table the checkpoint loader uses
(``<family>_checkpoint.sources``): (B·A)[rows] = B[rows]·A. Keys that match nothing are reported,
never dropped silently. Modules whose weight was on the meta device when the base was built belong
to another PipeFusion stage: they count as matched and are left to the stage that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import UserError
from .checkpoint import TensorSource
from .file_kind import file_entries

_DOWN = ("lora_A.weight", "lora_down.weight")
_UP = ("lora_B.weight", "lora_up.weight")
_PREFIXES = ("base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model.", "lora_unet_")


@dataclass(frozen=True)
class LoraSpec:
    path: str
    strength: float


@dataclass(frozen=True)
class Pair:
    """One LoRA module of a file: A [r, in], B [out, r] (read: on the CPU as stored; kept: on the device in the
    compute dtype); α/r."""

    down: torch.Tensor
    up: torch.Tensor
    scale: float


class LoraFiles:
    """The LoRA files' tensors on this rank's device, read once per (path, file version, dtype) and
    kept while a loaded model carries them (``keep_only``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.files: dict[tuple, dict[str, Pair | None]] = {}  # (path, mtime, dtype) → module → pair (None: unusable)

    def modules(self, path: str, dtype: torch.dtype) -> dict[str, Pair | None]:
        key = (path, version(path), dtype)
        if key not in self.files:
            self.files[key] = self._read(path, dtype)
        return self.files[key]

    def _read(self, path: str, dtype: torch.dtype) -> dict[str, Pair | None]:
        return {module: None if pair is None else Pair(pair.down.to(self.device, dtype), pair.up.to(self.device, dtype),
                                                       pair.scale)
                for module, pair in read_pairs(path).items()}

    def keep_only(self, in_use: set[tuple]) -> None:
        """Drop the files no loaded model carries; ``in_use``: (path, mtime, dtype) keys."""
        self.files = {key: modules for key, modules in self.files.items() if key in in_use}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for modules in self.files.values() for pair in modules.values()
                   if pair is not None for t in (pair.down, pair.up))


class Patches:
    """The LoRAs one transformer carries, as forward hooks on its Linear modules.

    Built with the base, before a PipeFusion stage drops the other blocks: the names are resolved to
    modules then (a stage renumbers its blocks). ``table``: the original source of each state-dict
    key (the family's converter), for LoRAs in the original or kohya names.
    """

    def __init__(self, transformer: torch.nn.Module, table: dict[str, TensorSource], dtype: torch.dtype):
        self.dtype = dtype  # the compute dtype: what the hooks' input is, and the LoRA tensors are cast to
        modules = dict(transformer.named_modules())
        params = dict(transformer.named_parameters())
        self.modules = {name: module for name, module in modules.items() if isinstance(module, torch.nn.Linear)}
        self.elsewhere = {name for name, module in self.modules.items() if module.weight.is_meta}
        self.by_original: dict[str, list[tuple[str, TensorSource]]] = {}
        for key, source in table.items():
            if key in params and key.endswith(".weight"):
                self.by_original.setdefault(source.key.removesuffix(".weight"), []).append(
                    (key.removesuffix(".weight"), source))
        self.kohya = {name.replace(".", "_"): name for name in self.by_original}
        self.carried: tuple = ()  # the (path, mtime, dtype) of each LoRA attached, in order
        self.strengths: list[torch.Tensor] = []  # one 0-dim tensor per LoRA: a strength change writes it
        self.handles: list = []
        self.reports: list[dict] = []

    def carry(self, loras: list[LoraSpec], files: LoraFiles) -> list[dict]:
        """Make the transformer carry exactly ``loras``: the same files at new strengths are a write of
        each strength; other files replace the hooks. Returns one report per file."""
        wanted = tuple((lora.path, version(lora.path), self.dtype) for lora in loras)
        if wanted != self.carried:
            self.detach()
            self._attach(loras, files)
            self.carried = wanted
        with torch.no_grad():
            for strength, lora in zip(self.strengths, loras):
                strength.fill_(lora.strength)
        self.reports = [{**report, "strength": lora.strength} for report, lora in zip(self.reports, loras)]
        return self.reports

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.carried, self.strengths, self.handles, self.reports = (), [], [], []

    def _attach(self, loras: list[LoraSpec], files: LoraFiles) -> None:
        adapters: dict[str, list] = {}  # module name → [(A, B rows, α/r, strength)]
        for lora in loras:
            strength = torch.zeros((), device=files.device)  # float32; carry() writes the value
            self.strengths.append(strength)
            merged, unmatched = 0, []
            for module, pair in files.modules(lora.path, self.dtype).items():
                targets = self._targets(_strip(module)) if pair is not None else []
                if not targets:
                    unmatched.append(module)
                    continue
                found = self._bands(pair, targets)
                if isinstance(found, str):
                    raise UserError(f"LoRA {lora.path}: {module} does not fit the layer it names: {found}",
                                    "use a LoRA made for this model (its variant and size)")
                for name, up in found:
                    adapters.setdefault(name, []).append((pair.down, up, pair.scale, strength))
                merged += 1
            self.reports.append({"file": lora.path, "strength": lora.strength, "merged_modules": merged,
                                 "unmatched_keys": len(unmatched), "unmatched_examples": unmatched[:5]})
        self.handles = [self.modules[name].register_forward_hook(_low_rank_addition(pairs))
                        for name, pairs in adapters.items()]

    def _targets(self, module: str) -> list[tuple[str, TensorSource | None]]:
        """(diffusers module, original source or None) pairs the LoRA module writes to."""
        if module in self.modules:  # diffusers / PEFT names
            return [(module, None)]
        original = module if module in self.by_original else self.kohya.get(module)
        return [(name, source) for name, source in self.by_original.get(original, []) if name in self.modules]

    def _bands(self, pair: Pair, targets) -> list[tuple[str, torch.Tensor]] | str:
        """Each held target's rows of B (a view of the rows), or what does not fit when a shape does not."""
        found = []
        for name, source in targets:
            if name in self.elsewhere:  # another PipeFusion stage's block
                continue
            linear = self.modules[name]
            up = source.select(pair.up) if source else pair.up  # [out of this target, r] (fewer: B is too short)
            if up.shape[0] != linear.out_features or pair.down.shape[1] != linear.in_features:
                return (f"A is {list(pair.down.shape)} and B {list(pair.up.shape)}, and {name} is a Linear of "
                        f"{linear.in_features} inputs and {linear.out_features} outputs"
                        + (f" (rows {source.rows[0]}–{source.rows[1]} of the fused {source.key})" if source and
                           source.rows else ""))
            found.append((name, up))
        return found


def read_pairs(path: str) -> dict[str, Pair | None]:
    """A LoRA file's modules as pairs on the CPU, as stored, each checked (``_check_pair``): module → Pair, or
    None for a module that is not an A/B pair (reported as matching nothing)."""
    try:
        tensors = load_file(path)
    except Exception as exc:
        raise UserError(f"LoRA {path} is not a readable safetensors file ({exc})",
                        "check the path and the file (an interrupted download?)") from None
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        suffix = next((s for s in (*_DOWN, *_UP, "alpha") if key.endswith("." + s)), None)
        module = key[: -len(suffix) - 1] if suffix else key
        parts.setdefault(module, {})[suffix or "unknown"] = tensor
    modules: dict[str, Pair | None] = {}
    for module, found in parts.items():
        down = next((found[k] for k in _DOWN if k in found), None)  # A: [r, in]
        up = next((found[k] for k in _UP if k in found), None)  # B: [out, r]
        if down is None or up is None or down.dim() != 2 or up.dim() != 2:
            modules[module] = None
            continue
        _check_pair(path, module, down, up, found.get("alpha"))
        scale = float(found["alpha"]) / down.shape[0] if "alpha" in found else 1.0
        modules[module] = Pair(down, up, scale)
    return modules


def _check_pair(path: str, module: str, down: torch.Tensor, up: torch.Tensor, alpha: torch.Tensor | None) -> None:
    """A LoRA module's own tensors agree: A [r, in] and B [out, r] of one rank r ≥ 1, alpha one number, all finite
    (read once per file version, on the CPU)."""
    where = f"LoRA {path}: {module}"
    hint = "the file is malformed or not a LoRA: re-download or re-export it"
    if down.shape[0] < 1 or down.shape[0] != up.shape[1]:
        raise UserError(f"{where}: A is {list(down.shape)} and B {list(up.shape)}; a LoRA's A is [rank, inputs] and "
                        "B [outputs, rank], of the same rank of at least 1", hint)
    if alpha is not None and alpha.numel() != 1:
        raise UserError(f"{where}: alpha has {alpha.numel()} values (shape {list(alpha.shape)}); it is one number", hint)
    for name, tensor in (("A", down), ("B", up), ("alpha", alpha)):
        if tensor is not None and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(f"{where}: {name} holds {bad} NaN or infinite values of {tensor.numel()}", hint)


def _low_rank_addition(pairs: list):
    """A forward hook adding Σ s·(α/r)·(x·Aᵀ)·Bᵀ to a Linear's output. x: [..., in]; x·Aᵀ: [..., r];
    then ·Bᵀ: [..., out]. The strength is a 0-dim device tensor: changing it recompiles nothing."""

    def hook(module, args, output):
        x = args[0]
        for down, up, scale, strength in pairs:
            output = output + ((x @ down.T) * (strength * scale)) @ up.T
        return output

    return hook


def version(path: str) -> int:
    return Path(path).stat().st_mtime_ns


def _strip(module: str) -> str:
    for prefix in _PREFIXES:
        module = module.removeprefix(prefix)
    return module


def parse(entries: list) -> list[LoraSpec]:
    """LoRA entries of a request, checked: [{"path": str, "strength": number}, …] (at most 16)."""
    return [LoraSpec(path, strength) for path, strength in file_entries(
        entries, "LoRA", 16, {"path": "models/loras/style.safetensors", "strength": 0.8}, "models/loras")]
