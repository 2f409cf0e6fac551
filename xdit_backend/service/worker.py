"""Every rank of the backend: join the process group, then rank 0 leads and the others follow.

Started by launcher.py through torch.distributed.run: each rank is forked from the launcher's fork server
and runs ``main`` with the launch options as flags (LaunchOptions.to_argv). The parts:

- runtime.py: the process group, this rank's device, and leaving together at a clean shutdown;
- executor.py: what every rank holds (models, meshes per layout) and one generation;
- leader.py: rank 0's loop: the socket server's jobs, resolved, broadcast, run, answered;
- follower.py: the other ranks' loop: what rank 0 broadcasts;
- agreement.py: how every rank ends a request the same way (finished, stopped, failed), used by both.

Every step ends at the step gate, so a cancel or a failure stops all ranks within one step (within
two under PipeFusion, whose stages meet each step's gate where they stand: parallel/schedule.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ..distributed.control import PeerLost, gather_json, is_peer_failure
from ..distributed.runtime import describe_rank, leave_together, start_runtime
from ..errors import EXIT_PEER_LOST
from ..launch.idle import IdleClock
from ..launch.options import LaunchOptions, tcp_address
from ..launch.watch import record_pid
from ..wire import paths, protocol
from .follower import follow
from .leader import Leader

log = logging.getLogger("xdit_backend.service.worker")


def parse_args(argv: list[str] | None = None) -> LaunchOptions:
    """The launch options the launcher passed on (LaunchOptions.to_argv)."""
    parser = argparse.ArgumentParser(prog="python -m xdit_backend.service.worker")
    LaunchOptions.add_arguments(parser)
    return LaunchOptions.from_args(parser.parse_args(argv))


# The launcher's agent reports the first rank it finds ended (it looks every 0.2 s) and ends the others: a rank
# that ends because another did waits this long first, so the agent finds the cause (say, a rank killed by
# SIGKILL) and names it, rather than the ranks that lost contact with it.
EFFECT_EXIT_DELAY_S = 3.0


def exit_after_the_cause() -> None:
    logging.shutdown()
    time.sleep(EFFECT_EXIT_DELAY_S)
    os._exit(EXIT_PEER_LOST)


@record
def run(options: LaunchOptions) -> None:
    record_pid(paths.rank_pids(options.socket), int(os.environ.get("RANK", "0")))  # the launcher watches it
    rt = start_runtime(options)
    ranks = gather_json(describe_rank(rt), rt.control)  # also proves every rank is up
    rt = replace(rt, mixed_gpus=len({r["device_name"] for r in ranks}) > 1)
    if rt.rank != 0:
        try:
            follow(rt)
            leave_together(rt)
        except PeerLost as exc:
            log.error("rank %d lost contact with rank 0: %s", rt.rank, exc)
            exit_after_the_cause()
        except Exception as exc:  # e.g. inside the model: record why, then leave at once
            if is_peer_failure(exc):  # an effect of another rank's end, not a cause
                log.error("rank %d lost contact with another rank: %s", rt.rank, exc)
                exit_after_the_cause()
            log.exception("rank %d failed", rt.rank)
            ErrorHandler().record_exception(exc)  # the launcher reads it: the failure names this rank and error
            os._exit(1)  # not a normal exit: a live gloo group can abort interpreter shutdown
        return
    limits = protocol.Limits(max_payload_bytes=options.max_payload_mb << 20)
    tcp = tcp_address(options.tcp) if options.tcp else None
    token = Path(options.token_file).read_text().strip() if options.tcp else None
    leader = Leader(rt, ranks, options.socket, limits, options.heartbeat, options.model_roots, tcp, token,
                    IdleClock(options.idle_unload, options.idle_stop))
    server = leader.server
    server.start()
    log.info("backend ready: world size %d, socket %s", rt.world_size, options.socket)
    try:
        leader.serve()
    except PeerLost as exc:
        message = f"rank 0 lost contact with another rank ({exc}); the backend is stopping"
        log.error(message)
        server.fail_all("rank_failed", message, "the next request restarts the backend", rank=0)
        server.close()
        exit_after_the_cause()
    server.close()
    leave_together(rt)


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s")
    run(options)


if __name__ == "__main__":  # a rank by hand; the launcher forks ranks and calls main itself (launcher.rank_main)
    main()
    os._exit(0)  # without interpreter teardown (runtime.leave_together)
