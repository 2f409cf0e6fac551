"""The models a rank holds: one resident base per file version, precision, sharding and stage, kept in
least-recently-used order.

LoRAs and compilation are not part of a model's identity: they are patches and alternative forwards
on the same weights (models/lora.py, compile.py), so a strength change or ``compile`` never loads
or copies a model.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..parallel import shard


@dataclass(frozen=True)
class ModelKey:
    """What makes two loaded models different weights."""

    name: str  # a built-in's name or the file's resolved path
    version: int  # the file's modification time (0 for a built-in): a changed file is a new model
    compute_dtype: str  # "bfloat16", "float32", …
    weight_dtype: str = "default"  # storage precision asked for ("default": the file's own)
    shard_ranks: tuple[int, ...] = ()  # the ranks its blocks are FSDP2-sharded over (parallel/shard.py); (): whole
    stage: tuple[int, int] | None = None  # a PipeFusion stage's [start, end) blocks; None: all of them

    def describe(self, *state: str) -> str:
        """One line: the name, then its precision, sharding and stage, then ``state`` (its LoRAs, compiled)."""
        parts = [self.compute_dtype]
        if self.weight_dtype != "default":
            parts.append(f"stored {self.weight_dtype}")
        if self.shard_ranks:
            parts.append(f"sharded {len(self.shard_ranks)} ways")
        if self.stage is not None:
            parts.append(f"blocks {self.stage[0]}–{self.stage[1] - 1}")
        parts.extend(state)
        return f"{self.name} ({', '.join(parts)})"


@dataclass
class Entry:
    model: object  # models.base.DiffusionModel
    bytes: int  # resident_bytes(model), measured once loaded: a LoRA's tensors are held apart
    # (Executor.lora_files) and a model sharded over a rebuilt mesh is a new entry, so it never changes;
    # summing every parameter again for each request's memory record cost ~10 % of a small request's CPU
    blocks: list | None = None  # a PipeFusion stage's blocks, in execution order


class ModelCache:
    """Loaded models by key, the most recently used last."""

    def __init__(self):
        self.entries: OrderedDict[ModelKey, Entry] = OrderedDict()

    def get(self, key: ModelKey) -> Entry | None:
        entry = self.entries.get(key)
        if entry is not None:
            self.entries.move_to_end(key)
        return entry

    def put(self, key: ModelKey, entry: Entry) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)

    def drop(self, keys) -> None:
        for key in list(keys):
            self.entries.pop(key, None)

    def least_recent_first(self) -> list[ModelKey]:
        return list(self.entries)

    def names(self) -> set[str]:
        return {key.name for key in self.entries}


def resident_bytes(model) -> int:
    """Bytes of a model's parameters and buffers on this rank (a sharded parameter's local shard only;
    meta tensors hold none)."""
    transformer = model.transformer
    return shard.resident_bytes(transformer) + sum(t.numel() * t.element_size() for t in transformer.buffers()
                                                   if not t.is_meta)

