"""``xdit-backend serve|start|stop|status|sample|demo|selftest|bench``: the command line over launcher and client."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import schema
from .client import BackendError, Client, NoBackend
from .launch import launcher, status_text
from .launch.options import LaunchError, LaunchOptions, int_list
from .wire import paths


def _add_socket(parser: argparse.ArgumentParser) -> None:
    LaunchOptions.add_arguments(parser, only=("socket",))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xdit-backend", description="Multi-process parallel DiT sampling backend")
    commands = parser.add_subparsers(dest="command", required=True)

    LaunchOptions.add_arguments(commands.add_parser("serve", help="run a backend in the foreground"))
    start = commands.add_parser("start", help="start a backend in the background; prints its status")
    LaunchOptions.add_arguments(start)
    start.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every rank (default 180)")
    status = commands.add_parser("status", help="the running backend's GPUs, memory, models and idle times; exit 1 "
                                 "if none")
    _add_socket(status)
    status.add_argument("--json", action="store_true", help="the status record as JSON")
    _add_socket(commands.add_parser("stop", help="stop the backend"))

    sample = commands.add_parser("sample", help="generate one latent through the backend")
    LaunchOptions.add_arguments(sample)
    schema.add_flags(sample)  # one flag per request field (the layout's: below)
    sample.add_argument("--latent", type=Path, default=None,
                        help="input latent: a safetensors file with 'samples' (what --out writes) or 'latent'")
    sample.add_argument("--embeds", type=Path, default=None,
                        help="safetensors with the model's conditioning by request key: context, pooled [, "
                             "negative_context, negative_pooled, a second encoder's context_mt5, …]")
    sample.add_argument("--reference-latent", type=Path, action="append", default=[], metavar="FILE",
                        help="a reference image's latent (image editing: Qwen-Image-Edit, Flux.2), a safetensors "
                             "file with 'samples' [B, C, h, w] like --latent; repeat for several, in order. Both "
                             "sides of the guidance get them")
    sample.add_argument("--out", type=Path, required=True, help="output safetensors; the latent is under 'samples'")
    sample.add_argument("--info", type=Path, default=None, metavar="FILE.json",
                        help="write the result info (layout, times, step cache counts, LoRA reports) as JSON, for scripts")
    layout = sample.add_argument_group("parallel layout (default: --parallel auto)")
    layout.add_argument("--ulysses", type=int, default=None, help="Ulysses sequence-parallel degree")
    layout.add_argument("--ring", type=int, default=None, help="Ring sequence-parallel degree")
    layout.add_argument("--cfg-parallel", action="store_true", help="cond and uncond on two halves of the ranks")
    layout.add_argument("--dp", type=int, default=None, help="data-parallel degree (splits --batch)")
    layout.add_argument("--pipefusion", type=int, default=None, help="PipeFusion pipeline stages")
    layout.add_argument("--patches", type=int, default=None,
                        help="PipeFusion patches per step (default: the stages; more patches overlap better)")
    layout.add_argument("--warmup-steps", type=int, default=None,
                        help="PipeFusion's first steps on the whole latent, exact (default 1)")
    layout.add_argument("--stage-blocks", type=int_list, default=None,
                        help="PipeFusion blocks per stage, e.g. 2,5 (default: balanced by parameters)")
    layout.add_argument("--shard-weights", action="store_true",
                        help="keep 1/S of every transformer block per rank (FSDP2), S = the ranks that run the same "
                             "blocks; goes with degrees (auto shards by itself when the model would not fit)")
    layout.add_argument("--parallel", choices=("auto",), default=None,
                        help="let the backend pick degrees for its world size (the default without degrees)")

    demo = commands.add_parser("demo", help="serial vs. backend on the built-in tiny model")
    demo.add_argument("--steps", type=int, default=8)
    demo.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
    demo.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")

    selftest = commands.add_parser("selftest", help="the GPU smoke suite: PASS/FAIL per section with its figures "
                                   "(skips without CUDA); the first thing to run on a GPU machine")
    selftest.add_argument("--out", type=Path, default=Path("selftest-out"), help="folder for selftest.json")
    selftest.add_argument("--only", nargs="+", default=(), metavar="SECTION", help="run only these sections")
    selftest.add_argument("--cpu", action="store_true",
                          help="a dry run on the CPU: the sections that can run there, at the smallest sizes")

    bench = commands.add_parser("bench", help="benchmarks (timings live here, never in tests)")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    transport = bench_kinds.add_parser("transport", help="backend cold start and socket round trips")
    transport.add_argument("--nproc", type=int, default=2)
    transport.add_argument("--repeats", type=int, default=200)
    layouts = bench_kinds.add_parser("layouts", help="parallel layouts: step time, bytes sent per rank, peak memory")
    layouts.add_argument("--layouts", nargs="+", default=None,
                         help="e.g. serial ulysses=2 ring=2 cfg=2,ulysses=2 ulysses=2,shard (,shard: weights sharded; "
                              "default: the world-2 and world-4 set)")
    layouts.add_argument("--model", default="flux-tiny",
                         help="a built-in (flux-tiny…, or flux-dev-random: the full Flux.1-dev architecture with "
                              "random weights, for GPUs), a model file or folder")
    layouts.add_argument("--width", type=int, default=512)
    layouts.add_argument("--height", type=int, default=512)
    layouts.add_argument("--frames", type=int, default=1, help="video frames, for a video model (default 1)")
    layouts.add_argument("--steps", type=int, default=6)
    layouts.add_argument("--batch", type=int, default=2)
    layouts.add_argument("--cfg", type=float, default=3.5)
    layouts.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
    layouts.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    layouts.add_argument("--json", type=Path, default=None, help="also write every figure and raw record as JSON")
    layouts.add_argument("--plot", type=Path, default=None,
                         help="PNG: step time and efficiency against ranks, one line per method (needs matplotlib)")
    overhead = bench_kinds.add_parser("overhead", help="the backend's step at world 1 against a plain diffusers loop")
    overhead.add_argument("--model", default="flux-tiny",
                          help="a Flux model: flux-tiny (CPU), flux-dev-random (the full architecture, GPU) or a file")
    overhead.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    overhead.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
    overhead.add_argument("--width", type=int, default=1024)
    overhead.add_argument("--height", type=int, default=1024)
    overhead.add_argument("--steps", type=int, default=8)
    overhead.add_argument("--repeats", type=int, default=3)
    scaling = bench_kinds.add_parser("scaling", help="MODELED step times on 2/4/8 GPUs, NVLink and PCIe (no GPU needed)")
    scaling.add_argument("--t1", type=float, default=None,
                         help="one GPU's step time in seconds (default: xDiT's published Flux.1-dev 1024² figure)")
    memory = bench_kinds.add_parser("memory", help="MODELED bytes per rank for the full-size models: storage × "
                                    "GPUs × sharding, and which cards they fit (no GPU, no weights needed)")
    memory.add_argument("--measure", action="store_true",
                        help="instead, check the model against measured CPU peaks of a full-width two-block Flux, "
                             "serial and ulysses=2 (about 5 GB of RAM)")
    memory.add_argument("--width", type=int, default=512)
    memory.add_argument("--height", type=int, default=512)
    memory.add_argument("--text-tokens", type=int, default=256)
    versus = bench_kinds.add_parser("versus-diffusers", help="one Flux forward on the CPU: our sequence "
                                    "parallelism against diffusers' context parallelism, same model and inputs")
    versus.add_argument("--width", type=int, default=1024)
    versus.add_argument("--height", type=int, default=1024)
    versus.add_argument("--text-tokens", type=int, default=256)
    versus.add_argument("--repeats", type=int, default=3)
    versus.add_argument("--layouts", nargs="+", default=["ulysses=2", "ring=2"])
    cache = bench_kinds.add_parser("cache", help="the step cache: steps reused, speed-up and distance to the "
                                   "uncached latent per method and threshold")
    cache.add_argument("--model", default="flux-tiny", help="a built-in model (flux-tiny, wan-tiny, flux-dev-two-blocks…)")
    cache.add_argument("--width", type=int, default=512)
    cache.add_argument("--height", type=int, default=512)
    cache.add_argument("--frames", type=int, default=1, help="video frames, for a video model (default 1)")
    cache.add_argument("--steps", type=int, default=28)
    cache.add_argument("--batch", type=int, default=1)
    cache.add_argument("--cfg", type=float, default=1.0)
    cache.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
    cache.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cache.add_argument("--layout", default="serial", help="e.g. serial, ulysses=2, cfg=2,ulysses=2")
    cache.add_argument("--methods", nargs="+", choices=schema.CACHE_METHODS[1:], default=["fbcache", "teacache"])
    cache.add_argument("--thresholds", nargs="+", type=float, default=[0.0, 0.08, 0.25],
                       help="each method runs at each threshold")
    error = bench_kinds.add_parser("pipefusion-error", help="PipeFusion's distance to serial by patches, warm-up, steps")
    error.add_argument("--stages", type=int, default=2)
    error.add_argument("--width", type=int, default=512)
    error.add_argument("--height", type=int, default=512)
    error.add_argument("--frames", type=int, default=5, help="video frames, for a video model")
    error.add_argument("--model", nargs="+", default=["flux-tiny"],
                       help="built-in models, one table each (e.g. flux-tiny sd3-tiny pixart-tiny wan-tiny)")
    return parser


def cmd_serve(args) -> int:
    return launcher.serve(LaunchOptions.from_args(args))


def cmd_start(args) -> int:
    status = launcher.start(LaunchOptions.from_args(args), timeout=args.timeout)
    print(json.dumps(status, indent=2))
    return 0


def cmd_status(args) -> int:
    try:
        status = Client(args.socket).status()
        print(json.dumps(status, indent=2) if args.json else status_text.describe(status))
        return 0
    except NoBackend as exc:
        print(f"xdit-backend: {exc}", file=sys.stderr)
        return 1


def cmd_stop(args) -> int:
    socket_path = paths.resolve_socket(args.socket)
    if launcher.stop(socket_path):
        print(f"stopped the backend at {socket_path}")
    else:
        print(f"no backend was running at {socket_path}")
    return 0


def print_progress(step: int, total: int, elapsed: float) -> None:
    end = "\n" if step == total else ""
    print(f"\r  step {step}/{total}  {elapsed:6.2f} s", end=end, file=sys.stderr, flush=True)


def requested_layout(args) -> dict | str:
    """Explicit degrees from the flags, or "auto"."""
    degrees = {"ulysses": args.ulysses, "ring": args.ring, "dp": args.dp, "cfg": 2 if args.cfg_parallel else None,
               "pipefusion": args.pipefusion}
    degrees = {name: value for name, value in degrees.items() if value is not None}
    if degrees and args.parallel == "auto":
        raise SystemExit("xdit-backend: give degrees (--ulysses, --ring, --cfg-parallel, --dp, --pipefusion) "
                         "or --parallel auto, not both")
    pipeline = {"num_pipeline_patch": args.patches, "warmup_steps": args.warmup_steps,
                "pipefusion_blocks": list(args.stage_blocks) if args.stage_blocks else None}
    pipeline = {name: value for name, value in pipeline.items() if value is not None}
    if pipeline and not degrees.get("pipefusion"):
        raise SystemExit("xdit-backend: --patches, --warmup-steps and --stage-blocks go with --pipefusion")
    if args.shard_weights and not degrees:
        raise SystemExit("xdit-backend: --shard-weights goes with degrees (e.g. --ulysses 2 --shard-weights); "
                         "with --parallel auto the backend shards by itself when the model would not fit")
    sharding = {"shard_weights": True} if args.shard_weights else {}
    return {**degrees, **pipeline, **sharding} if degrees else "auto"


def sample_fields(args) -> dict:
    """The request's wire fields from the ``sample`` flags: the schema's, and the layout's."""
    return {**schema.flag_fields(args), "parallel": requested_layout(args)}


