"""What every rank holds and does for a request: loaded models, meshes per layout, one generation."""

from __future__ import annotations

import gc
import os
import resource
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from .. import device as device_memory
from ..device import compute_dtype
from ..distributed.control import gather_json
from ..distributed.mesh import MeshCache
from ..distributed.runtime import Runtime
from ..launch.worker_env import FAULT_ENV
from ..memory import fit as memory_fit
from ..models import lora, model_patch, registry
from ..models.resolved import ResolvedModel, resolve_model
from ..parallel import attention, shard, traffic
from ..parallel.compile import use_compiled
from ..parallel.denoiser import Denoiser
from ..parallel.evaluation import Evaluation
from ..parallel.pipefusion import PipeFusion, always_computed, keep_stage, stage_bounds
from ..parallel.pipefusion_call import PipelinedCall, RunStage
from ..parallel.step_cache import StepCache
from ..sampling.generate import generate
from ..sampling.stop import GenerationStopped
from .evaluate_request import EvaluateRequest, control_latent
from .input_store import InputStore
from .model_cache import Entry, ModelCache, ModelKey, resident_bytes
from .request import CONTROL, SampleRequest
from .step_clock import StepClock


class Executor:
    """What every rank holds and does: loaded models, meshes per layout, and one generation."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.cache = ModelCache()  # one resident base per file version, precision, sharding and stage
        self.lora_files = lora.LoraFiles(rt.device)  # the LoRA tensors the loaded models carry
        self.patch_networks: dict[tuple, torch.nn.Module] = {}  # the last request's model patches, by file and dtype
        self.inputs = InputStore()  # the xDiT MODEL's conditioning by content hash (evaluate requests)
        self.evaluations: dict[str, int] = {}  # evaluate requests run, by model name (status shows them)
        self.estimates: dict[tuple, object] = {}  # the memory model's estimates by (key, layout, tokens, rows)
        # The layouts' data collectives wait half as long as the control group: after a rank raises,
        # the ranks stuck waiting for it time out and reach the step gate while it still waits there.
        self.meshes = MeshCache(rt.device.type, rt.timeout / 2, rt.data_backend)
        self.last_trace: list = []  # PipeFusion's receive trace of the last request (for the profile)
        self.last_cache = None  # the last generation's step cache (parallel/step_cache.py), None without one
        self.run_caches: tuple | None = None  # (the sampling run, its step cache): the xDiT MODEL's, across calls
        self.run_stages: tuple | None = None  # (the sampling run, its PipeFusion K/V buffers): likewise

        self.computing = None  # the model (or stage) the last request ran on
        # Rank 0's "stop now" for the running request (its job cancelled, or the backend stopping), asked before
        # every block where a stop there is told to every peer at once (``stops_between_blocks``); None: between steps
        self.stop_requested = None
        # Rank 0's ``progress(done, total)`` for a model it loads (load_progress.py: the person waiting is told); None
        # on the other ranks, and between requests
        self.load_progress = None

    @property
    def cache_counts(self) -> dict | None:
        """Model evaluations computed and reused by the last generation's step cache."""
        return None if self.last_cache is None else self.last_cache.counts

    def key(self, model: ResolvedModel, dtype: str = "auto", weight_dtype: str = "default", shard_mesh=None,
            stage: tuple[int, int] | None = None) -> ModelKey:
        torch_dtype = compute_dtype(dtype, self.rt.device)
        shard_ranks = () if shard_mesh is None else tuple(shard_mesh.mesh.tolist())
        return ModelKey(model.cache_name, model.version, str(torch_dtype).removeprefix("torch."), weight_dtype,
                        shard_ranks, stage)

    def model(self, model: ResolvedModel, dtype: str = "auto", loras=(), compiled: bool = False,
              weight_dtype: str = "default", shard_mesh=None, stage: tuple[int, int] | None = None) -> Entry:
        """The resident base for ``model`` (loaded once per file version, precision, shard ranks and
        PipeFusion stage), made to carry exactly ``loras`` and to run compiled or not: neither makes
        another copy of its weights. A changed file (new mtime) replaces the old version; a sharded
        model is loaded again when its mesh was rebuilt (after a failed request: agreement.py)."""
        key = self.key(model, dtype, weight_dtype, shard_mesh, stage)
        entry = self.cache.get(key)
        if entry is not None and shard_mesh is not None and shard.mesh_of(entry.model) is not shard_mesh:
            self.cache.drop([key])
            entry = None
        if entry is None:
            self.cache.drop(k for k in self.cache.least_recent_first() if k.name == key.name and k.version != key.version)
            entry = self.load(model, key, shard_mesh)
            self.cache.put(key, entry)
        entry.model.lora_reports = entry.model.patches.carry(list(loras), self.lora_files)
        self.lora_files.keep_only({carried for e in self.cache.entries.values() for carried in e.model.patches.carried})
        use_compiled(entry.model, compiled)
        return entry

    def load(self, model: ResolvedModel, key: ModelKey, shard_mesh) -> Entry:
        """Build the model of ``key`` on this rank's device: the whole of it, or only a PipeFusion
        stage's tensors (the other stages' blocks stay on meta and are dropped); with ``shard_mesh``,
        each block read in this rank's rows only and sharded as it is loaded (shard.RowSharding)."""
        sharding = None if shard_mesh is None else shard.row_sharding(shard_mesh, self.rt.device, model.source.gguf)
        device = torch.device("cpu") if shard_mesh is not None and sharding is None else self.rt.device
        built = model.build(device, getattr(torch, key.compute_dtype), blocks=key.stage, weight_dtype=key.weight_dtype,
                            sharding=sharding, progress=self.load_progress)
        blocks = None if key.stage is None else keep_stage(built.transformer, built.spec.stage_plan, *key.stage)
        if shard_mesh is not None:
            shard.shard_blocks(built, shard_mesh, self.rt.device)
        for block in shard.blocks_of(built):  # once per model, so a compiled block's hooks never change
            block.register_forward_pre_hook(self._stop_between_blocks)
        return Entry(built, resident_bytes(built), blocks)

    @property
    def stops_between_blocks(self) -> bool:
        """Whether rank 0 may stop a request before any block, mid-step: where every peer still waiting on it
        learns of it at once (one rank; gloo, whose groups close when agreement.agree_on_failure drops them). On
        NCCL a peer would wait out half of --collective-timeout instead, so there a request stops at a step's end."""
        return self.rt.world_size == 1 or self.rt.data_backend == "gloo"

    def _stop_between_blocks(self, block, args) -> None:
        if self.stop_requested is not None and self.stop_requested():
            raise GenerationStopped("stopped between two blocks")

    def loaded(self) -> list[str]:
        """One line per loaded model, least recently used first, with the LoRAs it carries and whether
        its last request ran compiled."""
        return [key.describe(*([f"{len(entry.model.lora_reports)} LoRA"] if entry.model.lora_reports else []),
                             *(["compiled"] if _compiled(entry.model) else []))
                for key, entry in self.cache.entries.items()]

    def describe_models(self) -> list[dict]:
        """Per loaded model: what it is, what it carries, and the bytes it holds on this rank."""
        return [{"name": key.name, "storage_dtype": entry.model.storage_dtype, "compute_dtype": key.compute_dtype,
                 "weight_dtype": key.weight_dtype, "sharded": bool(key.shard_ranks),
                 "blocks": list(key.stage) if key.stage else None,
                 "loras": [{"path": report["file"], "strength": report["strength"]}
                           for report in entry.model.lora_reports],
                 "compiled": _compiled(entry.model),
                 "bytes": entry.bytes}
                for key, entry in self.cache.entries.items()]

    def held_bytes(self) -> int:
        """Bytes of every loaded model's weights and buffers and of the LoRA tensors they carry. (The xDiT MODEL's
        conditioning, input_store.py, is in host memory, which the fit check reads as it is.)"""
        patches = sum(shard.resident_bytes(network) for network in self.patch_networks.values())
        return sum(entry.bytes for entry in self.cache.entries.values()) + self.lora_files.nbytes() + patches

    def memory_record(self) -> dict:
        """What ``status`` shows of this rank: its device's memory and its loaded models."""
        return {"rank": self.rt.rank, "memory": device_memory.snapshot(self.rt.device, self.held_bytes()),
                "models": self.describe_models()}

    def unload(self, model: str | None) -> list[str]:
        """Drop a model (every version, dtype and stage of it), or all of them; returns what was loaded."""
        names = self.cache.names()
        if model:
            names &= {model, str(Path(model).expanduser().resolve())}
        self.cache.drop(k for k in self.cache.least_recent_first() if k.name in names)
        self.patch_networks = {}  # the model patches go with the models (the next request that uses one loads it)
        self.lora_files.keep_only({carried for e in self.cache.entries.values() for carried in e.model.patches.carried})
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

    def spare_shared_gpu(self) -> None:
        """After a request, on the GPU a backend's local rank 0 shares with ComfyUI (its text encoders
        and VAE live on GPU 0): hand the allocator's cached blocks back, so that VAE Decode has them."""
        if self.rt.device.type == "cuda" and self.rt.local_rank == 0:
            torch.cuda.empty_cache()

    def _patch_key(self, spec: model_patch.PatchSpec, key: ModelKey) -> tuple:
        """A model patch network's identity: its file's version (or built-in name), the model's compute dtype and
        the ranks its blocks are sharded over (the model's)."""
        version = None if spec.built_in else (os.stat(spec.path).st_mtime_ns, os.stat(spec.path).st_size)
        return spec.path, version, key.compute_dtype, key.shard_ranks, key.stage

    def _unloaded_patch_bytes(self, request: SampleRequest, key: ModelKey) -> int:
        """The bytes of the request's model patches not loaded yet, for the fit check."""
        dtype, shares = getattr(torch, key.compute_dtype), len(key.shard_ranks) or 1
        return sum(-(-model_patch.nbytes(spec, dtype) // shares) for spec in request.controls
                   if self._patch_key(spec, key) not in self.patch_networks)

    def _model_patches(self, request: SampleRequest | EvaluateRequest, key: ModelKey, latents: list, size: tuple,
                       sampling, shard_mesh=None, stage=None) -> list:
        """The request's controls on this rank, in order: each network loaded once and kept while requests use it
        (only the last request's are kept; their bytes count as held), its control blocks sharded as the model's
        blocks are (``shard_mesh``), a PipeFusion stage's only those of its blocks (``stage``: [start, end)), its
        hint from its control latent (``latents``, None: a built-in's drawn) at the latent's ``size``, its σ range
        from ``sampling``."""
        kept = {}
        for index, entry in enumerate(request.controls):
            identity = self._patch_key(entry, key)
            network = self.patch_networks.get(identity)
            if network is None:
                network = model_patch.network(entry, self.rt.device, getattr(torch, key.compute_dtype))
                if stage is not None:
                    network.keep_blocks(*stage)
                if shard_mesh is not None:
                    shard.shard_network(network, model_patch.blocks_of(network), shard_mesh, self.rt.device)
            kept[identity] = network
        self.patch_networks = kept
        seed = getattr(request, "seed", 0)  # an evaluate request sends every latent: no built-in draws
        return [model_patch.applied(entry, kept[self._patch_key(entry, key)], latent, seed + index, size,
                                    self.computing, sampling)
                for index, (entry, latent) in enumerate(zip(request.controls, latents))]

    def _sample_patches(self, request: SampleRequest, key: ModelKey, spec, shard_mesh=None, stage=None) -> list:
        latents = [request.control_latent(index) for index in range(len(request.controls))]
        return self._model_patches(request, key, latents, request.latent_shape(spec)[-2:],
                                   spec.model_sampling(request.shift), shard_mesh, stage)

    def make_room(self, model: ResolvedModel, key: ModelKey, parallel, tokens: int, rows: int,
                  modulation_per_token: bool = False, extra_bytes: int = 0) -> None:
        """Before anything is allocated, on every request: every rank checks that the request's activations
        (its size, batch, frames and reference latents) and, when the model is not loaded yet, its weights
        fit its device, counting what evicting other least-recently-used models would free; the ranks agree
        (one small gather on the control group), then evict, or all raise the refusal of the first rank that
        cannot fit (nothing loaded, evicted or run). ``tokens`` per rank and ``rows`` per forward under
        ``parallel``: memory_fit.request_shape for a generation; ``modulation_per_token``: a timestep per token;
        ``extra_bytes``: more the request loads beside the model (its model patches)."""
        shard_ranks = (len(key.shard_ranks) or 1) if shard.shards_its_matrices(model.source.gguf) else 1
        shape = (key, parallel, tokens, rows, modulation_per_token)
        estimate = self.estimates.get(shape)
        if estimate is None:  # the memory model walks every parameter (~6 ms for Flux.1-dev): once per shape
            if len(self.estimates) > 256:
                self.estimates.clear()
            estimate = self.estimates[shape] = memory_fit.needed(model, getattr(torch, key.compute_dtype),
                                                                 key.weight_dtype, shard_ranks, parallel, tokens, rows,
                                                                 modulation_per_token)
        holds = key in self.cache.entries  # its resident weights are held already
        need = estimate.total - (estimate.weights_resident if holds else 0) + extra_bytes
        free = memory_fit.available(self.rt.device, self.held_bytes(), self.rt.local_world_size)
        others = [(k, e.bytes) for k, e in self.cache.entries.items() if k != key]
        plan = memory_fit.eviction_plan(need, free, others)
        verdict = None
        if plan is None:
            verdict = {"rank": self.rt.rank, "model": model.name, "device": str(self.rt.device), "loaded": holds,
                       "needed": need, "weights": estimate.weights, "activations": estimate.activations,
                       "workspace": estimate.workspace, "free": free, "evictable": sum(b for _, b in others)}
        if verdict is None and not holds and shard_ranks > 1 and shard.builds_whole_first(model.source.gguf):
            whole = memory_fit.needed(model, getattr(torch, key.compute_dtype), key.weight_dtype, 1, None, 0, 1)
            on_cpu = self.rt.device.type == "cpu"  # there the host is the device: what this rank holds counts
            host_free = memory_fit.available(torch.device("cpu"), self.held_bytes() if on_cpu else 0,
                                             self.rt.local_world_size)
            verdict = memory_fit.host_verdict(whole.weights_resident, host_free, self.rt.rank, model.name)
        verdicts = gather_json(verdict, self.rt.control) if self.rt.world_size > 1 else [verdict]
        refused = next((v for v in verdicts if v), None)
        if refused:
            raise memory_fit.refusal(refused)
        if plan:
            self.cache.drop(plan)
            if all(e.model is not self.computing for e in self.cache.entries.values()):
                self.computing = None  # evicted: the last request's model must not keep its memory
            self.release_memory()

    def generate(self, request: SampleRequest, after_step) -> torch.Tensor:
        """Run a validated request (its layout and conditioning resolved by rank 0) on this rank. An
        out-of-memory is reported with this rank's bytes and the fixes (the failed request's memory is
        released by agreement.agree_on_failure)."""
        with self.out_of_memory_reported():
            return self._generate(request, after_step)

    @contextmanager
    def out_of_memory_reported(self):
        """A request's work on this rank: an out-of-memory inside it raised as this rank's readable refusal (its
        bytes and the fixes); afterwards the cached blocks of ComfyUI's GPU handed back (``spare_shared_gpu``)."""
        try:
            yield
        except Exception as exc:
            if not memory_fit.is_out_of_memory(exc):
                raise
            clear_frames(exc)  # its frames hold the request's tensors: release_memory frees them
            raise memory_fit.out_of_memory(exc, self.rt.rank, self.rt.device, self.held_bytes()) from exc
        finally:
            self.spare_shared_gpu()

    def _generate(self, request: SampleRequest, after_step) -> torch.Tensor:
        layout = self.meshes.get(request.parallel, request.cache != "none") if self.rt.world_size > 1 else None
        model = resolve_model(request.model)  # once: everything below takes the resolved model
        spec = model.spec
        gen = replace(request.generation(spec, *request.conditioning(spec)), cpu_noise=self.rt.mixed_gpus)
        shard_mesh = layout.shard_mesh if layout else None  # the ranks that run the same blocks, with shard_weights
        stage = pipeline_stage(model, layout)
        key = self.key(model, request.dtype, request.weight_dtype, shard_mesh, stage)
        text_tokens = spec.split_text_tokens(gen.positive)
        self.make_room(model, key, request.parallel, *memory_fit.request_shape(request, spec, text_tokens),
                       request.modulates_per_token(spec), self._unloaded_patch_bytes(request, key))
        entry = self.model(model, request.dtype, request.loras, request.compile, request.weight_dtype,
                           shard_mesh, stage)
        self.computing = entry.model
        if stage is None:
            denoiser = Denoiser(self.computing, layout)
            first_block = getattr(self.computing.transformer, spec.stage_plan.block_lists[0])[0]
            if request.controls:
                self.computing.model_patches = self._sample_patches(request, key, spec, shard_mesh)
            try:
                with _armed_fault(first_block, self.rt.rank):
                    return generate(denoiser, gen, after_step)
            finally:
                self.last_cache = denoiser.cache
                if request.controls:
                    self.computing.model_patches = []
        denoiser = Denoiser(self.computing, layout)  # the batch rows of this dp group, and their gather
        decides = gen.cache is not None and stage[0] <= model.cache_head < stage[1]
        pipeline = PipeFusion(self.computing, layout, self.rt.device, entry.blocks, decides)
        self.last_trace = pipeline.trace
        if request.controls:
            self.computing.model_patches = self._sample_patches(request, key, spec, shard_mesh, stage)
        try:
            with _armed_fault(entry.blocks[0], self.rt.rank):
                latent = pipeline.run(gen, denoiser.rows(request.batch), after_step)
        finally:
            self.last_cache = None if pipeline.cache is None else pipeline.cache.cache
            if request.controls:
                self.computing.model_patches = []
        return denoiser.gather_rows(latent).cpu()

    def evaluate(self, request: EvaluateRequest, after_step=None) -> torch.Tensor:
        """One model call of ComfyUI's sampler (the xDiT MODEL) on this rank's share of the layout; returns the
        output of every row, on the CPU. The inputs are taken first, before anything that could fail on one
        rank only, so every rank's store changes alike (input_store.py)."""
        inputs = self.inputs.take(request.inputs, request.inline)
        with self.out_of_memory_reported():
            return self._evaluate(request, inputs)

    def _evaluate(self, request: EvaluateRequest, inputs: dict) -> torch.Tensor:
        layout = self.meshes.get(request.parallel, request.cache != "none") if self.rt.world_size > 1 else None
        model = resolve_model(request.model)
        shard_mesh = layout.shard_mesh if layout else None
        stage = pipeline_stage(model, layout)
        key = self.key(model, request.dtype, request.weight_dtype, shard_mesh, stage)
        config = request.parallel
        text = model.spec.split_text_tokens(inputs)
        sequence, groups = (config.sequence, config.cfg * config.dp) if config else (1, 1)
        self.make_room(model, key, config, -(-(request.tokens(model.spec, inputs) + text) // sequence),
                       -(-request.rows // groups), extra_bytes=self._unloaded_patch_bytes(request, key))
        entry = self.model(model, request.dtype, request.loras, request.compile, request.weight_dtype, shard_mesh,
                           stage)
        self.computing = entry.model
        self.evaluations[key.name] = self.evaluations.get(key.name, 0) + 1
        guidance = request.tensors.get("guidance")
        cache = self.run_cache(request, key)
        if stage is not None:
            decides = cache is not None and stage[0] <= model.cache_head < stage[1]
            call = PipelinedCall(self.computing, layout, self.rt.device, entry.blocks, self.run_stage(request, key),
                                 decides)
            self.last_trace = call.trace
            output = call.run(request.x, request.tensors["timestep"], inputs, guidance, request.step, cache,
                              (request.cond_start, request.cond_rows))
            if request.step + 1 >= request.steps:  # the run's last call: its K/V are not needed again
                self.run_stages = None
            return output
        latents = [control_latent(inputs, index) for index in range(len(request.controls))]
        cond = {name: tensor for name, tensor in inputs.items() if not CONTROL.fullmatch(name)}
        if request.controls:  # ComfyUI's Apply ControlNet, active at this call's noise level (the xDiT MODEL's)
            self.computing.model_patches = self._model_patches(request, key, latents, tuple(request.x.shape[-2:]),
                                                               model.spec.model_sampling(None), shard_mesh)
        try:
            return Evaluation(self.computing, layout).run(request.x, request.tensors["timestep"], cond, guidance,
                                                          cache, request.step, request.slot,
                                                          (request.cond_start, request.cond_rows))
        finally:
            self.computing.model_patches = []

    def run_stage(self, request: EvaluateRequest, key: ModelKey) -> RunStage:
        """What this PipeFusion stage keeps across the calls of the sampling run ``request`` belongs to (the xDiT
        MODEL): its K/V and step-cache residuals, new when the run, the model, the layout or the cache's settings
        change. The same on every rank: they all see every call."""
        identity = (request.generation, key, request.parallel, request.cache_options())
        if self.run_stages is None or self.run_stages[0] != identity:
            self.run_stages = (identity, RunStage())
        return self.run_stages[1]

    def forget_runs(self) -> None:
        """After a failed request: the xDiT MODEL's runs start again (a failed call may have left their step cache
        and K/V half-written on some ranks only)."""
        self.run_caches = self.run_stages = self.last_cache = None

    def run_cache(self, request: EvaluateRequest, key: ModelKey) -> StepCache | None:
        """The step cache of the sampling run ``request`` belongs to, kept across its calls (the xDiT MODEL): a new
        one when the run, the model, the layout or the cache's settings change. The same on every rank: they all see every call."""
        if request.cache == "none":
            self.last_cache = self.run_caches = None
            return None
        options = request.cache_options()
        identity = (request.generation, key, request.parallel, options, request.steps)
        if self.run_caches is None or self.run_caches[0] != identity:
            config = request.parallel
            computes = (always_computed(config.warmup_steps, config.patches, request.steps)
                        if config is not None and config.pipefusion > 1 else frozenset())
            self.run_caches = (identity, StepCache(options, request.steps, self.computing.spec.cache_plan.teacache,
                                                   computes=computes))
        self.last_cache = self.run_caches[1]
        return self.last_cache

    def profiled(self, request: SampleRequest | EvaluateRequest, after_step,
                 stop_requested=None) -> tuple[torch.Tensor, dict]:
        """``generate`` plus this rank's record: seconds per step, bytes sent (None for a compiled model),
        peak memory, the compute dtype and the attention that ran. ``stop_requested()`` (rank 0's) true stops the
        request before the next block where ``stops_between_blocks``, else at the step's end (through ``after_step``)."""
        self.stop_requested = stop_requested if self.stops_between_blocks else None
        try:
            return self._profiled(request, after_step)
        finally:
            self.stop_requested = None

    def _profiled(self, request: SampleRequest, after_step) -> tuple[torch.Tensor, dict]:
        run = self.evaluate if isinstance(request, EvaluateRequest) else self.generate
        if not request.profile:
            return run(request, after_step), {}
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
        with traffic.counting(request.compile, self.rt.control) as sent:  # None when compiled (traffic.py says why)
            latent = run(request, timed)  # ends on the CPU: a real synchronisation, as in production
        denoise_s = time.perf_counter() - started
        steps = clock.steps()
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.rt.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        dtype = compute_dtype(request.dtype, self.rt.device)
        head_dim = registry.attention_geometry(self.computing.transformer.config)[1]
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
                        "pipeline_trace": self.last_trace,
                        # the step cache's decisions on this rank: (step, statistic, reused) per evaluation
                        "cache_trace": (None if self.last_cache is None else
                                        [[d.step, d.ratio, d.reused] for d in self.last_cache.trace])}


def pipeline_stage(model: ResolvedModel, layout) -> tuple[int, int] | None:
    """The blocks [start, end) this rank's PipeFusion stage holds; None without PipeFusion."""
    if layout is None or layout.config.pipefusion == 1:
        return None
    config = layout.config
    return stage_bounds(model.block_sizes, config.pipefusion, config.pipefusion_blocks)[layout.index("pipefusion")]


def clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames ``exc``, and the exceptions it chains to, went through: a failed
    request's tensors, layout and pipeline, which would keep its memory and its process groups alive."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _compiled(model) -> bool:
    return model.compiled_blocks is not None and model.compiled_blocks["on"]


@contextmanager
def _armed_fault(first_block: torch.nn.Module, rank: int):
    """With XDIT_TEST_FAULT=PATH set (tests only) and "RANK:N" written to PATH, rank RANK's N-th model call
    of this request raises MemoryError, as an out-of-memory inside the model would. That rank removes the
    file, so the fault fires once and a running backend can be armed again for another request. A model
    call is a pass through the first block this rank holds: once per forward on the normal path, once per
    patch and step in a PipeFusion stage."""
    path = os.environ.get(FAULT_ENV)
    try:
        armed_rank, target = (int(part) for part in Path(path).read_text().split(":")) if path else (None, 0)
    except FileNotFoundError:
        armed_rank, target = None, 0
    if armed_rank != rank:
        yield
        return
    Path(path).unlink(missing_ok=True)
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] == target:
            raise MemoryError(f"CUDA out of memory (simulated by {FAULT_ENV} on rank {rank})")

    handle = first_block.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _process_groups() -> int:
    """Process groups this rank has created so far (a warm layout must create none per request)."""
    return len(dist.distributed_c10d._world.pg_map)
