"""The selftest's memory section: the written memory model against the CUDA allocator's count, and
a LoRA's patches on one resident base (issue 14).

- flux-dev-two-blocks (Flux.1-dev's width, 545 M parameters; flux-tiny in the CPU dry run) computing
  in bf16, its weights in bf16 and in fp8 (weight_dtype fp8_e4m3fn), one request at two sizes: the
  memory model's bytes for it (``memory_fit.needed``, what the model cache's fit check asks) against
  the peak while the request runs (``torch.cuda.max_memory_allocated`` after a reset, less what was
  allocated before the model was loaded). Expected within ±25 %.
- a rank-8 LoRA on six attention projections of the first block, at two strengths on the same base: the
  allocated memory grows by at most the LoRA's tensors + 8 MiB (the base is never copied), and each
  strength's latent equals the base's with the LoRA merged into its weights (W + s·B·A).
On the CPU the allocator counts nothing: the predictions and the latents are checked, the bytes are
CUDA's only (recorded as such).
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..memory import fit as memory_fit
from ..models import registry
from ..models.lora import LoraFiles, LoraSpec
from ..models.resolved import resolve_model
from ..service.request import SampleRequest
from ..wire.protocol import Message
from .models import distance, generation
from .runner import Checks, Context

BF16 = torch.bfloat16
BAND = 0.25  # |measured / predicted − 1| for a request's peak
LORA_SLACK = 8 * 2**20  # bytes beyond the LoRA's own tensors a patched request may leave allocated
LORA_TOLERANCE = 1e-2  # relative L2 of the patched latent from the merged one (both bf16: the merge rounds)
STRENGTHS = (0.5, 1.0)


def allocated(device: torch.device) -> int | None:
    """Bytes the CUDA allocator has handed out after collecting the garbage; None on the CPU."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _model_and_sizes(ctx: Context) -> tuple[str, tuple[int, ...]]:
    return ("flux-tiny", (64, 128)) if ctx.quick else ("flux-dev-two-blocks", (1024, 2048))


def memory(ctx: Context, checks: Checks) -> None:
    name, sides = _model_and_sizes(ctx)
    checks.record(model=name, bytes_measured="CUDA allocator" if ctx.device.type == "cuda" else
                  "none: the CPU has no allocator count, predictions only")
    for weight_dtype in ("default", "fp8_e4m3fn"):
        before = allocated(ctx.device)
        model = registry.build(name, ctx.device, BF16, weight_dtype=weight_dtype)
        for side in sides:
            _request_peak(ctx, checks, model, weight_dtype, side, before)
        if weight_dtype == "default":
            _lora_patches(ctx, checks, model, sides[0])
        del model


def _request(side: int) -> dict:
    return {"width": side, "height": side, "steps": 2, "seed": 3, "cfg": 1.0}


def _request_peak(ctx: Context, checks: Checks, model, weight_dtype: str, side: int, before: int | None) -> None:
    """One request on the loaded ``model``: its peak from ``before`` (allocated before the model was
    loaded: the weights are in it) against the memory model's bytes for the model and the request."""
    name, label, request = model.name, f"{'bf16' if weight_dtype == 'default' else 'fp8'}_{side}", _request(side)
    parsed = SampleRequest.parse(Message("sample", {**request, "model": name}))
    tokens, rows = memory_fit.request_shape(parsed, registry.spec(name), registry.resolve_builtin(name).text_tokens)
    predicted = memory_fit.needed(resolve_model(name), BF16, weight_dtype, 1, None, tokens, rows)  # as the fit check
    checks.record(**{f"{label}_predicted_mib": predicted.total / 2**20,
                     f"{label}_predicted_weights_mib": predicted.weights / 2**20,
                     f"{label}_predicted_activations_mib": (predicted.activations + predicted.workspace) / 2**20})
    if before is not None:
        checks.record(**{f"{label}_loaded_mib": (allocated(ctx.device) - before) / 2**20})
        torch.cuda.reset_peak_memory_stats(ctx.device)
    latent = generation(model, name, request)
    checks.expect(bool(torch.isfinite(latent).all()), f"{label}: the latent is not finite")
    if before is None:
        return
    measured = torch.cuda.max_memory_allocated(ctx.device) - before
    ratio = measured / predicted.total
    checks.record(**{f"{label}_peak_mib": measured / 2**20, f"{label}_peak_over_predicted": ratio})
    checks.expect(abs(ratio - 1) <= BAND, f"{label}: the request's peak {measured / 2**20:.0f} MiB is {ratio:.2f}× "
                                          f"the memory model's {predicted.total / 2**20:.0f} MiB (band ±{BAND:.0%})")