def sample_tensors(args) -> dict:
    """The request's tensors from the ``sample`` flags: --embeds' conditioning, the --latent, and each
    --reference-latent as reference_<i> (and negative_reference_<i> when the embeds have a negative side)."""
    from safetensors.torch import load_file

    def latent(path: Path):
        stored = load_file(path)
        samples = stored.get("samples", stored.get("latent"))
        if samples is None:
            raise SystemExit(f"{path} holds neither 'samples' nor 'latent' (it has: {', '.join(stored)})")
        return samples

    tensors = load_file(args.embeds) if args.embeds else {}
    if args.latent:
        tensors["latent"] = latent(args.latent)
    for i, path in enumerate(args.reference_latent):
        tensors[f"reference_{i}"] = latent(path)
        if "negative_context" in tensors:
            tensors[f"negative_reference_{i}"] = tensors[f"reference_{i}"]
    return tensors


def cmd_sample(args) -> int:
    import math

    import torch
    from safetensors.torch import save_file

    fields = sample_fields(args)
    if args.info is not None and not args.info.parent.is_dir():  # before the request, not after its work is done
        raise SystemExit(f"--info {args.info}: the folder {args.info.parent} does not exist; create it or name another")
    layout = fields["parallel"]
    tensors = sample_tensors(args)
    client = Client(args.socket)
    ephemeral = client.hello_or_none() is None
    if ephemeral:
        options = LaunchOptions.from_args(args)
        if isinstance(layout, dict) and args.nproc is None:  # as many ranks as the layout needs
            ranks = math.prod(layout.get(axis, 1) for axis in ("dp", "cfg", "pipefusion", "ring", "ulysses"))
            options = LaunchOptions.from_args(args, nproc=ranks)
        print(f"no backend at {client.socket_path}: starting one for this request", file=sys.stderr)
        launcher.start(options)
    try:
        started = time.perf_counter()
        result, info = client.sample(fields, tensors, on_progress=print_progress)
        elapsed = time.perf_counter() - started
    finally:
        if ephemeral:
            launcher.stop(client.socket_path)
    samples = result["samples"].to(torch.float32).contiguous()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"samples": samples}, str(args.out))
    print(f"wrote {args.out}: samples {list(samples.shape)} in {elapsed:.2f} s, "
          f"world {info.get('world_size')}: {info.get('layout', '')}", file=sys.stderr)
    if "cache" in info:
        print(f"step cache: {info['cache']['computed']} computed, {info['cache']['reused']} reused", file=sys.stderr)
    if args.info is not None:
        args.info.write_text(json.dumps({"elapsed_s": elapsed, **info}, indent=1))
    if "profile" in info:  # --profile: each rank's record, as JSON on stdout
        print(json.dumps(info["profile"], indent=1))
    for report in info.get("loras", []):
        unmatched = (f"; {report['unmatched_keys']} keys matched nothing, e.g. {report['unmatched_examples']}"
                     if report["unmatched_keys"] else "")
        print(f"LoRA {report['file']} × {report['strength']:g}: {report['merged_modules']} modules merged{unmatched}",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .bench.demo import run_demo

        handler = lambda a: run_demo(steps=a.steps, size=a.size, nproc=a.nproc)  # noqa: E731
    elif args.command == "selftest":
        from .selftest.runner import run_selftest

        handler = lambda a: run_selftest(a.out, tuple(a.only), a.cpu)  # noqa: E731
    elif args.command == "bench" and args.bench == "transport":
        from .bench.layouts import run_transport_bench

        handler = lambda a: run_transport_bench(nproc=a.nproc, repeats=a.repeats)  # noqa: E731
    elif args.command == "bench" and args.bench == "overhead":
        from .bench.overhead import run_overhead_bench

        handler = lambda a: run_overhead_bench(a.model, a.device, a.dtype, a.width, a.height, a.steps,  # noqa: E731
                                                 a.repeats)
    elif args.command == "bench" and args.bench == "scaling":
        from .bench.scaling import run_scaling_model

        handler = lambda a: run_scaling_model(a.t1)  # noqa: E731
    elif args.command == "bench" and args.bench == "memory":
        from .bench.memory_check import run_memory_check
        from .bench.memory_table import run_memory_table

        handler = lambda a: (run_memory_check(a.width, a.height, a.text_tokens) if a.measure  # noqa: E731
                             else run_memory_table())
    elif args.command == "bench" and args.bench == "versus-diffusers":
        from .bench.versus import run_versus_diffusers_bench

        handler = lambda a: run_versus_diffusers_bench(a.width, a.height, a.text_tokens, a.repeats,  # noqa: E731
                                                       tuple(a.layouts))
    elif args.command == "bench" and args.bench == "pipefusion-error":
        from .bench.layouts import run_pipefusion_error_bench

        handler = lambda a: run_pipefusion_error_bench(a.stages, a.width, a.height, tuple(a.model), a.frames)  # noqa: E731
    elif args.command == "bench" and args.bench == "cache":
        from .bench.layouts import run_cache_bench

        fields = {"model": args.model, "width": args.width, "height": args.height, "steps": args.steps,
                  "batch": args.batch, "cfg": args.cfg, "seed": 1, "dtype": args.dtype,
                  **({"frames": args.frames} if args.frames != 1 else {})}
        handler = lambda a: run_cache_bench(fields, a.methods, a.thresholds, a.layout, a.device)  # noqa: E731
    elif args.command == "bench":
        from .bench.layouts import DEFAULT_LAYOUTS, run_layout_bench

        fields = {"model": args.model, "width": args.width, "height": args.height, "steps": args.steps,
                  "batch": args.batch, "cfg": args.cfg, "seed": 1, "dtype": args.dtype,
                  **({"frames": args.frames} if args.frames != 1 else {})}
        handler = lambda a: run_layout_bench(a.layouts or DEFAULT_LAYOUTS, fields, a.json, a.plot,  # noqa: E731
                                             a.device)
    else:
        handler = globals()[f"cmd_{args.command}"]
    try:
        return handler(args)
    except (BackendError, LaunchError, paths.UnsafeDirectoryError) as exc:
        print(f"xdit-backend: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
