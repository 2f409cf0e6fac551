"""The groups a MeshCache creates: PipeFusion's one-way links, one options object per group, and
every group destroyed by ``clear`` (after a failed request) and built again by the next ``get``."""

import itertools
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks

from xdit_backend.distributed import mesh
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.distributed.mesh import AXES, MeshCache, link_ranks

TIMEOUT = timedelta(seconds=7)
SHAPES = [(1, 1, 2, 1, 1), (1, 1, 4, 1, 1), (2, 1, 2, 1, 1), (1, 2, 2, 1, 2), (2, 2, 2, 1, 1), (1, 1, 3, 2, 1)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_links_form_one_ring_per_pipeline(shape):
    """Each link joins a stage to the next one (the last to stage 0) of the same pipeline, and every
    rank is the sender of exactly one link and the receiver of exactly one."""
    ranks = torch.arange(torch.Size(shape).numel()).view(shape)
    coordinates = {int(ranks[c]): c for c in itertools.product(*map(range, shape))}
    stage = AXES.index("pipefusion")
    links = link_ranks(ranks)
    for sender, receiver in links:
        a, b = coordinates[sender], coordinates[receiver]
        assert a[:stage] + a[stage + 1:] == b[:stage] + b[stage + 1:], (sender, receiver)  # same pipeline
        assert b[stage] == (a[stage] + 1) % shape[stage], (sender, receiver)
    assert sorted(s for s, _ in links) == sorted(r for _, r in links) == list(range(ranks.numel()))


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_group_gets_its_own_options_with_the_timeout(device_type, monkeypatch):
    """Torch writes a group's name and ranks into the options it is given: no two groups (mesh axes,
    the flattened sequence group, the links) may share one object, and each carries the timeout. Every
    rank creates every group (world 8: pipefusion 2 × ring 2 × ulysses 2)."""
    given = []

    def new_group(ranks, timeout, backend, pg_options, group_desc):
        given.append((backend, pg_options, tuple(ranks)))
        return object()

    class Options:
        _timeout = None

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(MeshCache, "_connect", lambda self, walk: None)  # no traffic over the stand-in groups
    MeshCache(device_type, TIMEOUT).get(ParallelConfig(pipefusion=2, ring=2, ulysses=2))
    options = [entry[1] for entry in given]
    assert len(options) == 3 * 4 + 2 + 8  # 3 axes of 4 groups each, 2 sequence groups, 4 pipelines × 2 links
    assert len({id(o) for o in options}) == len(options), "two groups share one options object"
    assert all(o._timeout == TIMEOUT for o in options)
    assert {entry[0] for entry in given} == {"nccl" if device_type == "cuda" else "gloo"}
    assert ((0, 1, 2, 3) in {entry[2] for entry in given}) and ((0, 4) in {entry[2] for entry in given})


def _groups_of(layout) -> list:
    links = [layout.links.incoming.group, layout.links.outgoing.group] if layout.links else []
    return [*(layout.group(axis) for axis in AXES), layout.sequence_group, *links]


def _build_clear_rebuild(rank: int) -> dict:
    registered = dist.distributed_c10d._world.pg_map
    before = set(registered)
    cache = MeshCache("cpu", TIMEOUT)
    pipelined = cache.get(ParallelConfig(pipefusion=2, ulysses=2))
    sequence = cache.get(ParallelConfig(ring=2, ulysses=2))
    links = pipelined.links
    seen = {"peers": (links.incoming.peer, links.outgoing.peer),
            "link sizes": [dist.get_world_size(link.group) for link in (links.incoming, links.outgoing)],
            "distinct links": links.incoming.group is not links.outgoing.group}
    created = [g for g in _groups_of(pipelined) + _groups_of(sequence) if g is not None]
    seen["registered before clear"] = all(group in registered for group in created)
    cache.clear()
    seen["left registered"] = len([g for g in created if g in registered])
    seen["names left"] = len([g for g in created if g in dist.distributed_c10d._world.pg_names])
    seen["extra groups"] = len(set(registered) - before)
    again = cache.get(ParallelConfig(ring=2, ulysses=2))  # built again, all ranks together, and it works
    total = torch.ones(1)
    dist.all_reduce(total, group=again.sequence_group)
    seen["sum after rebuild"] = total.item()
    return seen


def test_clear_destroys_every_group_the_cache_created_and_get_builds_them_again():
    """World 4, two layouts (pipefusion 2 × ulysses 2 with its links; ring 2 × ulysses 2 with its
    flattened group): ``clear`` leaves none of their groups registered, then a new layout works."""
    for rank, seen in enumerate(on_ranks(_build_clear_rebuild, 4)):
        stage, column = divmod(rank, 2)  # rank = stage · 2 + ulysses index
        other = (1 - stage) * 2 + column  # the other stage of this rank's pipeline
        assert seen["peers"] == (other, other), (rank, seen)
        assert seen["link sizes"] == [2, 2] and seen["distinct links"], (rank, seen)
        assert seen["registered before clear"], (rank, seen)
        assert seen["left registered"] == seen["names left"] == seen["extra groups"] == 0, (rank, seen)
        assert seen["sum after rebuild"] == 4, (rank, seen)


def test_on_cuda_the_groups_are_aborted_together_then_the_device_synchronised(monkeypatch):
    """After a failure on CUDA: one NCCL group call around the aborts (an abort must not wait on
    another communicator's stuck kernels), every group aborted (which also unregisters it), then a
    synchronisation, which returns once the aborted kernels have ended; nothing destroyed twice."""
    calls = []

    class Backend:
        def _group_start(self):
            calls.append("group start")

        def _group_end(self):
            calls.append("group end")

    class Group:
        def __init__(self, name):
            self.name = name

        def _get_backend(self, device):
            assert device == torch.device("cuda")
            return Backend()

    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda g: calls.append(f"abort {g.name}"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda g: calls.append(f"destroy {g.name}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(dist, "get_backend", lambda g: "gloo" if g.name == "step" else "nccl")
    mesh.release([Group("a"), Group("step"), Group("b")], "cuda")  # the step cache's group is on gloo
    assert calls == ["group start", "abort a", "abort b", "group end", "synchronize", "destroy step"]


def test_on_cuda_the_step_cache_decides_over_a_gloo_group(monkeypatch):
    """Review B3: the step cache's sums are read on the host every step; over NCCL a failed peer would
    block that read until the watchdog, over gloo it is the group's timeout. Its group has the shard
    mesh's ranks (world 4, pipefusion 2 × ulysses 2: [0, 1] and [2, 3]), on gloo with the timeout."""
    given = []

    def new_group(ranks, timeout, backend, pg_options, group_desc):
        given.append((tuple(ranks), backend, group_desc))
        return SimpleNamespace(name=group_desc)

    class Options:
        _timeout = None

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(MeshCache, "_connect", lambda self, walk: None)
    monkeypatch.setattr(mesh.DeviceMesh, "from_group", staticmethod(lambda group, device_type, mesh_dim_names: group))
    layout = MeshCache("cuda", TIMEOUT).get(ParallelConfig(pipefusion=2, ulysses=2), step_cache=True)
    steps = [entry for entry in given if entry[2].startswith("step_cache")]
    assert [(ranks, backend) for ranks, backend, _ in steps] == [((0, 1), "gloo"), ((2, 3), "gloo")]
    assert layout.step_group.name == steps[1][2]  # rank 2's
    assert all(backend == "nccl" for _, backend, name in given if not name.startswith("step_cache"))


def test_every_group_of_a_layout_is_connected_at_build_in_creation_order(monkeypatch):
    """Review gpu-paths-2 B2 and B12: NCCL connects a group's ranks at its first operation, blocking the host;
    so each rank runs one operation on each of its groups when the layout is built (its axes, the flattened
    sequence group, the shard group, its PipeFusion links), in the order every rank created them, never
    first inside a request whose receives are posted ahead. World 8, rank 0: pipefusion 2 × ring 2 × ulysses 2."""
    names = {}

    def new_group(ranks, timeout, backend, pg_options, group_desc):
        group = SimpleNamespace(name=group_desc)
        names[id(group)] = group_desc
        return group

    class Options:
        _timeout = None

    walks = []
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(MeshCache, "_connect", lambda self, walk: walks.append(
        [(op.__name__, group.name, peer) for op, group, peer in walk]))
    monkeypatch.setattr(mesh.DeviceMesh, "from_group", staticmethod(lambda group, device_type, mesh_dim_names: group))
    MeshCache("cuda", TIMEOUT).get(ParallelConfig(pipefusion=2, ring=2, ulysses=2, shard_weights=True))
    assert walks == [
        [("all_reduce", "mesh_pipefusion_0_4", None), ("all_reduce", "mesh_ring_0_2", None),
         ("all_reduce", "mesh_ulysses_0_1", None), ("all_reduce", "sequence_0_1_2_3", None),
         ("isend", "pipefusion_link_0_to_4", 4), ("irecv", "pipefusion_link_4_to_0", 4)],
        [("all_reduce", "shard_0_1_2_3", None)],  # built on the first request that asks for it, by every rank
    ]