def _lora_file(model, path: Path, rank: int = 8) -> dict[str, torch.Tensor]:
    """A PEFT LoRA on block 0's attention projections (random, each B·A about the size of its W's
    product: it moves the latent well beyond bf16's rounding of the merge); returns each target
    module's delta B·A [out, in], float32, on the CPU."""
    g = torch.Generator().manual_seed(21)
    attn = model.transformer.transformer_blocks[0].attn
    tensors, deltas = {}, {}
    for leaf in ("to_q", "to_k", "to_v", "to_out.0", "add_v_proj", "to_add_out"):
        linear = attn.get_submodule(leaf)
        down = torch.randn(rank, linear.in_features, generator=g) / linear.in_features ** 0.5  # A [r, in]
        up = torch.randn(linear.out_features, rank, generator=g) / rank ** 0.5  # B [out, r]
        key = f"transformer.transformer_blocks.0.attn.{leaf}"
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = down, up
        deltas[f"transformer_blocks.0.attn.{leaf}"] = up @ down
    save_file(tensors, str(path))
    return deltas


def _lora_patches(ctx: Context, checks: Checks, model, side: int) -> None:
    """The LoRA at each strength as patches on ``model`` (memory measured), then, patches off, merged
    into its weights for the reference, which are put back after."""
    name, request, files = model.name, _request(side), LoraFiles(ctx.device)
    plain = generation(model, name, request)
    with tempfile.TemporaryDirectory(prefix="xdit-selftest-") as tmp:
        path = Path(tmp) / "lora.safetensors"
        deltas = _lora_file(model, path)
        weights = {module: model.transformer.get_submodule(module).weight for module in deltas}
        originals = {module: weight.detach().to("cpu", copy=True) for module, weight in weights.items()}
        before = allocated(ctx.device)
        for strength in STRENGTHS:
            model.patches.carry([LoraSpec(str(path), strength)], files)
            patched = generation(model, name, request)
            grown = None if before is None else allocated(ctx.device) - before
            model.patches.detach()
            untouched = all(torch.equal(weight.cpu(), originals[module]) for module, weight in weights.items())
            checks.expect(untouched, f"strength {strength:g}: the patches changed the base's weights")
            with torch.no_grad():
                for module, weight in weights.items():
                    weight.copy_(originals[module].float() + strength * deltas[module])
                merged = generation(model, name, request)
                for module, weight in weights.items():
                    weight.copy_(originals[module])
            _, rel = distance(patched, merged)
            _, moved = distance(patched, plain)
            label = f"lora_{strength:g}"
            checks.record(**{f"{label}_vs_merged_rel": rel, f"{label}_vs_base_rel": moved})
            checks.expect(rel <= LORA_TOLERANCE, f"{label}: patched {rel:.2e} from merged (≤ {LORA_TOLERANCE:g})")
            checks.expect(moved >= 5 * rel, f"{label}: the LoRA moved the latent {moved:.2e}, not well beyond "
                                            f"the patched-to-merged difference {rel:.2e}")
            if grown is not None:
                limit = files.nbytes() + LORA_SLACK
                checks.record(**{f"{label}_allocated_growth_mib": grown / 2**20, "lora_mib": files.nbytes() / 2**20})
                checks.expect(grown <= limit, f"{label}: {grown / 2**20:.1f} MiB more allocated with the LoRA "
                                              f"(≤ its {files.nbytes() / 2**20:.2f} MiB + {LORA_SLACK / 2**20:.0f})")
