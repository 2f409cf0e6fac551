"""The loop of every rank but 0: execute what rank 0 broadcasts (leader.py) until it says shutdown."""

from __future__ import annotations

from ..distributed.control import StepGate, broadcast_message, gather_json
from ..distributed.runtime import Runtime
from .agreement import run_request
from .evaluate_request import EvaluateRequest
from .executor import Executor
from .request import SampleRequest


def follow(rt: Runtime) -> None:
    """Ranks other than 0: execute what rank 0 broadcasts until it says shutdown."""
    gate = StepGate(rt.control)
    executor = Executor(rt)
    while True:
        command = broadcast_message(None, rt.control)
        if command is None:
            continue  # heartbeat
        if command.type == "shutdown":
            return
        if command.type == "status":  # rank 0 gathers every rank's memory (leader.refresh_memory)
            gather_json(executor.memory_record(), rt.control)
        elif command.type == "unload":
            executor.unload(command.fields.get("model"))
        elif command.type == "sample":
            request = SampleRequest.parse(command)  # rank 0's to_fields(): the request it runs
            run_request(rt, gate, executor, request, lambda done, total: gate.passes())
        elif command.type == "evaluate":  # one model call of ComfyUI's sampler (the xDiT MODEL)
            run_request(rt, gate, executor, EvaluateRequest.parse(command), lambda done, total: gate.passes())
