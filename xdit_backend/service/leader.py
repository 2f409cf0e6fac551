"""Rank 0's loop: take jobs from the socket server, resolve and broadcast them, run them, reply.

A ``sample`` is resolved here (its layout fixed, its conditioning checked) so that every rank runs
exactly the same request: rank 0 broadcasts ``SampleRequest.to_fields()``, which the other ranks
parse (follower.py), and every rank runs it through agreement.run_request.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from .. import __version__
from ..device import compute_dtype
from ..distributed.config import ConfigError, MemoryFit, ModelFacts, ParallelConfig, RequestFacts
from ..distributed.control import StepGate, broadcast_message, gather_json
from ..distributed.runtime import Runtime
from ..errors import UserError
from ..launch.idle import STOP, UNLOAD, IdleClock
from ..launch.status_text import human_bytes
from ..memory import fit as memory_fit
from ..models import registry
from ..models import file_kind
from ..models.resolved import ResolvedModel, resolve_model
from ..parallel import attention, shard
from ..sampling.generate import side_differences
from ..sampling.samplers import ONE_CALL_PER_STEP
from ..wire import paths, protocol
from ..wire.protocol import Message
from .agreement import run_request
from .evaluate_request import EvaluateRequest
from .executor import Executor
from .input_store import MissingInputs
from .load_progress import LoadProgress, interval_s
from .request import RequestError, SampleRequest
from .server import Job, SocketServer

log = logging.getLogger("xdit_backend.service.leader")


def check_pipelined_call(request: EvaluateRequest, config: ParallelConfig) -> None:
    """A model call runs under PipeFusion only as one step of a sampling run (parallel/pipefusion_call.py): its
    patches attend to the K/V the run's previous call left, so the call must say which run and step it is and be
    the only call of its step."""
    stages = f"pipefusion={config.pipefusion}"
    instead = "use a layout without pipefusion (ulysses, ring, cfg, dp) for this workflow"
    if not request.generation:
        raise RequestError(f"{stages}: PipeFusion keeps the K/V of each step for the next, and this call does not say "
                           "which sampling run and step it belongs to",
                           "send generation, step and steps with each call (the xDiT Model does), or " + instead)
    if request.slot > 0:
        raise RequestError(f"{stages}: this is model call {request.slot + 1} of step {request.step}; PipeFusion's "
                           "patches attend to the K/V of the step before, so it takes one call per step, and this "
                           "workflow makes several (area or mask conditioning, sides that cannot batch, or a sampler "
                           "with two calls a step such as heun or dpmpp_2s_ancestral)",
                           f"{instead}, or a sampler and conditioning with one call a step")


class Leader:
    """Rank 0: takes jobs from the socket server, validates and broadcasts them, runs them, replies."""

    def __init__(self, rt: Runtime, ranks: list[dict], socket_path: Path, limits: protocol.Limits, heartbeat: float,
                 model_roots: tuple[str, ...] = (), tcp: tuple[str, int] | None = None, token: str | None = None,
                 idle: IdleClock | None = None):
        self.rt = rt
        # Asked here, on the rank's own thread and device, not on the server's thread at each status
        self.attention_kernel = attention.status_line(rt.device, compute_dtype("auto", rt.device))
        self.model_roots = model_roots  # where model and LoRA files may come from (empty: anywhere)
        self.server = SocketServer(socket_path, self.status, limits, tcp, token)
        self.ranks = ranks
        self.heartbeat = heartbeat
        self.gate = StepGate(rt.control)
        self.executor = Executor(rt)
        self.idle = idle or IdleClock(0.0, 0.0)  # never, unless the launch options say when
        self.memory: list[dict] = []  # every rank's last memory record, by rank (refresh_memory)
        self.memory_at = 0.0
        self.evaluations: dict[str, int] = {}  # the executor's counts, as the socket server's thread may read them

    def status(self) -> dict:
        return {
            "pid": int(os.environ.get(paths.LAUNCHER_PID_ENV, os.getppid())),
            "protocol": protocol.PROTOCOL_VERSION,
            "version": __version__,
            "world_size": self.rt.world_size,
            "ranks": [{**rank, "memory": record["memory"]} for rank, record in zip(self.ranks, self.memory)]
            if self.memory else self.ranks,
            "memory_age_s": round(time.time() - self.memory_at, 3),  # gathered after each request and heartbeat
            "attention_kernel": self.attention_kernel,
            "topology": self.rt.topology.to_json(),
            "models": loaded_models(self.memory),
            "evaluations": self.evaluations,  # the xDiT MODEL's calls run, by model
            "uptime_s": round(time.time() - self.rt.started, 3),
            "idle": self.idle.to_json(),
            "socket": str(self.server.path),
        }

    def refresh_memory(self) -> None:
        """Every rank's memory and loaded models, gathered on this thread (the socket server's thread
        only reads the result): the others answer a ``status`` command with their record."""
        broadcast_message(Message("status", {}), self.rt.control)  # follower.py
        records = gather_json(self.executor.memory_record(), self.rt.control)
        self.memory, self.memory_at = records, time.time()

    def serve(self) -> None:
        self.refresh_memory()
        while True:
            job = self.server.next_job(timeout=self.idle.wait(self.heartbeat))
            if job is None:
                if not self.on_idle():
                    return
                continue
            self.idle.request_started()
            try:
                if job.type == "shutdown":
                    self.shut_down(job.message, "the backend is shutting down", spare=job)
                    job.reply(Message("result", {"elapsed_s": 0.0, "info": {"stopped": True}}))
                    return
                if job.type == "unload":
                    unloaded = self.unload(job.message)
                    job.reply(Message("result", {"elapsed_s": 0.0, "info": {"unloaded": unloaded}}))
                elif job.type == "sample":
                    self.sample(job)
                elif job.type == "evaluate":
                    self.evaluate(job)
            finally:
                self.server.finish(job)
                self.idle.request_ended()

    def on_idle(self) -> bool:
        """No job came: unload or stop if the idle clock says so (through the same broadcasts as a
        requested unload or shutdown), else send the heartbeat. Returns False when the backend stops."""
        due = self.idle.due(models_loaded=bool(self.executor.loaded()))
        if due == STOP:
            why = f"the backend stopped after {self.idle.stop_after:g} s without a request (--idle-stop)"
            if not self.server.refuse_new_if_idle(why):
                return True  # a request came in at the deadline: it runs, and the idle time counts from its end
            log.info("idle for %.0f s (--idle-stop %g): stopping", self.idle.idle_s(), self.idle.stop_after)
            self.shut_down(Message("shutdown", {"id": "idle-stop"}), why)
            return False
        if due == UNLOAD:
            unloaded = self.unload(Message("unload", {"id": "idle-unload"}))
            log.info("idle for %.0f s (--idle-unload %g): unloaded %s", self.idle.idle_s(), self.idle.unload_after,
                     ", ".join(unloaded))
            return True
        self.refresh_memory()  # also the heartbeat: the others' wait stays bounded
        return True

    def unload(self, message: Message) -> list[str]:
        """Every rank drops the model ``message`` names, or all of them (follower.py does the same)."""
        broadcast_message(message, self.rt.control)
        unloaded = self.executor.unload(message.fields.get("model"))
        self.refresh_memory()  # before the reply: a status asked next sees it
        return unloaded

    def shut_down(self, message: Message, why: str, spare: Job | None = None) -> None:
        """Every rank leaves its loop; queued and running jobs but ``spare`` are answered with ``why``."""
        self.server.refuse_new(why)
        broadcast_message(message, self.rt.control)
        self.server.fail_all("shutdown", why, "the next request from the nodes (or `xdit-backend start`) starts it "
                             "again", spare=spare)

    def resolve(self, job: Job) -> tuple[SampleRequest, str]:
        """Check a request and fix its layout and conditioning, so every rank runs exactly the same."""
        # the request's files looked at once (validation needs no weights), within a bound: a hung mount must not
        # hold rank 0's loop
        named = f"model {job.message.fields.get('model')!r} or its LoRA files"
        request, model = file_kind.answered_within(file_kind.FIRST_LOOK_S, lambda: self.first_look(job), named)
        spec = model.spec
        request.check_model(spec)
        positive, negative = request.sides(spec)
        # the layout is chosen on the sides as the model takes them (Flux.2: text padded to 512); the ranks
        # get the sides as sent and prepare them once each (SampleRequest.generation)
        model_positive = spec.prepare_conditioning(positive)
        model_negative = None if negative is None else spec.prepare_conditioning(negative)
        tokens, rows = spec.token_grid(request.width, request.height, request.frames)
        text = spec.split_text_tokens(model_positive)
        value_bytes = compute_dtype(request.dtype, self.rt.device).itemsize
        facts = RequestFacts(request.batch, tokens, request.cfg, negative is not None, rows, text, value_bytes,
                             request.steps)
        model_facts = ModelFacts(request.model, spec.heads, spec.parallel_methods, spec.blocks, model.width,
                                 tuple(spec.method_refusals.items()))
        if request.parallel is None:
            config, why = ParallelConfig.auto(self.rt.world_size, model_facts, facts, self.rt.topology,
                                              lambda layout: self.memory_fit(request, model, layout, text))
            why = f"auto: {why}"
        else:
            config, why = request.parallel, "as requested"
            config.validate(self.rt.world_size, model_facts, facts, self.devices())
        if config.pipefusion > 1 and request.sampler not in ONE_CALL_PER_STEP:
            raise RequestError(f"sampler {request.sampler!r} cannot run with PipeFusion: it calls the model twice in "
                               "a step, the second time at a point the first call produces, so a patch would have to "
                               "pass through every stage twice per step with the other patches waiting",
                               f"use one of {', '.join(ONE_CALL_PER_STEP)} with PipeFusion, or a layout without "
                               "pipefusion")
        differ = (side_differences(model_positive, model_negative) if negative is not None and request.cfg != 1.0
                  else [])
        if config.pipefusion > 1 and config.cfg == 1 and differ:
            raise RequestError(f"PipeFusion runs the two sides of the guidance as one batch, and they differ: "
                               f"{', '.join(differ)}", "add cfg parallel (each side on its own ranks), give both "
                               "prompts the same length, or use a layout without pipefusion")
        tensors = {**request.tensors, **positive, **{f"negative_{k}": v for k, v in (negative or {}).items()}}
        fields = {**job.message.fields, "id": job.id, "parallel": config.to_json()}
        return SampleRequest.parse(Message("sample", fields, tensors)), f"{config.describe()} ({why})"

    def notes(self, request: SampleRequest, model: ResolvedModel) -> list[str]:
        """What the client is told before the first step, where that wait is long: the model to load (not yet held
        by the ranks), the blocks to compile."""
        notes = []
        if self.to_load(model):
            size = _file_size(model)
            notes.append(f"loading {_shown_name(model)} on {self.rt.world_size} ranks"
                         f"{f', {human_bytes(size)}' if size else ''} (the model's first run; it stays loaded)")
        if request.compile:
            notes.append("compiling the blocks (torch.compile): the first run at a new size takes longer")
        return notes

    def to_load(self, model: ResolvedModel) -> bool:
        return model.cache_name not in self.executor.cache.names()

    def run_telling_loads(self, job: Job, request: SampleRequest | EvaluateRequest, model: ResolvedModel, after_step):
        """agreement.run_request, with the client told how far the model has got where it loads (load_progress.py)."""
        if self.to_load(model):
            self.executor.load_progress = LoadProgress(job.note, _shown_name(model), _file_size(model), interval_s())
        try:
            return run_request(self.rt, self.gate, self.executor, request, after_step, lambda: job.cancelled)
        finally:
            self.executor.load_progress = None

    def memory_fit(self, request: SampleRequest, model: ResolvedModel, config: ParallelConfig,
                   text_tokens: int) -> MemoryFit | None:
        """What auto weighs to shard the weights: one rank's unsharded weights under ``config`` (the memory
        model's estimate) against the tightest rank's room less the request's activations (memory_fit.py)."""
        if not self.memory or config.shard_size == 1 or not shard.shards_its_matrices(model.source.gguf):
            return None  # nothing to weigh (sharding would not shrink it)
        tokens, rows = memory_fit.request_shape(replace(request, parallel=config), model.spec, text_tokens)
        estimate = memory_fit.needed(model, compute_dtype(request.dtype, self.rt.device), request.weight_dtype,
                                     1, config, tokens, rows, request.modulates_per_token(model.spec))
        room = memory_fit.tightest_room(self.memory) - estimate.activations - estimate.workspace
        return MemoryFit(estimate.weights, room)

    def first_look(self, job: Job) -> tuple[SampleRequest, ResolvedModel]:
        """The request read (its LoRA paths looked at) and its model resolved: every file it names, touched."""
        request = SampleRequest.parse(job.message)
        self.check_roots(request)
        return request, resolve_model(request.model)

    def check_roots(self, request: SampleRequest) -> None:
        """The model: a regular file or folder (a FIFO or a device would block the loop that serves the socket at
        its first read; a symlink loop is named; LoRA paths were checked so when the request was read); model and
        LoRA and model patch files only from the configured roots, symlinks and '..' resolved first."""
        a_path = request.model not in registry.BUILTINS
        odd = file_kind.not_a_file(request.model) if a_path else None
        if odd:
            raise RequestError(f"model {request.model} is {odd}, not a file or folder that can be read",
                               "give the path of a model file (.safetensors, .gguf) or a diffusers folder")
        files = ([("model", request.model)] if a_path else []) + [("LoRA", spec.path) for spec in request.loras]
        files += [("model patch", spec.path) for spec in request.controls if not spec.built_in]
        for what, path in files:
            if not paths.inside_roots(path, self.model_roots):
                raise RequestError(f"{what} {path} is outside the model roots this backend serves "
                                   f"({', '.join(map(str, self.model_roots))})",
                                   "put the file under one of them, or start the backend with another --model-root",
                                   node_hint="put the file in ComfyUI's models folders (a backend the nodes start "
                                             "serves those), or stop this backend (xDiT Backend node: stop backend) "
                                             "so the next run starts one that serves them")

    def devices(self) -> str:
        kinds = sorted({r["device_name"] for r in self.ranks})
        return f"{self.rt.world_size} ranks on {', '.join(kinds)}"

    def sample(self, job: Job) -> None:
        try:
            request, layout = self.resolve(job)
        except UserError as exc:
            _refuse(job, exc)
            return
        except Exception as exc:  # e.g. out of memory while building the model
            log.exception("request %s could not be prepared", job.id)
            job.fail("model_error", f"{type(exc).__name__}: {exc}", "see the backend log for the full traceback",
                     rank=self.rt.rank, traceback=traceback.format_exc()[-4000:])
            return
        model = resolve_model(request.model)  # its header read once per file version (registry.resolve)
        for text in self.notes(request, model):
            job.note(text)
        broadcast_message(Message("sample", request.to_fields(), request.tensors), self.rt.control)  # follower.py

        def after_step(done: int, total: int) -> bool:
            job.progress(done, total)
            return self.gate.passes(stop=job.cancelled)

        outcome = self.run_telling_loads(job, request, model, after_step)
        self.refresh_memory()  # before the reply: a status asked next sees the models and memory it left
        if self.failed(job, outcome, "the result", "latent, reference, conditioning"):
            return
        info = {"world_size": self.rt.world_size, "layout": layout, "loras": self.executor.computing.lora_reports,
                "order": {"arrival": job.arrival, "execution": job.execution}}
        if request.cache != "none":
            info["cache"] = self.executor.cache_counts  # the same on every rank: they decide together
        if outcome.profile is not None:
            info["profile"] = outcome.profile
        job.reply(Message("result", {"elapsed_s": time.monotonic() - job.started, "info": info},
                          request.result(model.spec, outcome.latent)))

    def resolve_evaluation(self, job: Job) -> tuple[EvaluateRequest, str]:
        """Check a model call and fix its layout, so every rank runs exactly the same; its inputs must be inline or
        held (MissingInputs names the others: the client sends them again)."""
        named = f"model {job.message.fields.get('model')!r} or its LoRA files"

        def first_look():
            request = EvaluateRequest.parse(job.message)
            self.check_roots(request)
            return request, resolve_model(request.model)

        request, model = file_kind.answered_within(file_kind.FIRST_LOOK_S, first_look, named)
        store = self.executor.inputs
        missing = store.missing(request.inputs, request.inline)
        if missing:
            raise MissingInputs(missing)
        store.check_inline(request.inline)
        spec = model.spec
        inputs = {key: request.inline.get(name, store.tensors.get(name)) for key, name in request.inputs.items()}
        request.check_model(spec, inputs)
        text = spec.split_text_tokens(inputs)
        facts = RequestFacts(request.rows, request.tokens(spec), 2.0 if request.rows > 1 else 1.0, request.rows > 1,
                             max(1, request.x.shape[-2] // spec.patch[1]), text,
                             compute_dtype(request.dtype, self.rt.device).itemsize)
        model_facts = ModelFacts(request.model, spec.heads, spec.parallel_methods, spec.blocks, model.width,
                                 tuple(spec.method_refusals.items()))
        if request.parallel is None:
            config, why = ParallelConfig.auto(self.rt.world_size, model_facts, facts, self.rt.topology)
            why = f"auto: {why}"
        else:
            config, why = request.parallel, "as requested"
            # rows are padded to the row groups and a single row runs on both CFG halves: neither is refused
            padded = replace(facts, batch=config.dp, cfg_scale=2.0, has_negative=True)
            config.validate(self.rt.world_size, model_facts, padded, self.devices())
        if config.pipefusion > 1:
            check_pipelined_call(request, config)
        fields = {**job.message.fields, "id": job.id, "parallel": config.to_json()}
        return EvaluateRequest.parse(Message("evaluate", fields, request.tensors)), f"{config.describe()} ({why})"

    def evaluate(self, job: Job) -> None:
        """One model call of ComfyUI's sampler (the xDiT MODEL), run by every rank in its layout."""
        try:
            request, layout = self.resolve_evaluation(job)
        except MissingInputs as exc:
            job.fail("missing_inputs", exc.message, exc.hint)
            return
        except UserError as exc:
            _refuse(job, exc)
            return
        broadcast_message(Message("evaluate", request.to_fields(), request.tensors), self.rt.control)  # follower.py
        loaded = self.executor.loaded()
        outcome = self.run_telling_loads(job, request, resolve_model(request.model), lambda done, total: True)
        self.evaluations = dict(self.executor.evaluations)  # a new dict: the server's thread reads the old one whole
        if outcome.failures is not None or self.executor.loaded() != loaded:
            self.refresh_memory()  # a model loaded or evicted (not at every call: a gather on every rank)
        if self.failed(job, outcome, "the model's output", "x, conditioning"):
            return
        info = {"world_size": self.rt.world_size, "layout": layout, "rows": request.rows,
                "loras": self.executor.computing.lora_reports, "evaluations": sum(self.executor.evaluations.values()),
                "inputs_held": len(self.executor.inputs.tensors), "inputs_evicted": self.executor.inputs.evicted}
        if request.cache != "none":
            info["cache"] = self.executor.cache_counts  # the run's so far; the same on every rank
            info["cache_reused"] = self.executor.last_cache.trace[-1].reused if request.slot == 0 else None
        if outcome.profile is not None:
            info["profile"] = outcome.profile
        job.reply(Message("result", {"elapsed_s": time.monotonic() - job.started, "info": info},
                          {"output": outcome.latent}))

    def failed(self, job: Job, outcome, what: str, inputs: str) -> bool:
        """Answer a request that did not end with a finite result (a rank failed, it was cancelled, or ``what`` holds
        NaN or infinite values), and say so; False: the result is to be sent."""
        if outcome.failures is not None:
            self.report_failure(job, outcome.failures)
            return True
        if outcome.stopped:
            job.fail("cancelled", f"request {job.id} was cancelled ({job.cancel_reason}); its partial result was dropped")
            return True
        broken = non_finite(outcome.latent)
        if broken:
            job.fail("model_error", f"{what} holds {broken}; nothing is returned",
                     f"a weight, a LoRA or an input ({inputs}) holds NaN or infinite values, or the computation "
                     "overflowed: check the files, or try another dtype (bfloat16, float32)")
            return True
        return False

    def report_failure(self, job: Job, failures: list) -> None:
        """Name the rank whose own work failed (not one that only timed out waiting for it), and its kind:
        ``out_of_memory`` (a refusal before loading or running, or an allocation that failed) or ``model_error``."""
        raised = [f for f in failures if f]
        cause = next((f for f in raised if not f["waiting"]), raised[0] if raised else None)
        if cause is None:
            job.fail("model_error", "the request failed on a rank that reported no error", "see the backend log")
            return
        kept = "the backend keeps serving; see its log for the full traceback"
        hint = f"{cause['hint']} ({kept})" if cause.get("hint") else f"the other ranks left their collectives and {kept}"
        job.fail(cause.get("kind", "model_error"), f"rank {cause['rank']}: {cause['error']}", hint,
                 rank=cause["rank"], traceback=cause["traceback"])


def loaded_models(records: list[dict]) -> list[dict]:
    """The models every rank holds, as ``status`` lists them: one dict per model (a PipeFusion
    layout's stages are one model), with the bytes it holds on each rank (0 where a rank holds none)."""
    merged: dict[tuple, dict] = {}
    for record in records:
        for model in record["models"]:
            stages = model["blocks"] is not None
            identity = (model["name"], model["storage_dtype"], model["compute_dtype"], model["weight_dtype"],
                        model["sharded"], stages)
            entry = merged.setdefault(identity, {**{k: v for k, v in model.items() if k not in ("bytes", "blocks")},
                                                 "pipefusion_stages": stages, "bytes_per_rank": [0] * len(records)})
            entry["bytes_per_rank"][record["rank"]] += model["bytes"]
    return list(merged.values())


def non_finite(latent) -> str | None:
    """How many of ``latent``'s values are NaN or infinite, said for a message; None when none is (one host
    read per request: its end)."""
    nan, infinite = (int(n) for n in torch.stack([latent.isnan().sum(), latent.isinf().sum()]).tolist())
    if not nan and not infinite:
        return None
    return f"{nan} NaN and {infinite} infinite values of {latent.numel()}"


def _shown_name(model: ResolvedModel) -> str:
    """A model as the person waiting knows it: its file or folder name, or a built-in's name."""
    return model.name if model.source.kind == "builtin" else Path(model.source.ref).name


def _file_size(model: ResolvedModel) -> int | None:
    """The bytes of a model that is one file (a folder's or a built-in's: None)."""
    return Path(model.source.ref).stat().st_size if model.source.kind == "file" else None


def _refuse(job: Job, exc: UserError) -> None:
    """A request refused before any rank runs it: a layout its rules refuse (``config``), or another mistake in it."""
    job.fail("config" if isinstance(exc, ConfigError) else "bad_request", exc.message, exc.hint,
             node_hint=exc.node_hint)
