"""The environment every rank starts with, built from the launcher's own (ComfyUI's, when the node
starts the backend) by one pure function, so what the ranks inherit is decided here, not by chance.

- The GPUs: ``--gpus`` counts within the parent's ``CUDA_VISIBLE_DEVICES`` (gpus.py), and
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` makes the numbers nvidia-smi's (CUDA's default puts the fastest
  GPU first, so on a machine with mixed GPUs 0 and 1 would be other cards).
- The allocator: ComfyUI sets ``PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync``; the ranks use
  PyTorch's caching allocator with ``expandable_segments:True`` instead (the allocator the
  backend's memory figures assume; expandable segments keep fragmentation low). Other settings stay.
- NCCL: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (CleanUpOnly: a timed-out collective aborts its
  communicator, not the process; torch.distributed.elastic would otherwise pass on 1, which ends
  the process) and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with a flight-recorder buffer, dumped beside
  the socket (which collective hung, on which rank); ``TORCH_NCCL_ENABLE_MONITORING=0`` (NCCL's
  heartbeat monitor would end every rank minutes after a timeout that the backend survived).
- CPU threads: the machine's cores shared between the ranks of this node, for PyTorch's intra-op
  pool (``OMP_NUM_THREADS``) and Inductor's compile workers (``TORCHINDUCTOR_COMPILE_THREADS``),
  on GPUs too: every rank casts weights, reads LoRAs and compiles on the CPU.

A variable the user set is kept, except the asynchronous allocator backend, which is replaced
and said so, and ``CUDA_VISIBLE_DEVICES``, which ``--gpus`` narrows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..wire import paths
from . import gpus
from .options import LaunchOptions

ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the older name and the newer one
ASYNC_BACKEND = "backend:cudaMallocAsync"
EXPANDABLE = "expandable_segments:True"

# set unless the user set them (values are strings, as in any environment)
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",  # CleanUpOnly: a timeout aborts the communicator, not the process
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # the flight recorder's dump when the watchdog sees a timeout
    # No heartbeat monitor: after any watchdog event it ends every rank TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
    # (8 min) later, CleanUpOnly or not, so a backend that reported a failed request and kept serving would
    # die idle minutes later (review gpu-paths-2 B3). The backend watches its ranks itself (heartbeat, gate).
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
TRACE_BUFFER_ENVS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # the newer name and the older one
FR_NAME_FROM = (2, 8)  # torch reads TORCH_FR_BUFFER_SIZE from 2.8 on and warns at the older name after it
TRACE_BUFFER = "2000"  # collectives the flight recorder keeps per rank (without any, nothing is dumped)
TRACE_FILE_ENV = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"  # the dump's path prefix; the rank's number is appended
# Tests and the selftest only: a file; "RANK:N" written there makes rank RANK's N-th model call of the next
# request raise a simulated out-of-memory (service/executor.py)
FAULT_ENV = "XDIT_TEST_FAULT"
# Tests only: the rank of this number fails its start as a rank that cannot (its GPU missing) does, on any machine
START_FAULT_ENV = "XDIT_TEST_START_FAULT"
THREAD_ENVS = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")


@dataclass
class WorkerEnvironment:
    env: dict[str, str]  # the whole environment of every rank of this node
    notes: list[str] = field(default_factory=list)  # what was changed from the parent's, for the log


def worker_environment(parent_env: Mapping[str, str], options: LaunchOptions, *, cpu_count: int,
                       gpu_count: int) -> WorkerEnvironment:
    """The ranks' environment: ``parent_env`` with the GPUs, allocator, NCCL and thread settings
    above. ``options`` are resolved (device and nproc known); ``cpu_count`` is this machine's usable
    cores, ``gpu_count`` the GPUs the parent sees (what ``--gpus`` indexes when no list is set)."""
    env = dict(parent_env)
    notes = []
    if options.device == "cuda":
        if options.gpus:
            env[gpus.VISIBLE_ENV] = ",".join(gpus.chosen_gpus(parent_env, options.gpus, gpu_count))
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    for name in ALLOC_CONF_ENVS:
        if ASYNC_BACKEND in env.get(name, "").replace(" ", ""):
            env[name] = without_async_backend(env[name])
            notes.append(f"{name}={parent_env[name]} becomes {name}={env[name]} for the ranks: they use PyTorch's "
                         "caching allocator (cudaMallocAsync is ComfyUI's default)")
    for name, value in NCCL_DEFAULTS.items():
        env.setdefault(name, value)
    if not any(name in env for name in TRACE_BUFFER_ENVS):
        env[trace_buffer_env()] = TRACE_BUFFER
    env.setdefault(TRACE_FILE_ENV, str(paths.nccl_trace_prefix(options.socket)))
    threads = str(max(1, cpu_count // options.nproc))  # this node's cores shared between its ranks
    for name in THREAD_ENVS:
        env.setdefault(name, threads)
    return WorkerEnvironment(env, notes)


def trace_buffer_env(torch_version: str | None = None) -> str:
    """The flight recorder's buffer variable the installed torch reads without a deprecation warning (each rank
    warned twice at the older name on 2.13): from the installed version's number, without importing torch here."""
    from importlib.metadata import version

    major, minor = (torch_version or version("torch")).split("+")[0].split(".")[:2]
    return TRACE_BUFFER_ENVS[0] if (int(major), int(minor)) >= FR_NAME_FROM else TRACE_BUFFER_ENVS[1]


def without_async_backend(conf: str) -> str:
    """An allocator setting with ``backend:cudaMallocAsync`` replaced by ``expandable_segments:True``,
    unless the setting chooses expandable segments itself; its other entries kept, in order."""
    entries = [entry.strip() for entry in conf.split(",") if entry.strip()]
    kept = [entry for entry in entries if entry.replace(" ", "") != ASYNC_BACKEND]
    if not any(entry.split(":")[0].strip() == "expandable_segments" for entry in kept):
        kept.append(EXPANDABLE)
    return ",".join(kept)


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
