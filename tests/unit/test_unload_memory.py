"""``unload`` lets the model go: no reference survives in the executor (the last request's model is
kept for its profile, not past an unload), so the memory can go back to the device."""

import gc
import weakref
from datetime import timedelta

import torch

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.models import registry
from xdit_backend.service.executor import Executor
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message


def test_unload_drops_every_reference_to_the_model():
    rt = Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30))
    executor = Executor(rt)
    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, 1, spec)
    request = SampleRequest.parse(Message("sample", {"model": "flux-tiny", "width": 64, "height": 64, "steps": 1,
                                                     "seed": 1}, positive))
    executor.generate(request, lambda done, total: True)
    alive = weakref.ref(executor.computing.transformer)
    assert executor.unload(None) == ["flux-tiny"]
    gc.collect()
    assert alive() is None, gc.get_referrers(alive())
