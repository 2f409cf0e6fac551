"""The selftest's several ranks on one device (review gpu-paths-2 C.3): backends of 2 and 4 ranks that all compute
on the selftest's device, in distributed/one_device.py's test mode (gloo through host memory, since NCCL refuses
two ranks on one GPU), run every layout and are compared with serial on the same device. On a GPU this runs each
layout's CUDA kernels at their shard shapes (attention on a share of the heads or keys, FSDP2's gathered blocks,
PipeFusion's patches); the dry run on the CPU runs the test mode's own code."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch

from ..bench.layouts import parse_layout
from ..client import BackendError, Client
from ..distributed import one_device
from ..launch import launcher
from ..launch.options import LaunchOptions
from ..launch.worker_env import FAULT_ENV
from ..memory.fit import TEST_BUDGET_ENV
from ..models import registry
from .models import distance, fields, generation
from .runner import Checks, Context

LAYOUTS = {2: ("ulysses=2", "ring=2", "cfg=2", "pipefusion=2", "dp=2", "ulysses=2,shard"),
           4: ("ulysses=2,ring=2", "cfg=2,ulysses=2", "pipefusion=2,ulysses=2", "ring=4,shard")}
QUICK_LAYOUTS = {2: ("ulysses=2", "ring=2", "pipefusion=2")}  # the dry run: all-to-all, the ring's and the links' P2P
MODELS = ("flux-tiny", "wan-ti2v-tiny", "flux-kontext-tiny")  # plain; video with per-token timesteps; references
# controls on Qwen-Image: a model patch (DiffSynth's ControlNet, per token: each rank, and each PipeFusion chunk,
# controls its own tokens) in every layout, and a ControlNet (its own transformer, split as the model's) in every
# layout but PipeFusion's (refused with one), in float32; in bf16 under each world's first layout only (the dtype's
# rounding does not depend on the layout, which float32 checks to 1e-4; the section must stay within one device
# call): (model, request fields, whether it runs under PipeFusion)
CONTROLLED = (("qwen-image-tiny", {"controls": [{"path": "qwen-image-diffsynth-tiny", "strength": 0.8}]}, True),
              ("qwen-image-tiny", {"controls": [{"path": "qwen-image-controlnet-tiny", "strength": 0.7}]}, False))
# more controls, on the GPU under each world's first layout only (the section must stay within one device call):
# a Flux union ControlNet (its type token cut with the text), Wan VACE (its control video drawn from the seed) and
# Z-Image's Fun ControlNet (run between the model's blocks, its tokens cut as the image's real tokens)
CONTROLLED_ONCE = (("flux-tiny", {"controls": [{"path": "flux-controlnet-tiny", "strength": 0.7, "type": 3}]}),
                   ("wan-vace-tiny", {}),
                   ("z-image-tiny", {"controls": [{"path": "z-image-fun-controlnet-tiny", "strength": 0.7}]}))
# Flux.1-dev's width (24 heads of 128) at 1024² in bf16: the kernels at the shard shapes of a real generation
# (4608 tokens; Ulysses 12 or 6 heads a rank, Ring chunks of 2304 or 1152 keys)
FULL_WIDTH = ("flux-dev-two-blocks", 1024, {2: ("ulysses=2", "ring=2", "ulysses=2,shard"),
                                            4: ("ulysses=4", "ulysses=2,ring=2", "ring=4")})
BUDGET = 8 * 2**30  # bytes the fit check gives each rank: they share one device, and each sees all its free memory
FLOAT32_TOLERANCE = 1e-4  # max |layout − serial| / max(1, max |serial|)
BF16_TOLERANCE = 5e-2  # relative L2: other kernels' shapes (a share of the heads or keys) round otherwise


def _backend(stack: ExitStack, ctx: Context, world: int) -> tuple[Client, Path]:
    """A backend of ``world`` ranks on the selftest's device, stopped when ``stack`` closes, and its fault file
    ("RANK:N" written there fails that rank's N-th model call of the next request, FAULT_ENV)."""
    folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="xdit-selftest-")))
    options = LaunchOptions(socket=folder / "backend.sock", nproc=world, device=ctx.device.type,
                            collective_timeout=60.0, topology_probe="off")
    launcher.start(options, environment={one_device.ENV: "1", TEST_BUDGET_ENV: str(BUDGET),
                                         FAULT_ENV: str(folder / "fault")})
    stack.callback(launcher.stop, options.socket)  # before the folder goes: the stack unwinds in reverse
    return Client(options.socket), folder / "fault"


