"""One DeviceMesh per layout, with named axes, and the groups each method uses.

Axis order, outermost to innermost: ``dp, cfg, pipefusion, ring, ulysses``. Ulysses is innermost
because it talks most (an all-to-all per attention layer), so its ranks are adjacent (same node,
fastest links). Rank r sits at mesh coordinates given by that order in row-major layout, e.g.
world 4 with cfg=2 × ulysses=2: ranks (0, 1) are the cond half, (2, 3) the uncond half.

Meshes live in a MeshCache owned by each rank's Executor (executor.py); nothing here keeps a group
in a module global.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import DEGREES, ParallelConfig

AXES = DEGREES  # ("dp", "cfg", "pipefusion", "ring", "ulysses"), outermost first


@dataclass
class Layout:
    """The groups of one layout, as this rank sees them. A group is None when its degree is 1."""

    config: ParallelConfig
    mesh: DeviceMesh
    override: tuple | None = field(default=None, repr=False)  # (backend, options): the groups' timeout

    def group(self, axis: str):
        return self.mesh.get_group(axis) if getattr(self.config, axis) > 1 else None

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.mesh.get_local_rank(axis)

    @cached_property
    def sequence_group(self):
        """ring × ulysses flattened: the ranks that hold slices of one sequence (None without SP)."""
        if self.config.sequence == 1:
            return None
        if self.config.ring == 1:
            return self.group("ulysses")
        if self.config.ulysses == 1:
            return self.group("ring")
        return self.mesh["ring", "ulysses"]._flatten("sequence", backend_override=self.override).get_group()

    @property
    def sequence_index(self) -> int:
        """Position of this rank's token slice: ring-major, ulysses-minor, matching the flattened group."""
        return self.index("ring") * self.config.ulysses + self.index("ulysses")


class MeshCache:
    """Builds each shape of mesh once (all ranks together) and keeps it for later requests."""

    def __init__(self, device_type: str, timeout: timedelta | None = None):
        self.device_type = device_type
        self._meshes: dict[tuple[int, ...], DeviceMesh] = {}
        self.override = _with_timeout(device_type, timeout) if timeout else None

    def get(self, config: ParallelConfig) -> Layout:
        """This request's layout: its own config (patches, warm-up…) over the cached mesh of its degrees."""
        shape = tuple(getattr(config, axis) for axis in AXES)
        if shape not in self._meshes:
            overrides = {axis: self.override for axis in AXES} if self.override else None
            self._meshes[shape] = init_device_mesh(self.device_type, shape, mesh_dim_names=AXES,
                                                   backend_override=overrides)
        return Layout(config, self._meshes[shape], self.override)

    def clear(self) -> None:
        """Forget every mesh (after a failed request: a group that timed out is not reused)."""
        self._meshes.clear()


def _with_timeout(device_type: str, timeout: timedelta) -> tuple:
    """(backend, options) that give a mesh's groups ``timeout``: without it, new groups get torch's
    default (30 minutes for gloo), not the timeout the backend was started with."""
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options = dist.ProcessGroupGloo._Options()
        backend = "gloo"
    options._timeout = timeout
    return backend, options
