"""The name a tensor goes by when it is sent once and referenced afterwards: a hash of its content.

The xDiT MODEL's conditioning (nodes/remote_model.py) is the same tensor at every model call of a
generation; the client sends it once, named by this hash, and later calls name only the hash. The backend
checks an inline tensor against its name before it keeps it (service/input_store.py), so one client cannot
put another's name on different values. Imports no torch: it reads the tensor's bytes.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PREFIX = "h"  # a tensor name on the wire: "h" + 32 hex digits (protocol names are at most 64 characters)


def content_hash(tensor: torch.Tensor) -> str:
    """``PREFIX`` + blake2b-128 of the tensor's dtype, shape and bytes (a CPU tensor; any layout)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.numel():
        import torch

        digest.update(flat.view(torch.uint8).numpy().data)  # [numel · itemsize] bytes, no copy
    return PREFIX + digest.hexdigest()


def is_content_hash(name: object) -> bool:
    return (isinstance(name, str) and len(name) == len(PREFIX) + 32 and name.startswith(PREFIX)
            and all(c in "0123456789abcdef" for c in name[len(PREFIX):]))
