"""One DeviceMesh per layout, with named axes, and the groups each method uses.

Axis order, outermost to innermost: ``dp, cfg, pipefusion, ring, ulysses``. Ulysses is innermost
because it talks most (an all-to-all per attention layer), so its ranks are adjacent (same node,
fastest links). Rank r sits at mesh coordinates given by that order in row-major layout, e.g.
world 4 with cfg=2 × ulysses=2: ranks (0, 1) are the cond half, (2, 3) the uncond half.

Besides the mesh's axes, a layout has the flattened ring × ulysses group (when both are > 1),
with PipeFusion one 2-rank group per pipeline link (``link_ranks``; why: parallel/pipefusion.py),
and with ``shard_weights`` the 1-D shard mesh FSDP2 shards the blocks over: every axis but
pipefusion, flattened (the ranks that run the same blocks; parallel/shard.py). It is built on the
first request of its shape that shards, by every rank (that request reaches them all).
Every rank creates all of them when a layout shape is first used, in the same order, members or
not (torch's rule for new groups; NCCL splits them off the world communicator, a collective). Each
group gets its own options object carrying the timeout (torch writes the group's name and ranks
into the options it is given, so one object shared by every group would end up describing one of
them).

Meshes live in a MeshCache owned by each rank's Executor (executor.py); nothing here keeps a group
in a module global. ``MeshCache.clear`` destroys every group the cache created (after a failed
request, see ``release``); the next request builds its layout again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import DEGREES, ParallelConfig

AXES = DEGREES  # ("dp", "cfg", "pipefusion", "ring", "ulysses"), outermost first


@dataclass(frozen=True)
class Link:
    """A 2-rank group that carries PipeFusion's messages one way, and the global rank at its other end."""

    group: object
    peer: int


@dataclass(frozen=True)
class Links:
    """This rank's two links in its pipeline's ring of stages 0 → 1 → … → P − 1 → 0: it receives on
    ``incoming`` only (activations from stage s − 1; at stage 0, the patches coming back from the
    last stage) and sends on ``outgoing`` only."""

    incoming: Link
    outgoing: Link


@dataclass
class Layout:
    """The groups of one layout, as this rank sees them. A group is None when its degree is 1."""

    config: ParallelConfig
    mesh: DeviceMesh
    sequence_group: object = None  # ring × ulysses: the ranks that hold slices of one sequence (None without SP)
    links: Links | None = None  # PipeFusion's links (None without PipeFusion)
    shard_mesh: DeviceMesh | None = None  # the ranks sharing each block's weights (None without shard_weights)
    step_group: object = None  # the ranks that run the same blocks, for the step cache's decision (None unless asked)

    def group(self, axis: str):
        return self.mesh.get_group(axis) if getattr(self.config, axis) > 1 else None

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.mesh.get_local_rank(axis)

    @property
    def sequence_index(self) -> int:
        """Position of this rank's token slice: ring-major, ulysses-minor, matching the flattened group."""
        return self.index("ring") * self.config.ulysses + self.index("ulysses")


@dataclass
class _Built:
    """The groups of one mesh shape, and every group this rank created for it (to destroy them)."""

    mesh: DeviceMesh
    sequence_group: object
    links: Links | None
    created: list = field(default_factory=list)
    shard_mesh: DeviceMesh | None = None  # built on first use (MeshCache.get)


