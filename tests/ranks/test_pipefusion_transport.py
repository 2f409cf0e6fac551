"""PipeFusion's point-to-point traffic cannot deadlock on NCCL: each rank's real sequence of posts,
waits and step gates (recorded on gloo) replayed under NCCL's rules: every op of one group runs on one
stream in posting order, a send and a receive complete together, and the first op between two ranks
on a group blocks the posting rank until the other posts its own (NCCL connects the pair lazily, then:
review gpu-paths-2 B2). The recording starts before the request builds its layout, so the mesh's
link connection walk (distributed/mesh.py) is replayed too."""

import time
from collections import defaultdict, deque
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.service.executor import Executor
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 3, "seed": 3, "cfg": 1.0, "batch": 1}


class _Recorded:
    """A posted op's work; its ``wait`` is recorded."""

    def __init__(self, work, number: int, events: list):
        self.work, self.number, self.events = work, number, events

    def wait(self):
        self.events.append(("wait", self.number))
        return self.work.wait()


def _record(rank: int, parallel: dict) -> list:
    """Run one PipeFusion request on this rank; return its events in program order."""
    rt = Runtime(rank, dist.get_world_size(), 0, torch.device("cpu"), dist.group.WORLD, time.time(),
                 timedelta(seconds=60))
    events, original = [], dist.batch_isend_irecv

    def recording(ops):
        recorded = []
        for op, work in zip(ops, original(ops)):
            group = (op.group.group_name, tuple(dist.get_process_group_ranks(op.group)))
            kind = "send" if op.op is dist.isend else "recv"
            recorded.append(_Recorded(work, len(events), events))
            events.append(("post", len(events), group, kind, op.peer, tuple(op.tensor.shape)))
        return recorded

    def after_step(done, total):
        events.append(("gate", done))
        return True

    dist.batch_isend_irecv = recording
    generator = torch.Generator().manual_seed(5)
    tensors = {"context": torch.randn(1, 8, 64, generator=generator), "pooled": torch.randn(1, 32, generator=generator)}
    request = SampleRequest.parse(Message("sample", {**FIELDS, "parallel": parallel}, tensors))
    with torch.no_grad():
        Executor(rt).generate(request, after_step)
    return events


def replay(programs: list[list]) -> None:
    """Run the ranks' programs under NCCL's rules (each rank blocks at a wait until the op is done,
    and at a gate until every rank is there; per rank and group, ops run in posting order; the
    op at the head of one rank's stream completes with the matching op at the head of its peer's).
    Raises AssertionError naming where every rank is stuck if no rank can move."""
    at = [0] * len(programs)
    streams = defaultdict(deque)  # (rank, group) → its posted ops, oldest first
    done, arrived = set(), defaultdict(set)
    connected, connecting = set(), defaultdict(set)  # (group, pair): connected; ranks waiting to connect it
    while True:
        moved = False
        for rank, program in enumerate(programs):
            while at[rank] < len(program):
                event = program[at[rank]]
                if event[0] == "post":
                    pair = (event[2], frozenset((rank, event[4])))
                    if pair not in connected:
                        connecting[pair].add(rank)
                        if len(connecting[pair]) < 2:
                            break  # blocked on the host until the peer posts on this group too
                        connected.add(pair)
                    streams[rank, event[2]].append((rank, *event[1:]))
                elif event[0] == "wait" and (rank, event[1]) not in done:
                    break
                elif event[0] == "gate":
                    arrived[event[1]].add(rank)
                    if len(arrived[event[1]]) < len(programs):
                        break
                at[rank] += 1
                moved = True
        for (rank, group), stream in list(streams.items()):
            if not stream or stream[0][3] != "send":
                continue
            _, number, _, _, peer, shape = stream[0]
            other = streams[peer, group]
            if other and other[0][3] == "recv" and other[0][4] == rank:
                assert other[0][5] == shape, f"rank {rank} sends {shape} to rank {peer}, which receives {other[0][5]}"
                done.update({(rank, number), (peer, other[0][1])})
                stream.popleft()
                other.popleft()
                moved = True
        if all(at[r] == len(p) for r, p in enumerate(programs)) and not any(streams.values()):
            return
        if not moved:
            heads = {key: stream[0][3:5] for key, stream in streams.items() if stream}
            raise AssertionError(f"deadlock: ranks at {[p[i] if i < len(p) else 'end' for p, i in zip(programs, at)]}, "
                                 f"streams' heads {heads}")


LAYOUTS = [{"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 0},  # step 0 pipelined too
           {"pipefusion": 4, "num_pipeline_patch": 4, "warmup_steps": 1}]  # the cycle went through 4 stages


@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
def test_pipefusion_traffic_completes_under_nccl_stream_order(parallel):
    programs = on_ranks(_record, parallel["pipefusion"], parallel)
    replay(programs)
    directions = defaultdict(set)  # group → (sender, receiver) of its ops
    for rank, program in enumerate(programs):
        for event in program:
            if event[0] == "post":
                pair = (rank, event[4]) if event[3] == "send" else (event[4], rank)
                directions[event[2]].add(pair)
    for (name, ranks), pairs in directions.items():
        assert len(ranks) == 2 and len(pairs) == 1, f"group {name} {ranks} carries {sorted(pairs)}: not one way"


def test_the_replay_finds_the_cycle_of_one_group_for_both_directions():
    """The check itself: stage 0 posting the receive of its return before its send, and stage 1
    receiving before it returns, is a deadlock on one group (what PipeFusion posted before it had
    links); with one group per direction it is still one while the links are not connected (each
    rank's first post blocks it until its peer posts on that group), and completes once the
    connection walk has run first."""
    def programs(forward, back, connect_first=False):
        walk0 = [("post", 10, forward, "send", 1, (1,)), ("wait", 10), ("post", 11, back, "recv", 1, (1,)), ("wait", 11)]
        walk1 = [("post", 10, forward, "recv", 0, (1,)), ("wait", 10), ("post", 11, back, "send", 0, (1,)), ("wait", 11)]
        stage0 = [("post", 0, back, "recv", 1, (4,)), ("post", 1, forward, "send", 1, (4,)), ("wait", 0)]
        stage1 = [("post", 0, forward, "recv", 0, (4,)), ("wait", 0), ("post", 1, back, "send", 0, (4,))]
        return [walk0 + stage0, walk1 + stage1] if connect_first else [stage0, stage1]

    one, forward, back = ("both", (0, 1)), ("0 to 1", (0, 1)), ("1 to 0", (0, 1))
    with pytest.raises(AssertionError, match="deadlock"):
        replay(programs(one, one, connect_first=True))
    with pytest.raises(AssertionError, match="deadlock"):
        replay(programs(forward, back))
    replay(programs(forward, back, connect_first=True))
