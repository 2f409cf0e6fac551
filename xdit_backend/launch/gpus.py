"""Which GPUs: the ones a process may use, the ones ``--gpus`` picks, and how a rank names its own.

CUDA numbers the GPUs a process sees from 0, in the order of ``CUDA_VISIBLE_DEVICES`` when it is
set (ComfyUI's ``--cuda-device N`` sets it to ``N``). ``--gpus`` counts within that list, so a
backend started from such a process stays on the GPUs the process was given. A rank reports the
list's entry it runs on (its *physical* id: nvidia-smi's index, or a ``GPU-…`` UUID if the list
holds those) and its device's UUID, next to its local ``cuda:i``. Light on purpose (torch only
inside ``device_uuid``): the launcher options, the ranks and the
ComfyUI nodes use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import LaunchError

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def visible_list(env: Mapping[str, str]) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` in ``env``; None when it is unset (every GPU visible)."""
    text = env.get(VISIBLE_ENV)
    if text is None:
        return None
    return [entry.strip() for entry in text.split(",") if entry.strip()]


def available_gpus(env: Mapping[str, str], device_count: int) -> list[str]:
    """The physical ids of the ``device_count`` GPUs a process with ``env`` sees, in CUDA's order.

    CUDA hides every entry from the first one it cannot use, so only the first ``device_count``
    entries count (ComfyUI's ``--default-device 2`` lists 32 indices on a 4-GPU machine: 2,0,1,3
    are the GPUs).
    """
    visible = visible_list(env)
    if visible is None:
        return [str(index) for index in range(device_count)]
    return visible[:device_count]


def chosen_gpus(env: Mapping[str, str], indices: Sequence[int], device_count: int) -> list[str]:
    """The physical ids ``--gpus indices`` names: positions in the GPUs a process with ``env`` sees."""
    available = available_gpus(env, device_count)
    outside = [index for index in indices if not 0 <= index < len(available)]
    if outside:
        visible = env.get(VISIBLE_ENV)
        seen = (f"{len(available)} GPU(s): {VISIBLE_ENV}={visible} in the environment the backend is started from "
                "(ComfyUI's --cuda-device sets it), and the GPUs asked for count within that list"
                if visible is not None else f"{len(available)} GPU(s)")
        fix = f"use indices 0..{len(available) - 1}" if available else "check that torch sees the GPUs"
        if visible is not None:
            fix += f", or start ComfyUI (or the backend) without {VISIBLE_ENV} restricting it"
        raise LaunchError(f"gpus {','.join(map(str, indices))}: no GPU {','.join(map(str, outside))} "
                          f"among the {seen}; {fix}")
    return [available[index] for index in indices]


def physical_id(env: Mapping[str, str], local_index: int) -> str:
    """The physical id of the GPU this process calls ``cuda:local_index``."""
    visible = visible_list(env)
    return visible[local_index] if visible is not None else str(local_index)


def device_uuid(device) -> str | None:
    """``GPU-…``, as nvidia-smi -L and CUDA_VISIBLE_DEVICES write it; None when torch cannot tell."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def local_ranks(ranks: list[dict], host: str) -> list[dict]:
    """The ranks of a backend's status that run on ``host`` (a multi-node backend has others)."""
    return [rank for rank in ranks if rank.get("host") == host]


def rank_gpus(ranks: list[dict], host: str) -> list[str]:
    """The physical ids of the GPUs a backend's ranks on ``host`` run on (CPU ranks have none)."""
    return [rank["gpu"] for rank in local_ranks(ranks, host) if rank.get("gpu") is not None]


def running_elsewhere(ranks: list[dict], env: Mapping[str, str], indices: Sequence[int], device_count: int,
                      host: str) -> str | None:
    """Why a running backend's ranks on ``host`` are not on the GPUs ``--gpus indices`` would give
    a backend started from ``env``; None when they are. Both sides as physical ids."""
    wanted = chosen_gpus(env, indices, device_count)
    running = rank_gpus(ranks, host)
    if sorted(running) == sorted(wanted):
        return None
    within = f" (GPUs {','.join(map(str, indices))} of {VISIBLE_ENV}={env[VISIBLE_ENV]})" if VISIBLE_ENV in env else ""
    return f"the backend runs on GPUs {','.join(running) or 'none'}, this request asks for GPUs {','.join(wanted)}{within}"


def uses_gpu(ranks: list[dict], uuid: str | None, host: str) -> bool:
    """Whether a backend's ranks on ``host`` may run on the GPU with ``uuid``: True unless every
    GPU rank reports a UUID and none is this one (an unknown UUID might be any GPU)."""
    uuids = {rank.get("uuid") for rank in local_ranks(ranks, host) if rank.get("gpu") is not None}
    if not uuids:  # no GPU rank here
        return False
    return uuid is None or None in uuids or uuid in uuids
