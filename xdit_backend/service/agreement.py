"""How every rank ends a request the same way: finished, stopped, or failed.

Rank 0 (leader.py) and the other ranks (follower.py) both run a request through ``run_request``,
so they issue the same collectives in the same order, whatever happens:

- finished: rank 0 closes the step gate with a STOP, the others pass the gate until they see it;
  then, with ``profile``, every rank's record is gathered;
- stopped: rank 0 stopped the gate (a cancel, a client that went away); every rank stopped at the
  same gate, and nothing more is exchanged;
- failed: a rank raised (or timed out waiting for one that did); it says so at the gate, every
  rank sees ``failed`` there, and all of them agree on what each saw (``agree_on_failure``).

A lost peer (PeerLost) is not an outcome: it ends the backend (worker.py).
"""

from __future__ import annotations

import gc
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..distributed.control import PeerLost, StepGate, gather_json, is_peer_failure
from ..distributed.runtime import Runtime
from ..errors import UserError
from ..memory.fit import NotEnoughMemory
from ..sampling.stop import GenerationStopped
from .executor import Executor, clear_frames
from .request import SampleRequest

log = logging.getLogger("xdit_backend.service.agreement")


@dataclass
class Outcome:
    """How a request ended on this rank (the same end on every rank)."""

    latent: torch.Tensor | None = None  # finished: the whole batch's latent (rank 0's is the reply)
    profile: list[dict] | None = None  # finished with ``profile``: every rank's record, by rank
    stopped: bool = False  # rank 0 stopped it at the gate (a cancel)
    failures: list | None = None  # failed: what each rank saw (None for a rank that only stopped), by rank


def run_request(rt: Runtime, gate: StepGate, executor: Executor, request: SampleRequest,
                after_step: Callable[[int, int], bool], stop_requested: Callable[[], bool] | None = None) -> Outcome:
    """Run ``request`` on this rank; ``after_step(done, total)`` meets the gate after each step
    (rank 0 says there whether to stop; with ``stop_requested``, rank 0 may also stop between two blocks:
    Executor.profiled). Every rank returns the same kind of Outcome (rank 0's decides the reply)."""
    gate.begin()
    try:
        latent, record = executor.profiled(request, after_step, stop_requested)
    except GenerationStopped as stop:
        clear_frames(stop)  # the stopped request's layout and links, before its groups are destroyed
        if gate.failed:  # another rank raised (or rank 0 stopped mid-step): agree on what happened, keep serving
            return Outcome(failures=agree_on_failure(rt, gate, executor, None))
        if gate.open:  # rank 0 stopped between two blocks: its peers may be waiting on it in a collective
            agree_on_failure(rt, gate, executor, None)  # they learn of it at once, as of a failure, and stop
        return Outcome(stopped=True)  # every rank stopped at the same gate, or rank 0 mid-step
    except PeerLost:
        raise
    except Exception as exc:  # this rank raised (or timed out waiting for one that did)
        log.exception("rank %d failed during the request", rt.rank)
        return Outcome(failures=agree_on_failure(rt, gate, executor, exc))
    if rt.rank == 0:
        gate.close()
    else:
        while gate.open and gate.passes():  # rank 0's closing STOP
            pass
    if not request.profile:
        return Outcome(latent)
    record = {**record, "request": request.to_fields()}  # what this rank ran, as it parsed it
    return Outcome(latent, gather_json(record, rt.control))


def agree_on_failure(rt: Runtime, gate: StepGate, executor: Executor, exc: BaseException | None) -> list:
    """Every rank, after a failed step: destroy the layouts' process groups (mesh.MeshCache.clear: a group with
    a collective that never completed is not reused; on CUDA its NCCL kernels still waiting for the rank that
    raised are aborted), meet at the gate (a rank that raised says so) and gather what each rank saw. The next
    request builds the groups again.

    The groups go first, and with them every reference to them the failed request left (its frames, through the
    exception's traceback): on gloo a group whose last reference is dropped closes its connections, so a peer
    waiting in a data collective or a PipeFusion receive with this rank fails at once ("Connection closed by
    peer", a peer failure) and comes to the gate, instead of waiting out half of ``--collective-timeout`` (about
    1 s instead of 30 at a 60 s timeout, under every layout; Denoiser and StepCache drop their groups when their
    generation ends, since something of a failed one can outlive it). On NCCL the peers' kernels are not
    told: they wait out that timeout, then the watchdog aborts their communicators and they arrive here too.
    If a rank is gone, the gate's collective fails and PeerLost ends the backend as before.
    """
    mine = None
    if exc is not None:
        said = exc.message if isinstance(exc, UserError) else str(exc)  # a user error's fixes go in its hint
        mine = {"rank": rt.rank, "error": f"{type(exc).__name__}: {said}"[:2000], "waiting": is_peer_failure(exc),
                "kind": "out_of_memory" if isinstance(exc, NotEnoughMemory) else "model_error",
                "hint": exc.hint if isinstance(exc, UserError) else "", "traceback": traceback.format_exc()[-4000:]}
        clear_frames(exc)  # the failed request's layout, links and pipeline: they keep its groups alive
    executor.meshes.clear()
    executor.forget_runs()
    if rt.world_size > 1:  # what still holds a group in a reference cycle (a suspended sampler's frame): gone
        gc.collect()  # before the gate (a few hundred ms of a big process: only where there are peers to tell)
    gate.fail()
    failures = gather_json(mine, rt.control)
    executor.release_memory()  # an out-of-memory's half-built tensors, before the next request
    return failures