def _fault(client: Client, fault: Path, request: dict, reference: torch.Tensor, checks: Checks) -> None:
    """Rank 1 fails mid-request under ulysses=2 (a simulated out-of-memory): every rank agrees on the failure, the
    request fails as out_of_memory, and the same backend's next request equals serial again."""
    fault.write_text("1:3")
    try:
        client.sample({**request, "parallel": {"ulysses": 2}})
        checks.expect(False, "the request with rank 1's injected fault did not fail")
    except BackendError as exc:
        checks.record(fault_error_kind=exc.kind)
        checks.expect(exc.kind == "out_of_memory", f"rank 1's fault failed the request as {exc.kind}, "
                                                   "not out_of_memory")
    result, _ = client.sample({**request, "parallel": {"ulysses": 2}})
    after = distance(result["samples"].float(), reference)[0]
    checks.record(after_fault_max=after)
    checks.expect(after <= FLOAT32_TOLERANCE, f"the request after the fault: {after:.2e} from serial")


def ranks(ctx: Context, checks: Checks) -> None:
    """Each layout's latent against serial's on the same device: within float32 rounding (bf16: the kernels'
    rounding at other shapes); PipeFusion, whose patches attend to stale K/V, within a tenth of the distance
    between two seeds' serial latents, as tests/backend/test_pipefusion.py holds it on the CPU. Then a rank's
    failure on the 2-rank backend (``_fault``)."""
    serial: dict[tuple, torch.Tensor] = {}

    def serial_latent(name: str, dtype: torch.dtype, request: dict) -> torch.Tensor:
        key = (name, dtype, request["width"], request["batch"], request["seed"], str(request.get("controls")))
        if key not in serial:
            serial[key] = generation(registry.build(name, ctx.device, dtype), name, request)
        return serial[key]

    for world, runs in _plan(ctx).items():
        with ExitStack() as stack:
            client, fault = _backend(stack, ctx, world)
            for name, dtype, size, layout, extra in runs:
                dtype_name = str(dtype).removeprefix("torch.")
                degrees = parse_layout(layout)
                request = fields(name, ctx, dtype=dtype_name, batch=degrees.get("dp", 1), width=size, height=size,
                                 **extra)
                reference = serial_latent(name, dtype, request)
                result, _ = client.sample({**request, "parallel": degrees})
                scaled, relative = distance(result["samples"].float(), reference)
                label = f"{name}{'+' + extra['controls'][0]['path'] if extra else ''}_{dtype_name}_{layout}"
                if "pipefusion" in degrees:
                    seeds = distance(serial_latent(name, dtype, {**request, "seed": request["seed"] + 1}), reference)[1]
                    checks.record(**{f"{label}_rel": relative, f"{label}_seeds_rel": seeds})
                    checks.expect(0 < relative < 0.1 * seeds, f"{label}: relative {relative:.2e} from serial, two "
                                                              f"seeds {seeds:.2e} apart (stale K/V: above 0, under a "
                                                              "tenth of that)")
                elif dtype == torch.float32:
                    checks.record(**{f"{label}_max": scaled})
                    checks.expect(scaled <= FLOAT32_TOLERANCE, f"{label}: {scaled:.2e} from serial "
                                                               f"(≤ {FLOAT32_TOLERANCE:g})")
                else:
                    checks.record(**{f"{label}_rel": relative})
                    checks.expect(relative < BF16_TOLERANCE, f"{label}: relative {relative:.2e} from serial "
                                                             f"(< {BF16_TOLERANCE:g})")
            if world == 2:
                name = runs[0][0]
                request = fields(name, ctx, dtype="float32", batch=1)
                _fault(client, fault, request, serial_latent(name, torch.float32, request), checks)


def _plan(ctx: Context) -> dict[int, list[tuple]]:
    """(model, dtype, side, layout, more request fields) of every run, by world size: the dry run's few (a control
    among them), or the GPU's all."""
    once = [(controlled, control) for controlled, control, _ in CONTROLLED] + list(CONTROLLED_ONCE)
    if ctx.quick:
        return {world: [("flux-tiny", torch.float32, 64, layout, {}) for layout in layouts]
                + [(controlled, torch.float32, 64, layouts[0], control) for controlled, control in once]
                for world, layouts in QUICK_LAYOUTS.items()}
    name, side, wide = FULL_WIDTH
    both = (torch.float32, torch.bfloat16)
    return {world: [(model, dtype, 128, layout, {}) for model in MODELS for dtype in both for layout in layouts]
            + [(controlled, torch.float32, 128, layout, control) for controlled, control, pipefusion in CONTROLLED
               for layout in layouts if pipefusion or "pipefusion" not in layout]
            + [(controlled, torch.bfloat16, 128, layouts[0], control) for controlled, control, _ in CONTROLLED]
            + [(controlled, dtype, 128, layouts[0], control) for controlled, control in CONTROLLED_ONCE
               for dtype in both]
            + [(name, torch.bfloat16, side, layout, {}) for layout in wide[world]]
            for world, layouts in LAYOUTS.items()}
