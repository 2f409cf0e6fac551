"""The process groups of each layout, with named axes, built by this module from ``dist.new_group``.

Axis order, outermost to innermost: ``dp, cfg, pipefusion, ring, ulysses``. Ulysses is innermost
because it talks most (an all-to-all per attention layer), so its ranks are adjacent (same node,
fastest links). Rank r sits at mesh coordinates given by that order in row-major layout, e.g.
world 4 with cfg=2 × ulysses=2: ranks (0, 1) are the cond half, (2, 3) the uncond half.

A layout has one group per axis of degree above 1 (the ranks that differ only along it), the
flattened ring × ulysses group when both are > 1, with PipeFusion one 2-rank group per pipeline link
(``link_ranks``; why: parallel/pipefusion.py), and with ``shard_weights`` (or the step cache) the ranks
that run the same blocks: every axis but pipefusion, flattened, as the 1-D DeviceMesh FSDP2 shards the
blocks over (parallel/shard.py). That mesh is built on the first request of its shape that asks, by every
rank (that request reaches them all). Every rank creates every group of a shape, in the same order,
members or not (torch's rule for new groups; on NCCL, a split of the world communicator). Each group
gets its own options object carrying the timeout (torch writes the group's name and ranks into the
options it is given, so one object shared by every group would end up describing one of them).

Why not ``init_device_mesh`` and ``DeviceMesh._flatten``: the timeout per group needs their
``backend_override`` (torch 2.9 on), ``_flatten`` is private and was rewritten twice between 2.8 and
2.13, and the layout needs only groups and coordinates. ``DeviceMesh.from_group`` (1-D, public, the
same from 2.7 to 2.13) wraps the shard group for FSDP2.

Meshes live in a MeshCache owned by each rank's Executor (executor.py); nothing here keeps a group
in a module global. ``MeshCache.clear`` destroys every group the cache created (after a failed
request, see ``release``); the next request builds its layout again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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
    ranks: torch.Tensor  # [dp, cfg, pipefusion, ring, ulysses]: the global rank at each coordinate
    coordinates: tuple[int, ...]  # this rank's, in AXES order
    groups: dict[str, object]  # axis → this rank's group along it, for each axis of degree > 1
    sequence_group: object = None  # ring × ulysses: the ranks that hold slices of one sequence (None without SP)
    links: Links | None = None  # PipeFusion's links (None without PipeFusion)
    shard_mesh: DeviceMesh | None = None  # the ranks sharing each block's weights (None without shard_weights)
    step_group: object = None  # the ranks that run the same blocks, for the step cache's decision (None unless asked):
    # a gloo group, also on CUDA, so no rank waits on the host for an NCCL result (review gpu-paths-2 B3)

    def group(self, axis: str):
        return self.groups.get(axis)

    def index(self, axis: str) -> int:
        """This rank's coordinate along ``axis``."""
        return self.coordinates[AXES.index(axis)]

    @property
    def sequence_index(self) -> int:
        """Position of this rank's token slice: ring-major, ulysses-minor, matching the flattened group."""
        return self.index("ring") * self.config.ulysses + self.index("ulysses")


@dataclass
class _Built:
    """The groups of one mesh shape, and every group this rank created for it (to destroy them)."""

    ranks: torch.Tensor
    coordinates: tuple[int, ...]
    groups: dict[str, object]
    sequence_group: object
    links: Links | None
    created: list = field(default_factory=list)
    shard_mesh: DeviceMesh | None = None  # built on first use (MeshCache.get)
    step_group: object = None  # the shard mesh's ranks on gloo, built on first use


def slices(ranks: torch.Tensor, axes: tuple[str, ...]) -> list[list[int]]:
    """The rank lists that differ only along ``axes`` (flattened in the order given, the last fastest),
    in row-major order of the other axes. ``ranks``: [dp, cfg, pipefusion, ring, ulysses]."""
    moved = ranks.movedim([AXES.index(axis) for axis in axes], list(range(-len(axes), 0)))
    return moved.reshape(-1, math.prod(ranks.shape[AXES.index(axis)] for axis in axes)).tolist()  # [groups, size]


