"""What every rank holds and does for a request: loaded models, meshes per layout, one generation."""

from __future__ import annotations

import gc
import os
import resource
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from . import attention
from .compile import compile_blocks
from .mesh import MeshCache
from .models import lora, registry
from .parallel import shard, traffic
from .parallel.denoiser import Denoiser
from .parallel.pipefusion import PipeFusion, keep_stage, stage_bounds
from .request import SampleRequest, compute_dtype
from .runtime import Runtime
from .sampling.generate import generate
from .step_clock import StepClock

FAULT_ENV = "XDIT_TEST_FAULT"  # tests only: "RANK:N" makes rank RANK's N-th model call raise MemoryError


class Executor:
    """What every rank holds and does: loaded models, meshes per layout, and one generation."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.models: dict[tuple, object] = {}  # (name or path, file version, dtype, LoRAs, compiled, weight_dtype, shard ranks) → model
        self.stages: dict[tuple, tuple[object, list]] = {}  # + PipeFusion block range
        # The layouts' data collectives wait half as long as the control group: after a rank raises,
        # the ranks stuck waiting for it time out and reach the step gate while it still waits there.
        self.meshes = MeshCache(rt.device.type, rt.timeout / 2)
        self.last_trace: list = []  # PipeFusion's receive trace of the last request (for the profile)
        self.computing = None  # the model (or stage) the last request ran on

    def model(self, name: str, dtype: str = "auto", loras=(), compiled: bool = False,
              weight_dtype: str = "default", shard_mesh=None):
        """The loaded model, cached by identity, dtype, LoRAs, compilation, weight_dtype and shard mesh (its
        blocks sharded over it, parallel/shard.py): a changed file (new mtime) is loaded again. A compiled
        model is a separate entry (its own weights), reused by later requests."""
        torch_dtype = compute_dtype(dtype, self.rt.device)
        path, version = registry.identity(name)
        key = (path, version, str(torch_dtype).removeprefix("torch."), lora.identity(list(loras)), compiled,
               weight_dtype, _shard_key(shard_mesh))
        if not _current(self.models.get(key), shard_mesh):
            self.models = {k: m for k, m in self.models.items() if k[0] != path or k[1] == version}  # stale file
            model = registry.build(name, self._load_device(shard_mesh), torch_dtype, loras, weight_dtype=weight_dtype)
            if shard_mesh is not None:
                shard.shard_blocks(model, shard_mesh, self.rt.device)
            self.models[key] = compile_blocks(model) if compiled else model
        return self.models[key]

    def _load_device(self, shard_mesh) -> torch.device:
        """Where a model is built: its device, or for a sharded model the CPU, from where each block
        moves to the device as it is sharded (the device never holds a whole copy; shard.py)."""
        return torch.device("cpu") if shard_mesh is not None else self.rt.device

    def loaded(self) -> list[str]:
        def describe(key):
            loras = f", {len(key[3])} LoRA" if key[3] else ""
            compiled = ", compiled" if key[4] else ""
            sharded = f", sharded {len(key[6])} ways" if key[6] else ""
            return f"{key[0]} ({key[2]}{loras}{compiled}{sharded})"

        return sorted({describe(key) for key in [*self.models, *self.stages]})

    def unload(self, model: str | None) -> list[str]:
        """Drop a model (every version, dtype and stage of it), or all of them; returns what was loaded."""
        names = {key[0] for key in [*self.models, *self.stages]}
        if model:
            wanted = {model, str(Path(model).expanduser().resolve())}
            names &= wanted
        self.models = {k: v for k, v in self.models.items() if k[0] not in names}
        self.stages = {k: v for k, v in self.stages.items() if k[0] not in names}
        if self.computing is not None and self.computing.name in names:
            self.computing = None  # the last request's model, held for its profile: not past an unload
        self.release_memory()
        return sorted(names)

    def release_memory(self) -> None:
        """Give what dropped models and a failed request's tensors held back to the device: without
        ``empty_cache`` PyTorch's caching allocator keeps it, and nothing else on the GPU (ComfyUI's
        VAE Decode on GPU 0) can use it."""
        gc.collect()
        if self.rt.device.type == "cuda":
            torch.cuda.empty_cache()

    def stage_model(self, name: str, layout, dtype: str = "auto", loras=(),
                    compiled: bool = False, weight_dtype: str = "default") -> tuple[object, list]:
        """The model with only this rank's PipeFusion stage of blocks (cached per stage; sharded over the
        stage's ranks with shard_weights), and those blocks."""
        config = layout.config
        bounds = stage_bounds(registry.block_sizes(name), config.pipefusion, config.pipefusion_blocks)
        start, end = bounds[layout.index("pipefusion")]
        torch_dtype = compute_dtype(dtype, self.rt.device)
        key = (*registry.identity(name), str(torch_dtype).removeprefix("torch."), lora.identity(list(loras)), compiled,
               weight_dtype, _shard_key(layout.shard_mesh), start, end)
        if not _current(self.stages.get(key, (None,))[0], layout.shard_mesh):
            # Only this stage's tensors are drawn or read, straight onto the device (the same
            # values as the whole model's); the other stages' blocks stay on meta and are dropped.
            model = registry.build(name, self._load_device(layout.shard_mesh), torch_dtype, loras, blocks=(start, end),
                                   weight_dtype=weight_dtype)
            blocks = keep_stage(model.transformer, model.spec.stage_plan, start, end)
            if layout.shard_mesh is not None:
                shard.shard_blocks(model, layout.shard_mesh, self.rt.device)
            self.stages[key] = (compile_blocks(model) if compiled else model, blocks)
        return self.stages[key]

    def generate(self, request: SampleRequest, after_step) -> torch.Tensor:
        """Run a validated request (its layout and conditioning resolved by rank 0) on this rank."""
        layout = self.meshes.get(request.parallel) if self.rt.world_size > 1 else None
        spec = registry.spec(request.model)
        gen = replace(request.generation(spec, *request.conditioning(spec)), cpu_noise=self.rt.mixed_gpus)
        if layout is None or layout.config.pipefusion == 1:
            shard_mesh = layout.shard_mesh if layout else None
            self.computing = self.model(request.model, request.dtype, request.loras, request.compile,
                                        request.weight_dtype, shard_mesh)
            _inject_fault(self.computing, self.rt.rank)
            return generate(Denoiser(self.computing, layout), gen, after_step)
        stage, blocks = self.stage_model(request.model, layout, request.dtype, request.loras, request.compile,
                                         request.weight_dtype)
        self.computing = stage
        _inject_fault(stage, self.rt.rank, blocks[0])
        denoiser = Denoiser(stage, layout)  # the batch rows of this dp group, and their gather
        pipeline = PipeFusion(stage, layout, self.rt.device, blocks)
        self.last_trace = pipeline.trace
        latent = pipeline.run(gen, denoiser.rows(request.batch), after_step)
        return denoiser.gather_rows(latent).cpu()

    def profiled(self, request: SampleRequest, after_step) -> tuple[torch.Tensor, dict]:
        """``generate`` plus this rank's record: seconds per step, bytes sent (None for a compiled model),
        peak memory, the compute dtype and the attention that ran."""
        if not request.profile:
            return self.generate(request, after_step), {}
        cuda = self.rt.device.type == "cuda"
        clock = StepClock(self.rt.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.rt.device)
        clock.mark()

        def timed(done: int, total: int) -> bool:
            clock.mark()
            return after_step(done, total)

        groups_before = _process_groups()
        started = time.perf_counter()
        with traffic.counting(request.compile) as sent:  # None when compiled (traffic.py says why)
            latent = self.generate(request, timed)  # ends on the CPU: a real synchronisation, as in production
        denoise_s = time.perf_counter() - started
        steps = clock.steps()
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.rt.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        dtype = compute_dtype(request.dtype, self.rt.device)
        head_dim = self.computing.transformer.config.attention_head_dim
        ours = request.parallel.sequence > 1 or request.parallel.pipefusion > 1  # our kernel, else diffusers' SDPA
        return latent, {"rank": self.rt.rank, "step_s": steps, "denoise_s": denoise_s,
                        "sent_bytes": None if sent is None else dict(sent),
                        "dtype": str(dtype).removeprefix("torch."),
                        "attention": attention.in_use(self.rt.device, dtype, head_dim, ours),
                        "peak_memory_bytes": peak,
                        "memory_kind": "cuda allocated" if cuda else "process peak RSS",
                        "process_groups_created": _process_groups() - groups_before,
                        "parameters": sum(p.numel() for p in self.computing.transformer.parameters()),
                        "resident_parameter_bytes": shard.resident_bytes(self.computing.transformer),
                        # bytes a rank sends (= receives) to gather its blocks once each: the count's formula
                        "shard_bytes_per_pass": (shard.gathered_bytes(shard.blocks_of(self.computing),
                                                                      request.parallel.shard_size)
                                                 if request.parallel.shard_weights else None),
                        "pipeline_trace": self.last_trace}


