"""A stop asked in the middle of a step ends the generation before the next block (issue 25: a request whose
single step takes minutes could not be cancelled, and `stop` waited for the step): rank 0's ``stop_requested``
is asked before every block, and the executor serves the next request whole."""

from datetime import timedelta

import pytest
import torch

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.models import registry
from xdit_backend.parallel import shard
from xdit_backend.sampling.stop import GenerationStopped
from xdit_backend.service.executor import Executor
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message


def _request() -> SampleRequest:
    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)
    return SampleRequest.parse(Message("sample", {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2,
                                                  "seed": 1, "cfg": 1.0}, positive))


def test_a_stop_asked_mid_step_ends_the_generation_before_the_next_block():
    executor = Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    request = _request()
    whole, _ = executor.profiled(request, lambda done, total: True)
    blocks = len(shard.blocks_of(executor.computing))
    asked = []

    def stop_requested() -> bool:  # yes from the 4th question on: inside the first step's model call
        asked.append(len(asked))
        return len(asked) >= 4

    steps_done = []
    with pytest.raises(GenerationStopped):
        executor.profiled(request, lambda done, total: steps_done.append(done) or True, stop_requested)
    assert blocks > 4 and len(asked) == 4 and steps_done == []  # asked before each block, stopped at once, mid-step
    assert executor.stop_requested is None  # the question goes with its request
    again, _ = executor.profiled(request, lambda done, total: True)
    assert torch.equal(again, whole)


def test_with_several_ranks_on_nccl_a_stop_waits_for_the_steps_end():
    """On NCCL a peer waiting on rank 0 in a collective would not learn of a stop mid-step before half of
    --collective-timeout: there the executor asks nothing between blocks, and the stop comes at the step gate."""
    executor = Executor(Runtime(0, 2, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))
    assert executor.stops_between_blocks  # gloo: peers are told at once (agreement.agree_on_failure)
    executor.rt = Runtime(0, 2, 0, torch.device("cuda", 0), None, 0.0, timedelta(seconds=30))
    assert not executor.stops_between_blocks
    executor.rt = Runtime(0, 1, 0, torch.device("cuda", 0), None, 0.0, timedelta(seconds=30))
    assert executor.stops_between_blocks