class MeshCache:
    """Builds each shape of mesh once (all ranks together) and keeps it for later requests. ``backend``: the
    layouts' groups' (NCCL on CUDA by default; gloo on the CPU and in one_device.py's test mode)."""

    def __init__(self, device_type: str, timeout: timedelta | None = None, backend: str | None = None):
        self.device_type = device_type
        self.timeout = timeout
        self.backend = backend or ("nccl" if device_type == "cuda" else "gloo")
        self._built: dict[tuple[int, ...], _Built] = {}

    def get(self, config: ParallelConfig, step_cache: bool = False) -> Layout:
        """This request's layout: its own config (patches, warm-up…) over the cached groups of its degrees;
        with ``step_cache``, the group of the ranks that run the same blocks too (the step cache agrees over it)."""
        shape = tuple(getattr(config, axis) for axis in AXES)
        if shape not in self._built:
            self._built[shape] = self._build(config, shape)
        built = self._built[shape]
        if (config.shard_weights or step_cache) and built.shard_mesh is None:
            built.shard_mesh = self._shard_mesh(built)
        if step_cache and built.step_group is None:
            built.step_group = self._step_group(built)
        return Layout(config, built.ranks, built.coordinates, built.groups, built.sequence_group, built.links,
                      built.shard_mesh if config.shard_weights else None, built.step_group if step_cache else None)

    def clear(self) -> None:
        """Destroy every group the cache created and forget the meshes (after a failed request: a group
        with a collective that never completed is not reused); the next request builds them again."""
        created = [group for built in self._built.values() for group in built.created]
        self._built.clear()
        release(created, self.device_type)

    def _build(self, config: ParallelConfig, shape: tuple[int, ...]) -> _Built:
        ranks = torch.arange(math.prod(shape)).view(shape)  # [dp, cfg, pipefusion, ring, ulysses]
        coordinates = tuple(int(c) for c in (ranks == dist.get_rank()).nonzero()[0])
        built = _Built(ranks, coordinates, {}, None, None)
        for axis in AXES:
            if getattr(config, axis) > 1:
                built.groups[axis] = self._own_group(built, slices(ranks, (axis,)), f"mesh_{axis}")
        if config.ring > 1 and config.ulysses > 1:
            built.sequence_group = self._own_group(built, slices(ranks, ("ring", "ulysses")), "sequence")
        elif config.sequence > 1:
            built.sequence_group = built.groups["ring" if config.ring > 1 else "ulysses"]
        own = list(built.groups.values())
        if built.sequence_group is not None and all(built.sequence_group is not g for g in own):
            own.append(built.sequence_group)  # ring × ulysses (else it is the ring or the ulysses group)
        walk = [(dist.all_reduce, group, None) for group in own]
        if config.pipefusion > 1:
            built.links = self._links(built, walk)
        else:
            self._connect(walk)
        return built

    def _own_group(self, built: _Built, members: list[list[int]], name: str, device_type: str | None = None):
        """Create a group for each rank list of ``members`` (every rank, in order) and return the one
        this rank is in."""
        me, own = dist.get_rank(), None
        for ranks in members:
            group = self._new_group(ranks, f"{name}_{'_'.join(map(str, ranks))}", device_type)
            if me in ranks:
                own = group
                built.created.append(group)
        return own

    def _new_group(self, ranks: list[int], name: str, device_type: str | None = None):
        """A group of ``ranks`` with the cache's timeout, on options of its own (torch's defaults without one),
        on the cache's backend (``device_type`` "cpu": gloo)."""
        backend = "gloo" if device_type == "cpu" else self.backend
        if self.timeout is None:
            return dist.new_group(ranks, backend=backend, group_desc=name)
        options = _with_timeout(backend, self.timeout)
        return dist.new_group(ranks, timeout=self.timeout, backend=backend, pg_options=options, group_desc=name)

    def _step_group(self, built: _Built):
        """The step cache's group: the shard mesh's ranks, on gloo. Its decision is two float64 sums each
        step that every rank reads on the host; over NCCL a failed peer would leave the others blocked in
        that read until the watchdog (review gpu-paths-2 B3), over gloo it is the group's timeout."""
        if self.backend == "gloo":
            return built.shard_mesh.get_group()  # gloo already
        same_blocks = tuple(axis for axis in AXES if axis != "pipefusion")
        return self._own_group(built, slices(built.ranks, same_blocks), "step_cache", device_type="cpu")

    def _shard_mesh(self, built: _Built) -> DeviceMesh:
        """The 1-D mesh of the ranks that run the same blocks: [dp, cfg, ring, ulysses] flattened
        (world 4, pipefusion=2 × ulysses=2: [0, 1] hold stage 0, [2, 3] stage 1; without PipeFusion, all)."""
        same_blocks = tuple(axis for axis in AXES if axis != "pipefusion")
        group = self._own_group(built, slices(built.ranks, same_blocks), "shard")
        self._connect([(dist.all_reduce, group, None)])  # FSDP2's first all-gather must not be its connection
        return DeviceMesh.from_group(group, self.device_type, mesh_dim_names=("shard",))

    def _links(self, built: _Built, walk: list) -> Links:
        """Every rank creates every link group, in ``link_ranks`` order, and keeps its own two (it is
        the sender of one link and the receiver of one); then ``walk`` (the layout's own groups) and the
        links are connected (``_connect``)."""
        me, incoming, outgoing = dist.get_rank(), None, None
        for sender, receiver in link_ranks(built.ranks):
            group = self._new_group([sender, receiver], f"pipefusion_link_{sender}_to_{receiver}")
            if me == sender:
                outgoing = Link(group, receiver)
                built.created.append(group)
                walk.append((dist.isend, group, receiver))
            if me == receiver:
                incoming = Link(group, sender)
                built.created.append(group)
                walk.append((dist.irecv, group, sender))
        self._connect(walk)
        return Links(incoming, outgoing)

    def _connect(self, walk: list) -> None:
        """One element over each of this rank's groups, in the order they were created, waiting for each:
        an all-reduce over a layout's own groups (``(dist.all_reduce, group, None)``), a send or receive over
        its PipeFusion links (``(dist.isend | dist.irecv, group, peer)``, in ``link_ranks`` order).

        NCCL connects the ranks of a group at their first operation, and the first rank there blocks on
        the host until the others arrive (NVIDIA/nccl#783). PipeFusion's first ops are receives posted
        ahead (stage 0's from the last stage, which sends only once it has received): left to them, the
        first request on two GPUs would hang with no timeout (review gpu-paths-2 B2); and a rank whose
        receives are posted must not then block the device in a connection of its shard or sequence group
        (B12). Each rank walks its groups in the global order of their creation, so the walk cannot
        deadlock: the earliest group anyone waits in has every member at it (gloo connects at group
        creation: on the CPU it only costs the messages)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")
        for op, group, peer in walk:
            if op is dist.all_reduce:
                dist.all_reduce(torch.zeros(1, device=device), group=group)
                continue
            for work in dist.batch_isend_irecv([dist.P2POp(op, torch.zeros(1, device=device), peer, group)]):
                work.wait()


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
    ``_abort_process_group`` also unregisters the group, so nothing is destroyed twice. A gloo group
    (on the CPU, and the step cache's on CUDA) is destroyed: a peer stuck in a collective has already
    timed out.
    """
    on_gloo = [group for group in groups if device_type != "cuda" or dist.get_backend(group) == "gloo"]
    nccl = [group for group in groups if all(group is not g for g in on_gloo)]
    if nccl:
        backend = nccl[0]._get_backend(torch.device("cuda"))
        backend._group_start()
        for group in nccl:
            dist.distributed_c10d._abort_process_group(group)
        backend._group_end()
        torch.cuda.synchronize()
    for group in on_gloo:
        dist.destroy_process_group(group)


def _with_timeout(backend: str, timeout: timedelta):
    """Options that give one group of ``backend`` ("nccl" or "gloo") ``timeout``: without them, new groups get
    torch's default (30 minutes for gloo), not the timeout the backend was started with."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options
