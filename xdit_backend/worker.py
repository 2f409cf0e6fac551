"""Every rank of the backend: join the process group, then execute the requests rank 0 broadcasts.

Started by launcher.py through torch.distributed.run as ``python -m xdit_backend.worker``.
Rank 0 also owns the socket (server.py) and decides; the other ranks follow its broadcasts.
Every rank runs each ``sample`` under the layout rank 0 resolved (parallel/denoiser.py), and
every step ends at the step gate, so a cancel or a failure stops all ranks within one step.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from . import __version__, launcher, paths, protocol
from .attention import kernel_name
from .compile import compile_blocks
from .config import ConfigError, ModelFacts, ParallelConfig, RequestFacts
from .errors import UserError
from .control import (EXIT_PEER_LOST, PeerLost, StepGate, barrier, broadcast_message, gather_json,
                      is_peer_failure)
from .mesh import MeshCache
from .models import lora, registry
from .protocol import Message
from .request import RequestError, SampleRequest, compute_dtype
from .parallel import traffic
from .parallel.denoiser import Denoiser
from .parallel.pipefusion import PipeFusion, keep_stage, stage_bounds
from .sampling.generate import GenerationStopped, generate
from .sampling.samplers import ONE_CALL_PER_STEP
from .server import Job, SocketServer

log = logging.getLogger("xdit_backend.worker")

LAUNCHER_PID_ENV = "XDIT_LAUNCHER_PID"
FAULT_ENV = "XDIT_TEST_FAULT"  # tests only: "RANK:N" makes rank RANK's N-th model call raise MemoryError


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m xdit_backend.worker")
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--collective-timeout", type=float, default=600.0)
    parser.add_argument("--heartbeat", type=float, default=30.0)
    parser.add_argument("--max-payload-mb", type=int, default=1024)
    parser.add_argument("--model-root", action="append", default=[], type=Path)
    parser.add_argument("--tcp", default=None, help="loopback HOST:PORT to listen on as well (token required)")
    parser.add_argument("--token-file", type=Path, default=None)
    return parser.parse_args(argv)


def start_runtime(args: argparse.Namespace) -> Runtime:
    """Join the process group (gloo on CPU, NCCL on CUDA) and pin this rank to its device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise StartupError(
                f"--device cuda, but torch {torch.__version__} sees no CUDA device on {socket.gethostname()}; "
                "start the backend with --device cpu, or install a CUDA build of torch"
            )
        if local_rank >= torch.cuda.device_count():
            raise StartupError(
                f"local rank {local_rank} needs GPU {local_rank}, but only {torch.cuda.device_count()} are visible; "
                "start the backend with --nproc equal to the number of GPUs (or list them with --gpus)"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this node
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    timeout = timedelta(seconds=args.collective_timeout)
    dist.init_process_group(backend, timeout=timeout, device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, control, time.time(), timeout)


def describe_rank(rt: Runtime) -> dict:
    name = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "cpu"
    return {"rank": rt.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(rt.device),
            "device_name": name, "threads": torch.get_num_threads()}


class Executor:
    """What every rank holds and does: loaded models, meshes per layout, and one generation."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.models: dict[tuple, object] = {}  # (name or path, file version, dtype, LoRAs, compiled) → model
        self.stages: dict[tuple, tuple[object, list]] = {}  # + PipeFusion block range
        # The layouts' data collectives wait half as long as the control group: after a rank raises,
        # the ranks stuck waiting for it time out and reach the step gate while it still waits there.
        self.meshes = MeshCache(rt.device.type, rt.timeout / 2)
        self.last_trace: list = []  # PipeFusion's receive trace of the last request (for the profile)
        self.computing = None  # the model (or stage) the last request ran on

    def model(self, name: str, dtype: str = "auto", loras=(), compiled: bool = False):
        """The loaded model, cached by identity, dtype, LoRAs and compilation: a changed file (new mtime)
        is loaded again. A compiled model is a separate entry (its own weights), reused by later requests."""
        torch_dtype = compute_dtype(dtype, self.rt.device)
        path, version = registry.identity(name)
        key = (path, version, str(torch_dtype).removeprefix("torch."), lora.identity(list(loras)), compiled)
        if key not in self.models:
            self.models = {k: m for k, m in self.models.items() if k[0] != path or k[1] == version}  # stale file
            model = registry.build(name, self.rt.device, torch_dtype, loras)
            self.models[key] = compile_blocks(model) if compiled else model
        return self.models[key]

    def loaded(self) -> list[str]:
        def describe(key):
            loras = f", {len(key[3])} LoRA" if key[3] else ""
            compiled = ", compiled" if key[4] else ""
            return f"{key[0]} ({key[2]}{loras}{compiled})"

        return sorted({describe(key) for key in [*self.models, *self.stages]})

    def unload(self, model: str | None) -> list[str]:
        """Drop a model (every version, dtype and stage of it), or all of them; returns what was loaded."""
        names = {key[0] for key in [*self.models, *self.stages]}
        if model:
            wanted = {model, str(Path(model).expanduser().resolve())}
            names &= wanted
        self.models = {k: v for k, v in self.models.items() if k[0] not in names}
        self.stages = {k: v for k, v in self.stages.items() if k[0] not in names}
        return sorted(names)

    def stage_model(self, name: str, layout, dtype: str = "auto", loras=(),
                    compiled: bool = False) -> tuple[object, list]:
        """The model with only this rank's PipeFusion stage of blocks (cached per stage), and those blocks."""
        config = layout.config
        bounds = stage_bounds(registry.block_sizes(name), config.pipefusion, config.pipefusion_blocks)
        start, end = bounds[layout.index("pipefusion")]
        torch_dtype = compute_dtype(dtype, self.rt.device)
        key = (*registry.identity(name), str(torch_dtype).removeprefix("torch."), lora.identity(list(loras)), compiled,
               start, end)
        if key not in self.stages:
            # Built on the CPU (from a file: only this stage's tensors are read), pruned, then
            # moved: the other stages' weights are never read from disk nor copied to the device.
            model = registry.build(name, torch.device("cpu"), torch_dtype, loras, blocks=(start, end))
            blocks = keep_stage(model.transformer, model.spec.stage_plan, start, end)
            model.transformer.to(self.rt.device)
            self.stages[key] = (compile_blocks(model) if compiled else model, blocks)
        return self.stages[key]

    def generate(self, request: SampleRequest, after_step) -> torch.Tensor:
        """Run a validated request (its layout and conditioning resolved by rank 0) on this rank."""
        layout = self.meshes.get(request.parallel) if self.rt.world_size > 1 else None
        spec = registry.spec(request.model)
        gen = request.generation(spec, *request.conditioning(spec))
        if layout is None or layout.config.pipefusion == 1:
            self.computing = self.model(request.model, request.dtype, request.loras, request.compile)
            _inject_fault(self.computing, self.rt.rank)
            return generate(Denoiser(self.computing, layout), gen, after_step)
        stage, blocks = self.stage_model(request.model, layout, request.dtype, request.loras, request.compile)
        self.computing = stage
        denoiser = Denoiser(stage, layout)  # the batch rows of this dp group, and their gather
        pipeline = PipeFusion(stage, layout, self.rt.device, blocks)
        self.last_trace = pipeline.trace
        latent = pipeline.run(gen, denoiser.rows(request.batch), after_step)
        return denoiser.gather_rows(latent).cpu()

    def profiled(self, request: SampleRequest, after_step) -> tuple[torch.Tensor, dict]:
        """``generate`` plus this rank's record: seconds per step, bytes sent, peak memory."""
        if not request.profile:
            return self.generate(request, after_step), {}
        cuda = self.rt.device.type == "cuda"
        # Step ends: CUDA events on a GPU (recorded in the stream, read after the generation: no
        # synchronisation inside the loop that production does not have), wall time on the CPU.
        clock = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else time.perf_counter
        marks = [clock()]
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.rt.device)
            marks[0].record()

        def timed(done: int, total: int) -> bool:
            marks.append(clock())
            if cuda:
                marks[-1].record()
            return after_step(done, total)

        groups_before = _process_groups()
        started = time.perf_counter()
        with traffic.counting() as sent:
            latent = self.generate(request, timed)  # ends on the CPU: a real synchronisation, as in production
        denoise_s = time.perf_counter() - started
        if cuda:
            peak = torch.cuda.max_memory_allocated(self.rt.device)
            steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
            steps = [b - a for a, b in zip(marks, marks[1:])]
        return latent, {"rank": self.rt.rank, "step_s": steps, "denoise_s": denoise_s, "sent_bytes": dict(sent),
                        "peak_memory_bytes": peak,
                        "memory_kind": "cuda allocated" if cuda else "process peak RSS",
                        "process_groups_created": _process_groups() - groups_before,
                        "parameters": sum(p.numel() for p in self.computing.transformer.parameters()),
                        "pipeline_trace": self.last_trace}


