"""A transformer's weights put on its device one tensor at a time.

The transformer is constructed with its parameters on the meta device (nothing allocated, nothing
initialised); then each state-dict tensor is drawn (a built-in's seeded random weights) or read (a
single file, a diffusers folder), moved to the device, cast there, and put in place of its meta
stand-in. The host holds one tensor at a time (one module's, for drawn weights) and the device one
copy in the compute dtype: no whole state dict on the CPU, no random float32 initialisation before
a file's weights replace it. A PipeFusion stage gets only its own blocks' tensors; the others stay
on meta for the caller to drop.

One generator policy for built-ins: each module's parameters are drawn in float32 on the CPU by its
own ``reset_parameters``, under the CPU generator seeded from (the built-in's seed, the module's
name). So every device, every process and every PipeFusion stage gets the same bits, and a lower
precision is the same model rounded. Parameters of modules that cannot redraw them (no
``reset_parameters``: Wan's and PixArt's ``scale_shift_table``, diffusers' RMSNorm) keep what the
constructor drew on the CPU from the built-in's seed: small tables, and the whole model is always
constructed (a stage is pruned afterwards), so a stage's values are the whole model's.

dtypes: floating tensors take the compute dtype, except those under the family's
``_keep_in_fp32_modules`` (Wan: time embedder, modulation tables, norms), which stay float32 as
diffusers' ``from_pretrained`` keeps them, and Linear weights kept in their storage precision
(float8, scaled float8, GGUF blocks; storage.py), upcast one layer at a time at compute. Buffers the constructor computes and no file holds (RoPE
tables, PixArt's position embedding) keep the dtype it gave them; they only move to the device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from . import storage
from .checkpoint import empty_weights


def construct(cls, config: dict, seed: int | None = None):
    """``cls(**config)`` with meta parameters and real buffers, on the CPU. With ``seed`` (a
    built-in), the parameters no ``reset_parameters`` can redraw are kept as drawn from it."""
    if seed is None:
        with torch.device("cpu"), empty_weights():
            return cls(**config)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"), empty_weights(keep=_cannot_redraw):
        torch.default_generator.manual_seed(seed)  # the CPU generator only: no device's state is touched
        return cls(**config)


def _cannot_redraw(module: torch.nn.Module) -> bool:
    return not callable(getattr(module, "reset_parameters", None))


def drawn(transformer: torch.nn.Module, seed: int,
          device: torch.device = torch.device("cpu")) -> Callable[[str], torch.Tensor]:
    """The tensor of a state-dict key of a built-in constructed with ``construct(…, seed)``: its
    module's parameters are drawn, on first use, in float32 on ``device`` (the CPU: the same model on
    every device) from (seed, module name)."""
    modules = dict(transformer.named_modules())

    def tensor_of(key: str) -> torch.Tensor:
        owner, _, leaf = key.rpartition(".")
        module = modules[owner]
        tensor = module._parameters[leaf] if leaf in module._parameters else module._buffers[leaf]
        if tensor.is_meta:
            _redraw(module, _module_seed(seed, owner), device)
            tensor = module._parameters[leaf]
        return tensor

    return tensor_of


def _module_seed(seed: int, name: str) -> int:
    """A 63-bit seed for one module: the same in every process (unlike Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _redraw(module: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Allocate ``module``'s meta parameters on ``device`` in float32 and let the module initialise them
    (from ``device``'s default generator, seeded)."""
    for name, param in module._parameters.items():
        if param is not None and param.is_meta:
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=torch.float32, device=device), requires_grad=param.requires_grad)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device's, which fork_rng restores
        module.reset_parameters()


class BlockSharding(Protocol):
    """How a rank holds a block's parameters when the blocks are sharded (parallel/shard.py): which rows of a
    parameter it reads, and what makes the block sharded once those rows are in."""

    def rows(self, length: int) -> tuple[int, int]:
        """[start, stop) of a parameter's ``length`` dim-0 rows that this rank keeps."""

    def shard(self, block: torch.nn.Module, parts: dict[str, torch.Tensor]) -> None:
        """Shard ``block``, whose parameters are meta stand-ins of their whole shape in their storage dtype,
        with ``parts``: this rank's rows of each, by parameter name within the block, on the device."""


def put(transformer: torch.nn.Module, keys: Iterable[str], tensor_of: Callable[..., object],
        device: torch.device, dtype: torch.dtype, fp8: torch.dtype | None = None,
        sharded: tuple[BlockSharding, dict[str, torch.nn.Module]] | None = None) -> None:
    """Give each state-dict key in ``keys`` its tensor ``tensor_of(key)`` (from anywhere: a CPU
    slice of a file, a drawn module; or a storage.Quantized weight), moved to ``device`` and cast
    there, one key at a time; then move the buffers no key covers (computed at construction) to
    ``device``, in their own dtype. Linear weights keep their storage form (float8, GGUF blocks;
    ``fp8``: 16/32-bit ones stored in that float8): storage.place.

    ``sharded`` = (sharding, the blocks by state-dict prefix): a block's parameters are read only in this
    rank's rows (``tensor_of(key, part)``) and the block is sharded once they are all in; the host holds
    one tensor's share at a time, the device the shards and the layers outside the blocks."""
    modules = dict(transformer.named_modules())
    kept_float32 = frozenset(getattr(type(transformer), "_keep_in_fp32_modules", None) or ())
    sharding, blocks = sharded or (None, {})
    by_block: dict[str, list[str]] = {prefix: [] for prefix in blocks}
    with torch.no_grad():  # weights, not a computation to differentiate
        for key in keys:
            prefix = ".".join(key.split(".")[:2])
            if prefix in by_block:
                by_block[prefix].append(key)  # once its block's turn comes
                continue
            _put_one(modules, key, tensor_of(key), device, dtype, fp8, kept_float32)
        for prefix, block_keys in by_block.items():
            parts = {}
            for key in block_keys:
                owner, _, leaf = key.rpartition(".")
                whole = modules[owner]._parameters.get(leaf)
                if whole is None:  # a buffer: whole on every rank
                    _put_one(modules, key, tensor_of(key), device, dtype, fp8, kept_float32)
                    continue
                part = sharding.rows(whole.shape[0])
                local = _put_one(modules, key, tensor_of(key, part), device, dtype, fp8, kept_float32)
                parts[key.removeprefix(prefix + ".")] = local
                stand_in = torch.empty((whole.shape[0], *local.shape[1:]), dtype=local.dtype, device="meta")
                _replace(modules[owner], leaf, stand_in)  # the whole shape, in the storage form, on meta
            sharding.shard(blocks[prefix], parts)
        for module in modules.values():
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = buffer.to(device)


def _put_one(modules: dict, key: str, value, device: torch.device, dtype: torch.dtype, fp8: torch.dtype | None,
             kept_float32: frozenset) -> torch.Tensor:
    """Put one key's ``value`` (storage.place: moved, cast or kept in its storage form) in its module; returns it."""
    owner, _, leaf = key.rpartition(".")
    float32 = bool(kept_float32.intersection(key.split(".")))
    tensor = storage.place(modules[owner], leaf, value, device, torch.float32 if float32 else dtype, fp8,
                           stored=not float32)
    _replace(modules[owner], leaf, tensor)
    return tensor


def _replace(module: torch.nn.Module, leaf: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in place of ``module``'s parameter or buffer ``leaf``; the old one is released."""
    if leaf in module._parameters:
        requires_grad = module._parameters[leaf].requires_grad and tensor.is_floating_point()
        module._parameters[leaf] = torch.nn.Parameter(tensor.detach(), requires_grad=requires_grad)
    else:
        module._buffers[leaf] = tensor