def _inject_fault(model, rank: int, first_block=None) -> None:
    """With XDIT_TEST_FAULT=RANK:N set (tests only), rank RANK's N-th model call raises MemoryError,
    as an out-of-memory inside the model would. A model call is a pass through the first block this
    rank holds: once per forward on the normal path, once per patch and step in a PipeFusion stage."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or getattr(model, "fault_injected", False) or int(spec.split(":")[0]) != rank:
        return
    calls, target = [0], int(spec.split(":")[1])
    if first_block is None:  # the whole model: its first block
        first_block = getattr(model.transformer, model.spec.stage_plan.block_lists[0])[0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == target:
            raise MemoryError(f"CUDA out of memory (simulated by {FAULT_ENV} on rank {rank})")

    first_block.register_forward_pre_hook(hook)
    model.fault_injected = True


def _shard_key(shard_mesh) -> tuple[int, ...]:
    """The ranks a model's blocks are sharded over, for its cache key (() when whole)."""
    return () if shard_mesh is None else tuple(shard_mesh.mesh.tolist())


def _current(model, shard_mesh) -> bool:
    """Whether a cached ``model`` (None: none) can serve: a sharded one only over the very mesh it was
    sharded over (after a failed request the meshes' groups are destroyed and built again)."""
    return model is not None and (shard_mesh is None or shard.mesh_of(model) is shard_mesh)


def _process_groups() -> int:
    """Process groups this rank has created so far (a warm layout must create none per request)."""
    return len(dist.distributed_c10d._world.pg_map)