def _inject_fault(model, rank: int) -> None:
    """With XDIT_TEST_FAULT=RANK:N set (tests only), rank RANK's N-th model call raises MemoryError,
    as an out-of-memory inside the model would."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or getattr(model, "fault_injected", False) or int(spec.split(":")[0]) != rank:
        return
    calls, target = [0], int(spec.split(":")[1])

    def hook(module, args):
        calls[0] += 1
        if calls[0] == target:
            raise MemoryError(f"CUDA out of memory (simulated by {FAULT_ENV} on rank {rank})")

    model.transformer.register_forward_pre_hook(hook)
    model.fault_injected = True


def _process_groups() -> int:
    """Process groups this rank has created so far (a warm layout must create none per request)."""
    return len(dist.distributed_c10d._world.pg_map)


class Leader:
    """Rank 0: takes jobs from the socket server, validates and broadcasts them, runs them, replies."""

    def __init__(self, rt: Runtime, ranks: list[dict], socket_path: Path, limits: protocol.Limits, heartbeat: float,
                 model_roots: tuple[Path, ...] = (), tcp: tuple[str, int] | None = None, token: str | None = None):
        self.rt = rt
        self.model_roots = model_roots  # where model and LoRA files may come from (empty: anywhere)
        self.server = SocketServer(socket_path, self.status, limits, tcp, token)
        self.ranks = ranks
        self.heartbeat = heartbeat
        self.gate = StepGate(rt.control)
        self.executor = Executor(rt)

    def status(self) -> dict:
        return {
            "pid": int(os.environ.get(LAUNCHER_PID_ENV, os.getppid())),
            "protocol": protocol.PROTOCOL_VERSION,
            "version": __version__,
            "world_size": self.rt.world_size,
            "ranks": self.ranks,
            "attention_kernel": kernel_name(self.rt.device),
            "models": self.executor.loaded(),
            "uptime_s": round(time.time() - self.rt.started, 3),
            "socket": str(self.server.path),
        }

    def serve(self) -> None:
        while True:
            job = self.server.next_job(timeout=self.heartbeat)
            if job is None:
                broadcast_message(None, self.rt.control)  # heartbeat: the others' wait stays bounded
                continue
            try:
                if job.type == "shutdown":
                    broadcast_message(job.message, self.rt.control)
                    self.server.fail_all("shutdown", "the backend is shutting down", spare=job)
                    job.reply(Message("result", {"elapsed_s": 0.0, "info": {"stopped": True}}))
                    return
                if job.type == "unload":
                    broadcast_message(job.message, self.rt.control)
                    unloaded = self.executor.unload(job.message.fields.get("model"))
                    job.reply(Message("result", {"elapsed_s": 0.0, "info": {"unloaded": unloaded}}))
                elif job.type == "sample":
                    self.sample(job)
            finally:
                self.server.finish(job)

    def resolve(self, job: Job) -> tuple[SampleRequest, str]:
        """Check a request and fix its layout and conditioning, so every rank runs exactly the same."""
        request = SampleRequest.parse(job.message)
        self.check_roots(request)
        spec = registry.spec(request.model)  # validation needs no weights
        request.check_model(spec)
        positive, negative = request.conditioning(spec)
        if positive is None and request.model not in registry.BUILTINS:
            keys = ", ".join(spec.conditioning_shapes(1, 1))
            raise RequestError(f"model {request.model} needs text conditioning: send {keys} "
                               "(and the same with a negative_ prefix for cfg > 1)",
                               "encode the prompt with the model's text encoders (xdit-backend sample --embeds FILE)")
        if positive is None:  # a built-in test model without embeddings: stand-ins from the seed
            positive, negative = registry.random_conditioning(request.model, request.batch, request.seed, spec)
        tokens, rows = spec.token_grid(request.width, request.height, request.frames)
        facts = RequestFacts(request.batch, tokens, request.cfg, negative is not None, rows)
        model_facts = ModelFacts(request.model, spec.heads, spec.parallel_methods, spec.blocks)
        if request.parallel is None:
            config, why = ParallelConfig.auto(self.rt.world_size, model_facts, facts)
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
        tensors = {**request.tensors, **positive, **{f"negative_{k}": v for k, v in (negative or {}).items()}}
        fields = {**job.message.fields, "id": job.id, "parallel": config.to_json()}
        return SampleRequest.parse(Message("sample", fields, tensors)), f"{config.describe()} ({why})"

    def check_roots(self, request: SampleRequest) -> None:
        """Model and LoRA files only from the configured roots, symlinks and '..' resolved first."""
        files = ([("model", request.model)] if request.model not in registry.BUILTINS else []) + \
            [("LoRA", spec.path) for spec in request.loras]
        for what, path in files:
            if not paths.inside_roots(path, self.model_roots):
                raise RequestError(f"{what} {path} is outside the model roots this backend serves "
                                   f"({', '.join(map(str, self.model_roots))})",
                                   "put the file under one of them, or start the backend with another --model-root")

    def devices(self) -> str:
        kinds = sorted({r["device_name"] for r in self.ranks})
        return f"{self.rt.world_size} ranks on {', '.join(kinds)}"

    def sample(self, job: Job) -> None:
        try:
            request, layout = self.resolve(job)
        except UserError as exc:
            kind = "config" if isinstance(exc, ConfigError) else "bad_request"
            job.fail(kind, exc.message, exc.hint)
            return
        except Exception as exc:  # e.g. out of memory while building the model
            log.exception("request %s could not be prepared", job.id)
            job.fail("model_error", f"{type(exc).__name__}: {exc}", "see the backend log for the full traceback",
                     rank=self.rt.rank, traceback=traceback.format_exc()[-4000:])
            return
        broadcast_message(Message("sample", request_fields(request), request.tensors), self.rt.control)
        self.gate.begin()

        def after_step(done: int, total: int) -> bool:
            job.progress(done, total)
            return self.gate.passes(stop=job.cancelled)

        try:
            latent, record = self.executor.profiled(request, after_step)
        except GenerationStopped:
            if self.gate.failed:  # another rank raised: agree on what happened, keep serving
                self.report_failure(job, agree_on_failure(self.rt, self.gate, self.executor, None))
                return
            job.fail("cancelled", f"request {job.id} was cancelled ({job.cancel_reason}); its partial result was dropped")
            return
        except PeerLost:
            raise
        except Exception as exc:
            log.exception("request %s failed on rank 0", job.id)
            self.report_failure(job, agree_on_failure(self.rt, self.gate, self.executor, exc))
            return
        self.gate.close()
        info = {"world_size": self.rt.world_size, "layout": layout, "loras": self.executor.computing.lora_reports,
                "order": {"arrival": job.arrival, "execution": job.execution}}
        if request.profile:
            info["profile"] = gather_json(record, self.rt.control)
        job.reply(Message("result", {"elapsed_s": time.monotonic() - job.started, "info": info}, {"samples": latent}))


    def report_failure(self, job: Job, failures: list) -> None:
        """Name the rank whose own work failed (not one that only timed out waiting for it)."""
        raised = [f for f in failures if f]
        cause = next((f for f in raised if not f["waiting"]), raised[0] if raised else None)
        if cause is None:
            job.fail("model_error", "the request failed on a rank that reported no error", "see the backend log")
            return
        job.fail("model_error", f"rank {cause['rank']}: {cause['error']}",
                 "the other ranks left their collectives and the backend keeps serving; see the backend log "
                 "for the full traceback", rank=cause["rank"], traceback=cause["traceback"])


def agree_on_failure(rt: Runtime, gate: StepGate, executor: Executor, exc: BaseException | None) -> list:
    """Every rank, after a failed step: meet at the gate (a rank that raised says so), gather what
    each rank saw, and drop the layouts' process groups (a timed-out group is not reused).

    A rank stuck in a data collective with the rank that raised waits out ``--collective-timeout``
    (the mesh's groups carry it), then arrives here too. If a rank is gone, the gate's collective
    fails and PeerLost ends the backend as before.
    """
    mine = None
    if exc is not None:
        mine = {"rank": rt.rank, "error": f"{type(exc).__name__}: {exc}"[:2000], "waiting": is_peer_failure(exc),
                "traceback": traceback.format_exc()[-4000:]}
    gate.fail()
    failures = gather_json(mine, rt.control)
    executor.meshes.clear()
    return failures


def request_fields(request: SampleRequest) -> dict:
    """The JSON fields of a resolved request, as broadcast to the other ranks."""
    names = ("model", "width", "height", "batch", "steps", "seed", "cfg", "frames", "start_step", "add_noise",
             "sampler", "scheduler", "denoise", "compile")
    fields = {name: getattr(request, name) for name in names}
    fields.update({name: getattr(request, name) for name in ("guidance", "shift", "end_step")
                   if getattr(request, name) is not None})
    return {**fields, "parallel": request.parallel.to_json(), "profile": request.profile, "dtype": request.dtype,
            "return_with_leftover_noise": request.leftover_noise,
            "loras": [{"path": spec.path, "strength": spec.strength} for spec in request.loras]}


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
        if command.type == "unload":
            executor.unload(command.fields.get("model"))
        elif command.type == "sample":
            request = SampleRequest.parse(command)
            gate.begin()
            try:
                _, record = executor.profiled(request, lambda done, total: gate.passes())
            except GenerationStopped:
                if gate.failed:  # a rank raised: agree, then wait for the next command
                    agree_on_failure(rt, gate, executor, None)
                continue  # every rank stopped at the same gate
            except PeerLost:
                raise
            except Exception as exc:  # this rank raised (or timed out waiting for one that did)
                log.exception("rank %d failed during the request", rt.rank)
                agree_on_failure(rt, gate, executor, exc)
                continue
            while gate.open and gate.passes():  # rank 0's closing STOP
                pass
            if request.profile:
                gather_json(record, rt.control)


def leave_together(rt: Runtime) -> None:
    """End a clean shutdown: no rank exits before every rank has finished, then exit at once.

    No destroy_process_group, and no interpreter teardown: measured here, a gloo rank that
    destroys its group while a peer is still connected aborts at exit ("terminate called without
    an active exception"), and so, under load, did a rank whose interpreter teardown ran while a
    peer was closing its connections (a SIGABRT, seen in a full test run on a loaded machine). Both turned clean shutdowns
    into failures. ``os._exit`` after the barrier skips the C++ destructors; the OS releases the
    connections.
    """
    barrier(rt.control)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@record
def run(args: argparse.Namespace) -> None:
    rt = start_runtime(args)
    ranks = gather_json(describe_rank(rt), rt.control)  # also proves every rank is up
    if rt.rank != 0:
        try:
            follow(rt)
            leave_together(rt)
        except PeerLost as exc:
            log.error("rank %d lost contact with rank 0: %s", rt.rank, exc)
            os._exit(EXIT_PEER_LOST)
        except Exception as exc:  # e.g. inside the model: record why, then leave at once
            if is_peer_failure(exc):  # an effect of another rank's end, not a cause
                log.error("rank %d lost contact with another rank: %s", rt.rank, exc)
                os._exit(EXIT_PEER_LOST)
            log.exception("rank %d failed", rt.rank)
            ErrorHandler().record_exception(exc)  # the launcher reads it: the failure names this rank and error
            os._exit(1)  # not a normal exit: a live gloo group can abort interpreter shutdown
        return
    limits = protocol.Limits(max_payload_bytes=args.max_payload_mb << 20)
    tcp = launcher.tcp_address(args.tcp) if args.tcp else None
    token = args.token_file.read_text().strip() if args.tcp else None
    leader = Leader(rt, ranks, args.socket, limits, args.heartbeat, tuple(args.model_root), tcp, token)
    server = leader.server
    server.start()
    log.info("backend ready: world size %d, socket %s", rt.world_size, args.socket)
    try:
        leader.serve()
    except PeerLost as exc:
        message = f"rank 0 lost contact with another rank ({exc}); the backend is stopping"
        log.error(message)
        server.fail_all("rank_failed", message, "the next request restarts the backend", rank=0)
        server.close()
        os._exit(EXIT_PEER_LOST)
    server.close()
    leave_together(rt)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s")
    run(args)


if __name__ == "__main__":
    main()
