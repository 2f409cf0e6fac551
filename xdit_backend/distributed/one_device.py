"""A test mode: every rank of a node on one device, the data plane on gloo through host memory.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a machine with one GPU cannot run a multi-rank
layout on NCCL (review gpu-paths-2 C.3). With ``XDIT_TEST_ONE_DEVICE=1`` in the ranks' environment (tests and
the selftest only), every rank computes on device 0 of its node (``cuda:0``, or the CPU), every group is a gloo
group, and the torch.distributed entry points the data plane uses (those parallel/traffic.py counts, and the
all-reduce) copy their tensors to host memory, run there on gloo, and copy the results back to the device when
the work is waited for: a point-to-point receive, like NCCL's, completes only when it is waited for, so a receive
posted ahead (PipeFusion's) does not block its rank. Every layout's CUDA kernels then run at their shard shapes,
FSDP2's gathers and yunchang's all-to-alls and rings included, and are compared with serial on the same GPU (the
selftest's ``ranks`` section). What it cannot show: NCCL's own ordering and connection rules
(tests/ranks/test_pipefusion_transport.py replays them) and the links' speed. Every rank sees the whole device's
free memory, so the fit check is given a budget (``XDIT_TEST_MEMORY_BUDGET``). On the CPU the copies are copies
into new host buffers, so the CPU tests run this same code.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from . import compat

ENV = "XDIT_TEST_ONE_DEVICE"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV) == "1"


class StagedWork(dist.Work):
    """Gloo's work on host copies of a collective's or send's tensors; waiting for it copies each host result
    back into the device tensor it stands for. ``copies``: (device tensor, host tensor) pairs."""

    def __init__(self, works: list, copies: list[tuple[torch.Tensor, torch.Tensor]]):
        super().__init__()
        self.works, self.copies = works, copies

    def wait(self, timeout=None) -> bool:
        for work in self.works:
            work.wait()
        for device_tensor, host in self.copies:
            device_tensor.copy_(host)
        self.works, self.copies = [], []
        return True

    def is_completed(self) -> bool:
        return not self.works


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _finish(works: list, copies: list, async_op: bool):
    staged = StagedWork([work for work in works if work is not None], copies)
    if async_op:
        return staged
    staged.wait()
    return None


def stage_through_host() -> None:
    """Replace the data plane's torch.distributed entry points in this rank's process by host-staged ones (once,
    at start: a compiled block's guards see these from its first compile on)."""
    originals = {name: getattr(dist, name) for name in ("all_gather", *compat.single_tensor_all_gathers(),
                                                        "all_to_all_single", "all_reduce", "broadcast",
                                                        "batch_isend_irecv")}

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        hosts = [torch.empty_like(t, device="cpu") for t in tensor_list]
        work = originals["all_gather"](hosts, _host(tensor), group=group, async_op=True)
        return _finish([work], list(zip(tensor_list, hosts)), async_op)

    def single_tensor_all_gather(name: str):
        def gather(output_tensor, input_tensor, group=None, async_op=False):
            host = torch.empty_like(output_tensor, device="cpu")
            work = originals[name](host, _host(input_tensor), group=group, async_op=True)
            return _finish([work], [(output_tensor, host)], async_op)

        return gather

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        host = torch.empty_like(output, device="cpu")
        work = originals["all_to_all_single"](host, _host(input), output_split_sizes, input_split_sizes,
                                              group=group, async_op=True)
        return _finish([work], [(output, host)], async_op)

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        host = _host(tensor)
        work = originals["all_reduce"](host, op=op, group=group, async_op=True)
        return _finish([work], [(tensor, host)], async_op)

    def broadcast(tensor, src=None, group=None, async_op=False, **more):
        host = _host(tensor)
        work = originals["broadcast"](host, src=src, group=group, async_op=True, **more)
        return _finish([work], [(tensor, host)], async_op)

    def batch_isend_irecv(p2p_op_list):
        # a send's host copy is taken now (the device tensor may change after the call, as NCCL allows once the
        # stream has it); a receive lands in its host buffer and reaches the device tensor when waited for
        hosts = [_host(op.tensor) if op.op is dist.isend else torch.empty_like(op.tensor, device="cpu")
                 for op in p2p_op_list]
        works = originals["batch_isend_irecv"]([dist.P2POp(op.op, host, op.peer, op.group, op.tag)
                                                 for op, host in zip(p2p_op_list, hosts)])
        return [StagedWork([work], [] if op.op is dist.isend else [(op.tensor, host)])
                for op, host, work in zip(p2p_op_list, hosts, works)]

    wrappers = {"all_gather": all_gather, **{name: single_tensor_all_gather(name)
                                              for name in compat.single_tensor_all_gathers()},
                "all_to_all_single": all_to_all_single, "all_reduce": all_reduce, "broadcast": broadcast,
                "batch_isend_irecv": batch_isend_irecv}
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)
