"""Every rank's start and end: join the process group, measure the links, describe this rank, leave together."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..launch import gpus
from ..launch.options import LaunchOptions
from ..launch.worker_env import START_FAULT_ENV
from . import compat, one_device
from .control import barrier
from .topology import Topology, prepare_nccl, probe


class StartupError(Exception):
    """A rank cannot start; the launcher shows this message with the rank's number."""


@dataclass
class Runtime:
    """This rank's place in the backend. The process groups live here, never in module globals."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: object  # a gloo group for commands and the step gate (the default group on CPU)
    started: float
    timeout: timedelta  # every collective's bound, the mesh groups' included (--collective-timeout)
    topology: Topology | None = None  # the links measured at start (topology.py); the same on every rank
    mixed_gpus: bool = False  # the ranks hold different GPU models: ancestral noise from the CPU (noise.StepNoise)
    local_world_size: int = 1  # the ranks on this host, which share its memory when they compute on the CPU
    data_backend: str | None = None  # the layouts' groups: "nccl" on CUDA, "gloo" on the CPU and in one_device's
    # test mode; None: the device's own

    def __post_init__(self):
        if self.data_backend is None:
            self.data_backend = "nccl" if self.device.type == "cuda" else "gloo"


def start_runtime(options: LaunchOptions) -> Runtime:
    """Join the process group (gloo on CPU, NCCL on CUDA), pin this rank to its device, and measure
    the links (NCCL_P2P_DISABLE is decided before the group exists: topology.py). In the test mode of
    one_device.py every rank of the node computes on device 0 and the data plane is gloo, through host memory."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    shared_device = one_device.enabled()
    peer, nccl_note = None, None
    too_old = compat.unsupported()
    if too_old:
        raise StartupError(too_old)
    if os.environ.get(START_FAULT_ENV) == os.environ.get("RANK", "0"):
        raise StartupError(f"rank {os.environ[START_FAULT_ENV]} cannot start (simulated by {START_FAULT_ENV})")
    if options.device == "cuda":
        if torch.cuda._is_in_bad_fork():  # the launcher's fork server started CUDA before forking this rank
            raise StartupError(
                "CUDA was initialised in the process this rank was forked from: a module in the launcher's "
                "RANK_PRELOAD touched the GPU at import; report it with the backend's log"
            )
        if not torch.cuda.is_available():
            raise StartupError(
                f"--device cuda, but torch {torch.__version__} sees no CUDA device on {socket.gethostname()}; "
                "start the backend with --device cpu, or install a CUDA build of torch"
            )
        if local_rank >= torch.cuda.device_count() and not shared_device:
            raise StartupError(
                f"local rank {local_rank} needs GPU {local_rank}, but only {torch.cuda.device_count()} are visible; "
                "start the backend with --nproc equal to the number of GPUs (or list them with --gpus)"
            )
        device = torch.device("cuda", 0 if shared_device else local_rank)
        torch.cuda.set_device(device)
        backend = "gloo" if shared_device else "nccl"
        if not shared_device:
            peer, nccl_note = prepare_nccl(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    else:
        device = torch.device("cpu")
        backend = "gloo"
    timeout = timedelta(seconds=options.collective_timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    if shared_device:
        one_device.stage_through_host()
    rt = Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, control, time.time(), timeout,
                 local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), data_backend=backend)
    return replace(rt, topology=probe(rt, peer, nccl_note, options.topology_probe))


def describe_rank(rt: Runtime) -> dict:
    """Who this rank is: its local device, and on a GPU the physical id (the CUDA_VISIBLE_DEVICES
    entry it runs on, or nvidia-smi's index) and its UUID, which names the card in every process.
    ``threads``: its CPU threads, the node's cores shared between its ranks (worker_env.py)."""
    cuda = rt.device.type == "cuda"
    return {"rank": rt.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(rt.device),
            "device_name": torch.cuda.get_device_name(rt.device) if cuda else "cpu",
            "gpu": gpus.physical_id(os.environ, rt.device.index) if cuda else None,
            "uuid": gpus.device_uuid(rt.device) if cuda else None,
            "threads": torch.get_num_threads()}


def leave_together(rt: Runtime) -> None:
    """End a clean shutdown: no rank leaves before every rank has finished.

    No destroy_process_group, and no interpreter teardown after it: measured here, a gloo rank that
    destroys its group while a peer is still connected aborts at exit ("terminate called without
    an active exception"), and so, under load, did a rank whose interpreter teardown ran while a
    peer was closing its connections (a SIGABRT, seen in a full test run on a loaded machine). Both turned clean shutdowns
    into failures. A rank the launcher forked returns to multiprocessing, which hands the agent its
    result and ends the process with ``os._exit`` (no C++ destructors; the OS releases the connections);
    run as a script, the worker's ``__main__`` does the same.
    """
    barrier(rt.control)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
