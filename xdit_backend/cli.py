"""``xdit-backend serve|start|stop|status|sample|demo|selftest|bench``: the command line over launcher and client.

Every subcommand is a command object in one table, ``COMMANDS`` (``bench`` holds its own, bench/commands.BENCHES):
its name and help line, ``add_arguments(parser)`` for its flags and ``run(args)`` for its exit code. The commands that
drive a backend are here; the measurement commands are in bench/commands.py, the smoke suite's in
selftest/command.py. Parsing loads no torch: the launcher, the client and the measurements are imported
by the command that runs, so ``--help`` and a usage error return at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Protocol

from . import schema
from .bench.commands import BENCHES, Demo
from .errors import UsageError
from .launch import status_text
from .launch.options import LaunchError, LaunchOptions, int_list
from .selftest.command import Selftest
from .wire import paths
from .wire.endpoint import BackendError


class Command(Protocol):
    """One subcommand: its name and help line, its flags, and what it does (its exit code)."""

    name: str
    help: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class Serve:
    name = "serve"
    help = "run a backend in the foreground"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        LaunchOptions.add_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        from .launch import launcher

        return launcher.serve(LaunchOptions.from_args(args))


class Start:
    name = "start"
    help = "start a backend in the background; prints its status"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        LaunchOptions.add_arguments(parser)
        parser.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for every rank (default 180)")

    def run(self, args: argparse.Namespace) -> int:
        from .launch import launcher

        status = launcher.start(LaunchOptions.from_args(args), timeout=args.timeout)
        print(json.dumps(status, indent=2))
        return 0


class Status:
    name = "status"
    help = "the running backend's GPUs, memory, models and idle times; exit 1 if none"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        LaunchOptions.add_arguments(parser, only=("socket",))
        parser.add_argument("--json", action="store_true", help="the status record as JSON")

    def run(self, args: argparse.Namespace) -> int:
        from .client import Client, NoBackend

        try:
            status = Client(args.socket).status()
            print(json.dumps(status, indent=2) if args.json else status_text.describe(status))
            return 0
        except NoBackend as exc:
            print(f"xdit-backend: {exc}", file=sys.stderr)
            return 1


class Stop:
    name = "stop"
    help = "stop the backend"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        LaunchOptions.add_arguments(parser, only=("socket",))

    def run(self, args: argparse.Namespace) -> int:
        from .launch import launcher

        socket_path = paths.resolve_socket(args.socket)
        if launcher.stop(socket_path):
            print(f"stopped the backend at {socket_path}")
        else:
            print(f"no backend was running at {socket_path}")
        return 0


class Sample:
    name = "sample"
    help = "generate one latent through the backend"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        LaunchOptions.add_arguments(parser)
        schema.add_flags(parser)  # one flag per request field (the layout's: below)
        parser.add_argument("--latent", type=Path, default=None,
                            help="input latent: a safetensors file with 'samples' (what --out writes) or 'latent'")
        parser.add_argument("--embeds", type=Path, default=None,
                            help="safetensors with the model's conditioning by request key: context, pooled [, "
                                 "negative_context, negative_pooled, a second encoder's context_mt5, an image to "
                                 "video's concat_latent_image, concat_mask and clip_vision_output, …]")
        parser.add_argument("--reference-latent", type=Path, action="append", default=[], metavar="FILE",
                            help="a reference image's latent (image editing: Qwen-Image-Edit, Flux.2), a safetensors "
                                 "file with 'samples' [B, C, h, w] like --latent; repeat for several, in order. Both "
                                 "sides of the guidance get them")
        for option, value, what in CONTROL_OPTIONS:
            parser.add_argument(option, type=value, action=ControlOption, dest="controls", help=what,
                                metavar=option.removeprefix("--control-").upper())
        parser.add_argument("--noise-mask", type=Path, default=None, metavar="FILE",
                            help="inpainting: a safetensors file with 'mask' (or 'noise_mask') [N, 1, H, W], 1 where "
                                 "to make anew, 0 where to keep --latent (resized to the latent as ComfyUI does)")
        parser.add_argument("--out", type=Path, required=True,
                            help="output safetensors; the latent is under 'samples' (and the audio's under "
                                 "'audio_samples' for LTX-2 and MiniMax-H3)")
        parser.add_argument("--info", type=Path, default=None, metavar="FILE.json",
                            help="write the result info (layout, times, step cache counts, LoRA reports) as JSON, "
                                 "for scripts")
        layout = parser.add_argument_group("parallel layout (default: --parallel auto)")
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
                            help="keep 1/S of every transformer block per rank (FSDP2), S = the ranks that run the "
                                 "same blocks; goes with degrees (auto shards by itself when the model would not fit)")
        layout.add_argument("--parallel", choices=("auto",), default=None,
                            help="let the backend pick degrees for its world size (the default without degrees)")

    def run(self, args: argparse.Namespace) -> int:
        import math

        import torch
        from safetensors.torch import save_file

        from .client import Client
        from .launch import launcher

        fields = sample_fields(args)
        if args.info is not None and not args.info.parent.is_dir():  # before the request, not after its work is done
            raise UsageError(f"--info {args.info}: the folder {args.info.parent} does not exist",
                             "create it or name another")
        layout = fields["parallel"]
        tensors = sample_tensors(args)
        client = Client(args.socket)
        ephemeral = client.hello_or_none() is None
        if not ephemeral:
            refuse_other_launch_flags(args, client.status(), client.socket_path)
        if ephemeral:
            options = LaunchOptions.from_args(args)
            if isinstance(layout, dict) and args.nproc is None:  # as many ranks as the layout needs
                ranks = math.prod(layout.get(axis, 1) for axis in ("dp", "cfg", "pipefusion", "ring", "ulysses"))
                options = LaunchOptions.from_args(args, nproc=ranks)
            print(f"no backend at {client.socket_path}: starting one for this request", file=sys.stderr)
            launcher.start(options)
        try:
            started = time.perf_counter()
            result, info = client.sample(fields, tensors, on_progress=print_progress,
                                         on_note=lambda text: print(f"  {text}", file=sys.stderr))
            elapsed = time.perf_counter() - started
        finally:
            if ephemeral:
                launcher.stop(client.socket_path)
        outputs = {name: tensor.to(torch.float32).contiguous() for name, tensor in result.items()}  # + audio_samples
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_file(outputs, str(args.out))
        shapes = ", ".join(f"{name} {list(tensor.shape)}" for name, tensor in outputs.items())
        print(f"wrote {args.out}: {shapes} in {elapsed:.2f} s, "
              f"world {info.get('world_size')}: {info.get('layout', '')}", file=sys.stderr)
        if "cache" in info:
            print(f"step cache: {info['cache']['computed']} computed, {info['cache']['reused']} reused",
                  file=sys.stderr)
        if args.info is not None:
            args.info.write_text(json.dumps({"elapsed_s": elapsed, **info}, indent=1))
        if "profile" in info:  # --profile: each rank's record, as JSON on stdout
            print(json.dumps(info["profile"], indent=1))
        for report in info.get("loras", []):
            unmatched = (f"; {report['unmatched_keys']} keys matched nothing, e.g. {report['unmatched_examples']}"
                         if report["unmatched_keys"] else "")
            print(f"LoRA {report['file']} × {report['strength']:g}: {report['merged_modules']} modules "
                  f"merged{unmatched}", file=sys.stderr)
        return 0


def print_progress(step: int, total: int, elapsed: float) -> None:
    end = "\n" if step == total else ""
    print(f"\r  step {step}/{total}  {elapsed:6.2f} s", end=end, file=sys.stderr, flush=True)


def refuse_other_launch_flags(args, status: dict, socket_path) -> None:
    """Launch flags given to ``sample`` while a backend already serves the socket are its own or refused: they
    would be silently ignored, the running backend's ranks serving the request. GPUs are compared as physical ids
    (launch/gpus.py ``running_elsewhere``, as the nodes compare them), the device by its kind (a rank's is cuda:0)."""
    from socket import gethostname

    from .launch.gpus import running_elsewhere
    from .launch.options import cuda_device_count

    ranks = status.get("ranks", [])
    device = ranks[0]["device"].split(":")[0] if ranks else None
    differ = []  # (what was asked, what the running backend has)
    if args.nproc is not None and args.nproc != status.get("world_size"):
        differ.append((f"--nproc {args.nproc}", f"nproc {status.get('world_size')}"))
    if args.device is not None and args.device != device:
        differ.append((f"--device {args.device}", f"device {device}"))
    if args.gpus is not None:
        where = ("its ranks run on the CPU" if device != "cuda"
                 else running_elsewhere(ranks, os.environ, args.gpus, cuda_device_count(), gethostname()))
        if where:
            differ.append((f"--gpus {','.join(map(str, args.gpus))}", where))
    if differ:
        raise UsageError(f"a backend already serves {socket_path} ({', '.join(has for _, has in differ)}), and "
                         f"{', '.join(asked for asked, _ in differ)} would be ignored",
                         "stop it first (`xdit-backend stop`) to start one with these flags, or leave them out to "
                         "use the running one")


def requested_layout(args) -> dict | str:
    """Explicit degrees from the flags, or "auto"."""
    degrees = {"ulysses": args.ulysses, "ring": args.ring, "dp": args.dp, "cfg": 2 if args.cfg_parallel else None,
               "pipefusion": args.pipefusion}
    degrees = {name: value for name, value in degrees.items() if value is not None}
    if degrees and args.parallel == "auto":
        raise UsageError("degrees (--ulysses, --ring, --cfg-parallel, --dp, --pipefusion) and --parallel auto "
                         "given together", "give the degrees, or --parallel auto, not both")
    pipeline = {"num_pipeline_patch": args.patches, "warmup_steps": args.warmup_steps,
                "pipefusion_blocks": list(args.stage_blocks) if args.stage_blocks else None}
    pipeline = {name: value for name, value in pipeline.items() if value is not None}
    if pipeline and not degrees.get("pipefusion"):
        raise UsageError("--patches, --warmup-steps and --stage-blocks given without --pipefusion",
                         "add --pipefusion N, or leave them out")
    if args.shard_weights and not degrees:
        raise UsageError("--shard-weights without degrees",
                         "give degrees with it (e.g. --ulysses 2 --shard-weights); with --parallel auto the backend "
                         "shards by itself when the model would not fit")
    sharding = {"shard_weights": True} if args.shard_weights else {}
    return {**degrees, **pipeline, **sharding} if degrees else "auto"


def sample_fields(args) -> dict:
    """The request's wire fields from the ``sample`` flags: the schema's, and the layout's."""
    fields = {**schema.flag_fields(args), "parallel": requested_layout(args)}
    if "controls" in fields:  # each control's image travels as a tensor (sample_tensors)
        fields["controls"] = [{k: v for k, v in control.items() if k != "image"} for control in fields["controls"]]
    return fields


def sample_tensors(args) -> dict:
    """The request's tensors from the ``sample`` flags: --embeds' conditioning, the --latent, its --noise-mask, and
    each --reference-latent as reference_<i> (and negative_reference_<i> when the embeds have a negative side), each
    each --control-image as control_<i>."""
    def latent(path: Path, flag: str, stored: dict | None = None):
        stored = read_tensors(path, flag) if stored is None else stored
        samples = stored.get("samples", stored.get("latent"))
        if samples is None:
            raise UsageError(f"{flag} {path} holds neither 'samples' nor 'latent' (it has: {', '.join(stored)})",
                             "give a latent written by `xdit-backend sample --out`, or ComfyUI's Save Latent file")
        return samples

    tensors = read_tensors(args.embeds, "--embeds") if args.embeds else {}
    if args.latent:
        stored = read_tensors(args.latent, "--latent")
        tensors["latent"] = latent(args.latent, "--latent", stored)
        audio = stored.get("audio_samples")  # a video-with-audio model's (--out's)
        if audio is not None:
            tensors["audio_latent"] = audio
    if args.noise_mask:
        stored = read_tensors(args.noise_mask, "--noise-mask")
        mask = stored.get("mask", stored.get("noise_mask"))
        if mask is None:
            raise UsageError(f"--noise-mask {args.noise_mask} holds neither 'mask' nor 'noise_mask' (it has: "
                             f"{', '.join(stored)})", "give a safetensors file with a 'mask' [B, 1, H, W] in [0, 1]")
        tensors["noise_mask"] = mask
    for i, path in enumerate(args.reference_latent):
        tensors[f"reference_{i}"] = latent(path, "--reference-latent")
        if "negative_context" in tensors:
            tensors[f"negative_reference_{i}"] = tensors[f"reference_{i}"]
    for i, control in enumerate(args.controls or ()):
        image = control.get("image")
        if image is not None:
            tensors[f"control_{i}"] = control_input(image, control["path"])
    return tensors


def read_tensors(path: Path, flag: str) -> dict:
    """A safetensors file a flag names, or a message saying what is wrong with it (missing, not a file, damaged)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise UsageError(f"{flag} {path}: {'no such file' if not path.exists() else 'not a file'}",
                         f"give {flag} an existing .safetensors file")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path} is not a readable safetensors file ({str(exc).splitlines()[0]})",
                         "the file may be damaged or of another format; write it again (e.g. with "
                         "`xdit-backend sample --out`)") from None


def control_input(path: Path, control: str):
    """A --control-image: a latent (a safetensors file with 'samples' or 'latent', or ComfyUI's SaveLatent file), at
    the generation's latent size; or, for a control that takes pixels (an XLabs ControlNet), an image file at the
    generation's size, as [1, 3, H, W] in [0, 1]."""
    if path.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"):
        from .models.model_patch import PatchSpec, takes_pixels

        if not takes_pixels(PatchSpec(control, 1.0)):
            raise UsageError(f"--control-image {path}: an image; {control} takes the image's VAE latent, and the "
                             "backend has no VAE", "encode it at the generation's size (ComfyUI: Load Image, VAE "
                             "Encode, Save Latent) and give that file")
        import numpy
        import torch
        from PIL import Image

        pixels = numpy.asarray(Image.open(path).convert("RGB"), dtype=numpy.float32) / 255.0  # [H, W, 3]
        return torch.from_numpy(pixels).permute(2, 0, 1)[None].contiguous()  # [1, 3, H, W]
    stored = read_tensors(path, "--control-image")
    samples = stored.get("samples", stored.get("latent", stored.get("latent_tensor")))
    if samples is None:
        raise UsageError(f"--control-image {path} holds no latent ('samples', 'latent' or SaveLatent's "
                         f"'latent_tensor'; it has: {', '.join(stored)})", "give the control image's VAE latent")
    return samples


CONTROL_OPTIONS = (  # each applies to the --control before it
    ("--control-image", Path, "the control image's VAE latent at the generation's latent size: a safetensors file with "
                              "'samples' [1, C, h, w] (or ComfyUI's Save Latent file); the backend has no VAE. A "
                              "built-in control draws one from the seed without it"),
    ("--control-strength", float, "its strength (default 1)"),
    ("--control-start", float, "a ControlNet's start percent (default 0)"),
    ("--control-end", float, "a ControlNet's end percent (default 1)"),
    ("--control-type", int, "a union ControlNet's control type, SetUnionControlNetType's number: openpose 0, depth 1, "
                            "hed/pidi/scribble/ted 2, canny/lineart/anime_lineart/mlsd 3, normal 4, segment 5, tile 6, "
                            "repaint 7 (default: auto)"),
)


class ControlOption(argparse.Action):
    """A --control-* option: sets its key on the --control given before it."""

    def __call__(self, parser, namespace, value, option_string=None):
        controls = getattr(namespace, self.dest, None)
        if not controls:
            parser.error(f"{option_string} comes after the --control it belongs to")
        key = option_string.removeprefix("--control-")
        controls[-1]["type" if key == "type" else key] = value


class Bench:
    name = "bench"
    help = "benchmarks (timings live here, never in tests)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_commands(parser, "bench", BENCHES)

    def run(self, args: argparse.Namespace) -> int:
        return named(BENCHES, args.bench).run(args)


# ``xdit-backend <name>``, in the order ``--help`` lists them
COMMANDS: tuple[Command, ...] = (Serve(), Start(), Status(), Stop(), Sample(), Demo(), Selftest(), Bench())


def add_commands(parser: argparse.ArgumentParser, dest: str, commands: tuple[Command, ...]) -> None:
    """One subparser per command, its name under ``dest`` (one must be given)."""
    subparsers = parser.add_subparsers(dest=dest, required=True)
    for command in commands:
        command.add_arguments(subparsers.add_parser(command.name, help=command.help))


def named(commands: tuple[Command, ...], name: str) -> Command:
    return next(command for command in commands if command.name == name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xdit-backend", description="Multi-process parallel DiT sampling backend")
    add_commands(parser, "command", COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command's exit code: 2 for a mistake in what was asked (a UsageError, argparse's code for its own: a flag,
    a file, a launch option this machine cannot run or a running backend was not started with), 1 when the backend
    refused or failed a request, or could not be started, 130 on Ctrl-C; a message, never a traceback, for each."""
    args = build_parser().parse_args(argv)
    try:
        return named(COMMANDS, args.command).run(args)
    except UsageError as exc:
        print(f"xdit-backend: {exc}", file=sys.stderr)
        return 2
    except (BackendError, LaunchError, paths.UnsafeDirectoryError) as exc:
        print(f"xdit-backend: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`status --json | head`): the rest is not wanted
        quiet_stdout()
        return 0


def quiet_stdout() -> None:
    """stdout onto /dev/null, so the interpreter's flush at exit does not raise on the closed pipe again."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
