"""The conditioning an ``evaluate`` request names by content hash, kept between the calls of a generation.

Every rank keeps one store and changes it only in ``take`` (service/executor.py runs it first, on every rank,
for the request rank 0 broadcast), so the stores of all ranks hold the same hashes in the same order: what rank
0 finds held (``holds``, before it broadcasts) every rank holds. Bounded in bytes; the least recently used go
first, never one the request at hand uses. Tensors stay on the host as received (a step moves them to the
device with the latent): the device's memory is the model's.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch

from ..errors import UserError
from ..wire.content_hash import content_hash

STORE_MB_ENV = "XDIT_INPUT_STORE_MB"
DEFAULT_STORE_MB = 1024  # Flux.1-dev's cond + uncond text, 2 × 512 × 4096 float32, is 16 MB


class MissingInputs(UserError):
    """Hashes a request names that the backend does not hold (evicted, or a backend started since)."""

    def __init__(self, hashes: list[str]):
        super().__init__(f"the backend does not hold {len(hashes)} of the request's inputs ({', '.join(hashes[:4])}"
                         f"{'…' if len(hashes) > 4 else ''}): evicted, or the backend restarted since they were sent",
                         "send them again inline (the client does so by itself)")
        self.hashes = hashes


class InputStore:
    """Content hash → tensor, least recently used first, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int | None = None):
        if max_bytes is None:
            max_bytes = int(os.environ.get(STORE_MB_ENV, DEFAULT_STORE_MB)) << 20
        self.max_bytes = max_bytes
        self.tensors: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.evicted = 0  # tensors dropped to stay within the bound, since the start

    def holds(self, name: str) -> bool:
        return name in self.tensors

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def missing(self, names: dict[str, str], inline: dict[str, torch.Tensor]) -> list[str]:
        """The hashes of ``names`` (key → hash) neither sent inline nor held."""
        return sorted({h for h in names.values() if h not in inline and h not in self.tensors})

    @staticmethod
    def check_inline(inline: dict[str, torch.Tensor]) -> None:
        """Every inline tensor's content has the hash it is named by (rank 0, before anything is kept)."""
        for name, tensor in inline.items():
            if content_hash(tensor) != name:
                raise UserError(f"input {name} does not hash to its name",
                                "name an inline input by wire.content_hash.content_hash of its tensor")

    def take(self, names: dict[str, str], inline: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` (key → hash) refer to; the inline ones kept for later calls (own copies, not views
        of the message's payload), then the least recently used others dropped past the bound."""
        missing = self.missing(names, inline)
        if missing:
            raise MissingInputs(missing)
        for name, tensor in inline.items():
            if name not in self.tensors:
                self.tensors[name] = tensor.clone()
        used = set(names.values())
        for name in used:
            self.tensors.move_to_end(name)
        total = self.nbytes()
        for name in list(self.tensors):
            if total <= self.max_bytes:
                break
            if name not in used:
                total -= self.tensors.pop(name).nbytes
                self.evicted += 1
        return {key: self.tensors[name] for key, name in names.items()}

    def clear(self) -> None:
        self.tensors.clear()
