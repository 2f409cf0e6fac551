"""The measurement commands (``xdit-backend demo`` and ``xdit-backend bench …``): each one's flags and
the call it makes, in the shape cli.py's table takes (``name``, ``help``, ``add_arguments``, ``run``).

They live here, not in the measurement modules beside them, because the CLI builds every
subcommand's parser before it knows which one runs, and those modules import torch, the client
and the models at the top: ``run`` imports its measurement only when it runs, so ``--help`` and
a usage error load none of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import schema


def _request_fields(args: argparse.Namespace) -> dict:
    """The request the layouts and cache benches send, from their shared flags (seed 1)."""
    return {"model": args.model, "width": args.width, "height": args.height, "steps": args.steps,
            "batch": args.batch, "cfg": args.cfg, "seed": 1, "dtype": args.dtype,
            **({"frames": args.frames} if args.frames != 1 else {})}


class Demo:
    name = "demo"
    help = "serial vs. backend on the built-in tiny model"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--steps", type=int, default=8)
        parser.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
        parser.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 2 on the CPU)")

    def run(self, args: argparse.Namespace) -> int:
        from .demo import run_demo

        return run_demo(steps=args.steps, size=args.size, nproc=args.nproc)


class Transport:
    name = "transport"
    help = "backend cold start and socket round trips"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nproc", type=int, default=2)
        parser.add_argument("--repeats", type=int, default=200)

    def run(self, args: argparse.Namespace) -> int:
        from .layouts import run_transport_bench

        return run_transport_bench(nproc=args.nproc, repeats=args.repeats)


class Layouts:
    name = "layouts"
    help = "parallel layouts: step time, bytes sent per rank, peak memory"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--layouts", nargs="+", default=None,
                            help="e.g. serial ulysses=2 ring=2 cfg=2,ulysses=2 ulysses=2,shard (,shard: weights "
                                 "sharded; default: the world-2 and world-4 set)")
        parser.add_argument("--model", default="flux-tiny",
                            help="a built-in (flux-tiny…, or flux-dev-random: the full Flux.1-dev architecture with "
                                 "random weights, for GPUs), a model file or folder")
        parser.add_argument("--width", type=int, default=512)
        parser.add_argument("--height", type=int, default=512)
        parser.add_argument("--frames", type=int, default=1, help="video frames, for a video model (default 1)")
        parser.add_argument("--steps", type=int, default=6)
        parser.add_argument("--batch", type=int, default=2)
        parser.add_argument("--cfg", type=float, default=3.5)
        parser.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--json", type=Path, default=None, help="also write every figure and raw record as JSON")
        parser.add_argument("--plot", type=Path, default=None,
                            help="PNG: step time and efficiency against ranks, one line per method (needs matplotlib)")

    def run(self, args: argparse.Namespace) -> int:
        from .layouts import DEFAULT_LAYOUTS, run_layout_bench

        return run_layout_bench(args.layouts or DEFAULT_LAYOUTS, _request_fields(args), args.json, args.plot,
                                args.device)


class Overhead:
    name = "overhead"
    help = "the backend's step at world 1 against a plain diffusers loop"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="flux-tiny",
                            help="a Flux model: flux-tiny (CPU), flux-dev-random (the full architecture, GPU) or a "
                                 "file")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
        parser.add_argument("--width", type=int, default=1024)
        parser.add_argument("--height", type=int, default=1024)
        parser.add_argument("--steps", type=int, default=8)
        parser.add_argument("--repeats", type=int, default=3)

    def run(self, args: argparse.Namespace) -> int:
        from .overhead import run_overhead_bench

        return run_overhead_bench(args.model, args.device, args.dtype, args.width, args.height, args.steps,
                                  args.repeats)


class Scaling:
    name = "scaling"
    help = "MODELED step times on 2/4/8 GPUs, NVLink and PCIe (no GPU needed)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--t1", type=float, default=None,
                            help="one GPU's step time in seconds (default: xDiT's published Flux.1-dev 1024² figure)")

    def run(self, args: argparse.Namespace) -> int:
        from .scaling import run_scaling_model

        return run_scaling_model(args.t1)


class Memory:
    name = "memory"
    help = ("MODELED bytes per rank for the full-size models: storage × GPUs × sharding, and which cards they fit "
            "(no GPU, no weights needed)")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--measure", action="store_true",
                            help="instead, check the model against measured CPU peaks of a full-width two-block "
                                 "Flux, serial and ulysses=2 (about 5 GB of RAM)")
        parser.add_argument("--width", type=int, default=512)
        parser.add_argument("--height", type=int, default=512)
        parser.add_argument("--text-tokens", type=int, default=256)

    def run(self, args: argparse.Namespace) -> int:
        if args.measure:
            from .memory_check import run_memory_check

            return run_memory_check(args.width, args.height, args.text_tokens)
        from .memory_table import run_memory_table

        return run_memory_table()


class VersusDiffusers:
    name = "versus-diffusers"
    help = ("one Flux forward on the CPU: our sequence parallelism against diffusers' context parallelism, same "
            "model and inputs")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--width", type=int, default=1024)
        parser.add_argument("--height", type=int, default=1024)
        parser.add_argument("--text-tokens", type=int, default=256)
        parser.add_argument("--repeats", type=int, default=3)
        parser.add_argument("--layouts", nargs="+", default=["ulysses=2", "ring=2"])

    def run(self, args: argparse.Namespace) -> int:
        from .versus import run_versus_diffusers_bench

        return run_versus_diffusers_bench(args.width, args.height, args.text_tokens, args.repeats, tuple(args.layouts))


class Cache:
    name = "cache"
    help = ("the step cache: steps reused, speed-up and distance to the uncached latent per method and "
            "threshold")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="flux-tiny",
                            help="a built-in model (flux-tiny, wan-tiny, flux-dev-two-blocks…)")
        parser.add_argument("--width", type=int, default=512)
        parser.add_argument("--height", type=int, default=512)
        parser.add_argument("--frames", type=int, default=1, help="video frames, for a video model (default 1)")
        parser.add_argument("--steps", type=int, default=28)
        parser.add_argument("--batch", type=int, default=1)
        parser.add_argument("--cfg", type=float, default=1.0)
        parser.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--layout", default="serial", help="e.g. serial, ulysses=2, cfg=2,ulysses=2")
        parser.add_argument("--methods", nargs="+", choices=schema.CACHE_METHODS[1:], default=["fbcache", "teacache"])
        parser.add_argument("--thresholds", nargs="+", type=float, default=[0.0, 0.08, 0.25],
                            help="each method runs at each threshold")

    def run(self, args: argparse.Namespace) -> int:
        from .layouts import run_cache_bench

        return run_cache_bench(_request_fields(args), args.methods, args.thresholds, args.layout, args.device)


class PipefusionError:
    name = "pipefusion-error"
    help = "PipeFusion's distance to serial by patches, warm-up, steps"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--stages", type=int, default=2)
        parser.add_argument("--width", type=int, default=512)
        parser.add_argument("--height", type=int, default=512)
        parser.add_argument("--frames", type=int, default=5, help="video frames, for a video model")
        parser.add_argument("--model", nargs="+", default=["flux-tiny"],
                            help="built-in models, one table each (e.g. flux-tiny sd3-tiny pixart-tiny wan-tiny)")

    def run(self, args: argparse.Namespace) -> int:
        from .layouts import run_pipefusion_error_bench

        return run_pipefusion_error_bench(args.stages, args.width, args.height, tuple(args.model), args.frames)


# ``xdit-backend bench <name>``, in the order ``bench --help`` lists them
class ModelCall:
    name = "model-call"
    help = "the xDiT MODEL's step (one request per model call) against the xDiT Sampler's, side by side"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="flux-tiny",
                            help="a built-in model: flux-tiny, flux-dev-two-blocks (Flux.1-dev's width, two blocks)…")
        parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="backend sizes (default 1 2)")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--dtype", choices=schema.DTYPE_NAMES, default="auto")
        parser.add_argument("--width", type=int, default=512)
        parser.add_argument("--height", type=int, default=512)
        parser.add_argument("--steps", type=int, default=8)
        parser.add_argument("--repeats", type=int, default=3)

    def run(self, args: argparse.Namespace) -> int:
        from .model_call import run_model_call_bench

        return run_model_call_bench(args.model, tuple(args.worlds), args.width, args.height, args.steps,
                                    args.repeats, args.dtype, args.device)


class Control:
    name = "control"
    help = ("a control's cost per rank at full width (Qwen-Image's DiffSynth patch and ControlNet; --family flux: a "
            "Flux ControlNet): ours against the peers'")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--size", type=int, default=512, help="image side in pixels (default 512)")
        parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="sequence degrees (default 1 2 4)")
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
        parser.add_argument("--repeats", type=int, default=3)
        parser.add_argument("--family", choices=("qwen_image", "flux"), default="qwen_image",
                            help="whose control: Qwen-Image's patch and ControlNet, or Flux.1's ControlNet")

    def run(self, args: argparse.Namespace) -> int:
        from .control import run_control_bench, run_flux_controlnet_bench

        bench = run_flux_controlnet_bench if args.family == "flux" else run_control_bench
        return bench(args.size, tuple(args.ranks), args.device, args.dtype, args.repeats)


BENCHES = (Transport(), Layouts(), Overhead(), Scaling(), Memory(), VersusDiffusers(), Cache(), PipefusionError(),
           ModelCall(), Control())
