"""The selftest's storage section: weights kept in their storage precision on the device (issue 14).

A built-in Flux (flux-tiny; on a GPU also flux-dev-two-blocks, Flux.1-dev's width, 545 M parameters)
is written as an fp8 file, a ComfyUI scaled-fp8 file (one float32 ``scale_weight`` per matrix, the
``scaled_fp8`` marker), a GGUF Q8_0 file and a GGUF Q4_K file (random blocks: the gguf package cannot quantize
K-quants), and a bf16 file is loaded with weight_dtype fp8_e4m3fn (against the model with every tensor rounded
through fp8, as ComfyUI's UNETLoader builds it);
each is loaded on the device computing in bf16, and:
- it holds the bytes the fit check counts for it (``memory_fit.needed``'s resident weights): its
  parameters and buffers, and on CUDA the allocated-memory delta of the load;
- its latent equals that of the bf16 model given the dequantised weights (dequantised here on the
  CPU from the written values: float8 × scale, the gguf package's own dequantisation), relative
  L2 ≤ 1e-2 (both compute in bf16);
- its step time against bf16's, the per-layer upcast's cost (StepClock, median of the later steps).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..memory import fit as memory_fit
from ..models import registry
from ..models.resolved import resolve_model
from ..models.storage import rounded_to
from ..service.model_cache import resident_bytes
from ..service.step_clock import StepClock
from .files import BF16, FILES, FP8, family_table, original_layout
from .memory import allocated
from .models import distance, generation
from .runner import Checks, Context

LATENT_TOLERANCE = 1e-2  # relative L2, bf16 against bf16 on the same dequantised weights (scaled: re-rounded)
TENSOR_ROUNDING = 512  # bytes: the CUDA caching allocator rounds every tensor up to a multiple of this


def storage(ctx: Context, checks: Checks) -> None:
    for name in ("flux-tiny",) if ctx.quick else ("flux-tiny", "flux-dev-two-blocks"):
        side = 64 if ctx.quick else (1024 if name == "flux-dev-two-blocks" else 128)
        with tempfile.TemporaryDirectory(prefix="xdit-selftest-") as tmp:
            _storage_of(name, ctx, checks, Path(tmp), {"width": side, "height": side, "steps": 4, "seed": 5,
                                                       "cfg": 1.0})


def _load(ctx: Context, checks: Checks, label: str, ref: str, weight_dtype: str = "default"):
    """Build ``ref`` on the device in bf16; the bytes its parameters and buffers hold and (CUDA) the
    allocated delta of the load, each against the fit check's count (slack: 2 %, and the allocator's
    rounding of each tensor, a 0-dim scale's 4 bytes taking 512)."""
    before = allocated(ctx.device)
    model = registry.build(ref, ctx.device, BF16, weight_dtype=weight_dtype)
    counted = memory_fit.needed(resolve_model(ref), BF16, weight_dtype, 1, None, 0, 1).weights_resident
    held = resident_bytes(model)
    tensors = sum(1 for _ in model.transformer.parameters()) + sum(1 for _ in model.transformer.buffers())
    slack = 0.02 * counted + TENSOR_ROUNDING * tensors
    checks.record(**{f"{label}_storage": model.storage_dtype, f"{label}_counted_mib": counted / 2**20,
                     f"{label}_held_mib": held / 2**20})
    measured = {"held by its tensors": held}
    if before is not None:
        measured["allocated by the load"] = allocated(ctx.device) - before
        checks.record(**{f"{label}_allocated_mib": measured["allocated by the load"] / 2**20})
    for what, size in measured.items():
        checks.expect(abs(size - counted) <= slack, f"{label}: {size / 2**20:.2f} MiB {what}, the fit check counts "
                                                    f"{counted / 2**20:.2f} MiB (± {slack / 2**20:.2f})")
    return model


def _timed_latent(ctx: Context, model, name: str, request: dict) -> tuple[torch.Tensor, float]:
    """A generation's latent and the median of its steps after the first (StepClock: the device's clock)."""
    clock = StepClock(ctx.device)
    latent = generation(model, name, request, lambda done, steps: clock.mark() or True)  # marks each step's end
    return latent, statistics.median(clock.steps())


def _storage_of(name: str, ctx: Context, checks: Checks, tmp: Path, request: dict) -> None:
    base = _load(ctx, checks, f"{name}_bf16", name)
    state = {key: value.cpu().float() for key, value in base.transformer.state_dict().items()}  # what the files hold
    table = family_table(name, state.keys())
    original = original_layout(state, table)
    del state
    _, base_s = _timed_latent(ctx, base, name, request)
    checks.record(**{f"{name}_bf16_step_ms": base_s * 1e3})
    for form, (write, suffix) in FILES.items():
        path = tmp / f"{name}-{form}.{suffix}"
        try:
            dequantised = write(original, path)
        except ImportError as exc:  # gguf: an optional extra
            checks.record(**{f"{name}_{form}_skipped": f"cannot write it here: {exc}"})
            continue
        base.transformer.load_state_dict({key: source.select(dequantised[source.key]) for key, source in table.items()})
        reference = generation(base, name, request)
        del dequantised
        _compare(ctx, checks, f"{name}_{form}", name, str(path), "default", reference, base_s, request)
        path.unlink()
        if form == "fp8":  # a bf16 file with weight_dtype fp8_e4m3fn: every tensor rounded through fp8, as ComfyUI
            path = tmp / f"{name}-bf16.safetensors"
            save_file({key: value.to(BF16) for key, value in original.items()}, str(path))
            rounded = {key: rounded_to(value.to(BF16), FP8).float() for key, value in original.items()}
            base.transformer.load_state_dict({key: source.select(rounded[source.key]) for key, source in table.items()})
            reference = generation(base, name, request)
            del rounded
            _compare(ctx, checks, f"{name}_weight_dtype_fp8", name, str(path), "fp8_e4m3fn", reference, base_s, request)
            path.unlink()


def _compare(ctx: Context, checks: Checks, label: str, name: str, ref: str, weight_dtype: str,
             reference: torch.Tensor, base_s: float, request: dict) -> None:
    model = _load(ctx, checks, label, ref, weight_dtype)
    latent, step_s = _timed_latent(ctx, model, name, request)
    del model
    _, rel = distance(latent, reference)
    checks.record(**{f"{label}_rel": rel, f"{label}_step_ms": step_s * 1e3, f"{label}_step_vs_bf16": step_s / base_s})
    checks.expect(rel <= LATENT_TOLERANCE, f"{label}: latent {rel:.2e} from the dequantised model's "
                                           f"(≤ {LATENT_TOLERANCE:g})")