class MeshCache:
    """Builds each shape of mesh once (all ranks together) and keeps it for later requests."""

    def __init__(self, device_type: str, timeout: timedelta | None = None):
        self.device_type = device_type
        self.timeout = timeout
        self._built: dict[tuple[int, ...], _Built] = {}

    def get(self, config: ParallelConfig, step_cache: bool = False) -> Layout:
        """This request's layout: its own config (patches, warm-up…) over the cached mesh of its degrees;
        with ``step_cache``, the group of the ranks that run the same blocks too (the step cache agrees over it)."""
        shape = tuple(getattr(config, axis) for axis in AXES)
        if shape not in self._built:
            self._built[shape] = self._build(config, shape)
        built = self._built[shape]
        if (config.shard_weights or step_cache) and built.shard_mesh is None:
            built.shard_mesh = self._shard_mesh(built.mesh)
            if built.shard_mesh.get_group() is not dist.group.WORLD:
                built.created.append(built.shard_mesh.get_group())
        return Layout(config, built.mesh, built.sequence_group, built.links,
                      built.shard_mesh if config.shard_weights else None,
                      built.shard_mesh.get_group() if step_cache else None)

    def clear(self) -> None:
        """Destroy every group the cache created and forget the meshes (after a failed request: a group
        with a collective that never completed is not reused); the next request builds them again."""
        created = [group for built in self._built.values() for group in built.created]
        self._built.clear()
        release(created, self.device_type)

    def override(self) -> tuple | None:
        """A fresh (backend, options) carrying the timeout, for one group (None: torch's defaults)."""
        return _with_timeout(self.device_type, self.timeout) if self.timeout else None

    def _build(self, config: ParallelConfig, shape: tuple[int, ...]) -> _Built:
        overrides = {axis: self.override() for axis in AXES} if self.timeout else None
        mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=AXES, backend_override=overrides)
        created = [mesh.get_group(axis) for axis in AXES]
        sequence = None
        if config.ring > 1 and config.ulysses > 1:
            sequence = mesh["ring", "ulysses"]._flatten("sequence", backend_override=self.override()).get_group()
            created.append(sequence)
        elif config.sequence > 1:
            sequence = mesh.get_group("ring" if config.ring > 1 else "ulysses")
        links = self._links(mesh) if config.pipefusion > 1 else None
        if links:
            created += [links.incoming.group, links.outgoing.group]
        world = dist.group.WORLD  # a full-world axis without an override is the default group: never ours
        created = [group for group in created if group is not world]
        return _Built(mesh, sequence, links, created)

    def _shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the ranks that run the same blocks: [dp, cfg, ring, ulysses] flattened
        (world 4, pipefusion=2 × ulysses=2: [0, 1] hold stage 0, [2, 3] stage 1; without PipeFusion, all)."""
        same_blocks = tuple(axis for axis in AXES if axis != "pipefusion")
        return mesh[same_blocks]._flatten("shard", backend_override=self.override())

    def _links(self, mesh: DeviceMesh) -> Links:
        """Every rank creates every link group, in ``link_ranks`` order, and keeps its own two (it is
        the sender of one link and the receiver of one)."""
        me, incoming, outgoing = dist.get_rank(), None, None
        for sender, receiver in link_ranks(mesh.mesh):
            backend, options = self.override() or (None, None)
            group = dist.new_group([sender, receiver], timeout=self.timeout, backend=backend, pg_options=options,
                                   group_desc=f"pipefusion_link_{sender}_to_{receiver}")
            if me == sender:
                outgoing = Link(group, receiver)
            if me == receiver:
                incoming = Link(group, sender)
        return Links(incoming, outgoing)


def link_ranks(ranks: torch.Tensor) -> list[tuple[int, int]]:
    """(sender, receiver) global ranks of every PipeFusion link, in the order every rank creates them:
    pipeline by pipeline (the other axes' coordinates, row-major), stage s → s + 1 for each s, then
    the return link last → 0. ``ranks``: the mesh's rank tensor [dp, cfg, pipefusion, ring, ulysses]."""
    axis = AXES.index("pipefusion")
    stages = ranks.shape[axis]
    pipelines = ranks.movedim(axis, -1).reshape(-1, stages).tolist()  # [pipelines, stages]: global ranks by stage
    return [(pipeline[s], pipeline[(s + 1) % stages]) for pipeline in pipelines for s in range(stages)]


def release(groups: list, device_type: str) -> None:
    """Destroy ``groups`` (every rank, after agreeing on a failed request).

    On CUDA a peer of the rank that raised may still have kernels queued on these groups that no
    collective will ever match; NCCL never blocks the CPU, so they are still there. Aborting the
    communicators ends them (otherwise the next request's first synchronisation waits behind them
    until the watchdog kills the rank). The aborts go inside one NCCL group call, as torch does when
    it aborts every group: an abort must not wait for another communicator's stuck kernels. Torch's
    ``_abort_process_group`` also unregisters the group, so nothing is destroyed twice. On the CPU
    (gloo) destroying the group is enough: a peer stuck in a collective has already timed out.
    """
    if not groups:
        return
    if device_type == "cuda":
        backend = groups[0]._get_backend(torch.device("cuda"))
        backend._group_start()
        for group in groups:
            dist.distributed_c10d._abort_process_group(group)
        backend._group_end()
        torch.cuda.synchronize()
        return
    for group in groups:
        dist.destroy_process_group(group)


def _with_timeout(device_type: str, timeout: timedelta) -> tuple:
    """(backend, options) that give one group ``timeout``: without it, new groups get torch's
    default (30 minutes for gloo), not the timeout the backend was started with."""
    if device_type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        backend = "nccl"
    else:
        options = dist.ProcessGroupGloo._Options()
        backend = "gloo"
    options._timeout = timeout
    return backend, options
