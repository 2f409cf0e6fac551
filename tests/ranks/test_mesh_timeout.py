"""The mesh's groups carry the timeout they are given (the worker gives half of
--collective-timeout), not torch's 30-minute default: a data collective whose peer stops
answering fails within it."""

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.distributed.mesh import MeshCache

TIMEOUT_S = 3


def _rank(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    layout = MeshCache("cpu", timedelta(seconds=TIMEOUT_S)).get(ParallelConfig(ulysses=2))
    group = layout.sequence_group
    tensor = torch.ones(1)
    dist.all_reduce(tensor, group=group)  # the group works
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # stops answering
    else:
        started = time.monotonic()
        try:
            dist.all_reduce(tensor, group=group)
            results.put(("returned", 0.0))
        except RuntimeError:
            results.put(("timed out", time.monotonic() - started))
    dist.barrier()
    os._exit(0)


def test_a_mesh_collective_fails_within_the_backend_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    outcome, took = results.get(timeout=120)
    for process in processes:
        process.join(timeout=60)
    assert outcome == "timed out" and took < 2 * TIMEOUT_S, (outcome, took)
