"""What differs between the torch releases the project runs on: the oldest it supports, and each newer
API it uses with what stands in for it on an older torch. Everything version-dependent is here; the
rest of the package calls these and never tests torch's version or attributes itself.

Why 2.7: ComfyUI's portable build and its install guide moved to torch 2.7 (CUDA 12.8) for the
RTX 50 series in 2025, and its users since run 2.7 to 2.15. Below 2.7, ``fully_shard`` has no
``ignored_params`` (parallel/shard.py keeps the non-block layers whole with it) and dynamo's
``recompile_limit`` (parallel/compile.py) is still ``cache_size_limit``.

What is newer than 2.7 and how it is bridged:
- ``dist.all_gather_single`` (2.13; before it, ``all_gather_into_tensor``, which 2.13 keeps as a
  deprecated alias): FSDP2 gathers a sharded block's weights with whichever its release has; the
  bench's traffic count wraps both names where they exist (parallel/traffic.py).
- FSDP2 over a block whose frozen parameters have several dtypes (an fp8 file's float8 matrices beside
  bf16 norms and float32 biases): 2.8 on (pytorch#154103); 2.7 asserts one dtype per block.
  parallel/shard.py then keeps the block's parameters of its minor dtypes whole on every rank (its
  biases and norms: a small share) and shards the rest (``fsdp_shards_mixed_dtypes``).
- FSDP2 over a frozen integer parameter (GGUF's raw uint8 blocks): 2.13 on, where FSDPParam makes its shard
  ``nn.Parameter(…, requires_grad=param.requires_grad)``; 2.11 makes it ``nn.Parameter(…)`` first, which an
  integer tensor refuses ("only Tensors of floating point dtype can require gradients"; seen on 2.11 by
  tools/torch-range.sh, 2.12 not tried). parallel/shard.py then keeps a GGUF model's quantized matrices whole on
  every rank and shards the rest (``fsdp_shards_integer_parameters``).
- The flight recorder's buffer variable: ``TORCH_FR_BUFFER_SIZE`` from 2.8 on, ``TORCH_NCCL_TRACE_BUFFER_SIZE``
  before (newer releases warn at the older name; NVIDIA/nvidia-resiliency-ext#163 splits them at 2.8):
  launch/worker_env.trace_buffer_env, which reads the installed version without importing torch (the launcher
  does not import it on a CPU start).
- ``init_device_mesh(backend_override=)`` and ``DeviceMesh._flatten`` (2.9; private): not used.
  distributed/mesh.py builds its groups with ``dist.new_group`` and wraps the shard group with
  ``DeviceMesh.from_group``, both the same from 2.7 on.

tests/ranks/test_compat.py runs each fallback on the pinned torch with the newer name removed;
tools/torch-range.sh runs a compatibility subset of the suite on the oldest and the newest torch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MIN_TORCH = (2, 7)

# torch.distributed's single-tensor all-gather under each name it has had, newest first
SINGLE_TENSOR_ALL_GATHER = ("all_gather_single", "all_gather_into_tensor")


def version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of torch's version string (this torch's by default): "2.11.0+cu130" → (2, 11)."""
    major, minor = (text or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def single_tensor_all_gathers() -> tuple[str, ...]:
    """The names under which torch.distributed's single-tensor all-gather can be called here (2.13 has
    both: FSDP2 calls the new one, and the old one calls torch's own, not the attribute, so wrapping
    both counts each gather once)."""
    return tuple(name for name in SINGLE_TENSOR_ALL_GATHER if hasattr(dist, name))


def fsdp_shards_mixed_dtypes() -> bool:
    """Whether ``fully_shard`` takes a module whose frozen parameters have several dtypes (torch 2.8 on)."""
    return version() >= (2, 8)


def fsdp_shards_integer_parameters() -> bool:
    """Whether ``fully_shard`` takes a frozen integer parameter (GGUF's uint8 blocks): verified from 2.13 on."""
    return version() >= (2, 13)


def unsupported(text: str | None = None) -> str | None:
    """Why this torch is too old for the backend, with the fix; None when it is supported."""
    found = text or torch.__version__
    if version(found) >= MIN_TORCH:
        return None
    oldest = ".".join(map(str, MIN_TORCH))
    return (f"torch {found} is older than {oldest}, the oldest the backend runs on (FSDP2's ignored_params, "
            f"dynamo's recompile_limit); install torch>={oldest} built for your CUDA, e.g. "
            f"pip install 'torch>={oldest}' --index-url https://download.pytorch.org/whl/cu128")
