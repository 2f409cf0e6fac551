"""Run a function on every rank of a gloo world of spawned processes, and collect what each returns.

The ranks fork from one fork server per test process, which imports torch and diffusers' transformer classes
once (as the launcher's does for a backend's ranks): each rank starts in a fraction of a second instead of
importing them again (~7 s of CPU)."""

import os
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def on_ranks(target, world: int, *args, timeout: float = 180) -> list:
    """``target(rank, *args)`` on ranks 0..world−1 (module-level, so a spawned process can import it);
    returns the values by rank, or raises with the first failing rank's traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch.distributed", "diffusers.models.transformers",
                                    "xdit_backend.models.registry"])
    results = context.Queue()
    processes = [context.Process(target=_rank, args=(target, rank, world, port, results, args))
                 for rank in range(world)]
    for process in processes:
        process.start()
    try:
        answers = dict(results.get(timeout=timeout) for _ in range(world))
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failed = [(rank, text) for rank, (ok, text) in sorted(answers.items()) if not ok]
    assert not failed, f"rank {failed[0][0]} raised:\n{failed[0][1]}"
    return [answers[rank][1] for rank in range(world)]


def _rank(target, rank: int, world: int, port: int, results, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        answer = (True, target(rank, *args))
    except BaseException:
        answer = (False, traceback.format_exc())
    results.put((rank, answer))
    results.close()
    results.join_thread()
    os._exit(0)  # no group teardown while a peer may still be connected (runtime.leave_together)
