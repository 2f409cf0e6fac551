"""A diffusers model folder's weights, read one tensor at a time from its safetensors file or from
the shards its index names (what ``save_pretrained`` writes). Pickled ``.bin`` weights are never
loaded: the project runs no pickle."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch

from ..errors import UserError
from . import safetensors_file

WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"


def shards(folder: str) -> dict[str, Path]:
    """Which file holds each tensor: from the shard index, or the one weights file's header."""
    root = Path(folder)
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"{root / INDEX} is not a readable shard index ({exc})",
                            "re-download the folder, or save it again with save_pretrained") from None
        return {key: root / name for key, name in weight_map.items()}
    if (root / WEIGHTS).is_file():
        with safetensors_file.open_file(str(root / WEIGHTS)) as handle:
            return dict.fromkeys(handle.keys(), root / WEIGHTS)
    found = sorted(p.name for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    raise UserError(f"{folder} has no {WEIGHTS} nor {INDEX} (found: {', '.join(found) or 'nothing'})",
                    "give a folder saved by diffusers' save_pretrained in safetensors (pickled .bin weights "
                    "are not loaded), or a single .safetensors file")


def reader(folder: str, stack: ExitStack) -> Callable[..., torch.Tensor]:
    """``read(key, part=None)``: one tensor of the folder's weights (or only its rows ``part`` = [start, stop)),
    on the CPU in its stored dtype. Each shard is opened (memory-mapped) when first needed and closed with
    ``stack``."""
    where = shards(folder)
    handles = {}

    def read(key: str, part: tuple[int, int] | None = None) -> torch.Tensor:
        path = where.get(key)
        if path is None:
            raise UserError(f"{folder}: tensor {key!r} is in none of its weight files", "the folder is incomplete: re-download it")
        if path not in handles:
            handles[path] = stack.enter_context(safetensors_file.open_file(str(path)))
        return handles[path].get_tensor(key) if part is None else handles[path].get_slice(key)[part[0]:part[1]]

    return read
