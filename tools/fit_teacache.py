"""Fit a family's teacache polynomial (CachePlan.teacache) from uncached generations.

For each step t > 0 of an uncached run: x = the relative change of the first cached block's time
embedding (CachePlan.probe) since step t − 1, y = the relative change of the model's raw output,
Σ|out_t − out_{t−1}| / Σ|out_{t−1}|, both over the positive side's rows, as the cache measures them.
teacache adds up poly(x) and computes a step when the sum reaches its threshold: poly(x) estimates
how far the output has moved. The fit is numpy.polyfit(x, y, degree) over every step of every seed.

    python tools/fit_teacache.py --model flux-tiny --width 512 --height 512 --steps 28 --seeds 0 1 2

A model file works the same way (--model PATH): the coefficients of a trained model are what the
family's TEACACHE should hold; the built-ins have random weights (docs/step-cache.md).
"""

from __future__ import annotations

import argparse
import json

import numpy
import torch

from xdit_backend.models import registry
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.parallel.step_cache import BlockStreams, flat_probe
from xdit_backend.sampling.generate import generate
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message


def relative_change(now: torch.Tensor, before: torch.Tensor) -> float:
    return ((now - before).abs().sum() / before.abs().sum()).item()


def pairs(model, fields: dict, seed: int) -> list[tuple[float, float]]:
    """(probe change, output change) of every step after the first of one uncached generation."""
    request = SampleRequest.parse(Message("sample", {**fields, "seed": seed}, {}))
    spec = model.spec
    positive, negative = registry.random_conditioning(request.model, request.batch, seed, spec) \
        if request.model in registry.BUILTINS else (None, None)
    if positive is None:
        raise SystemExit("a model file needs its text embeddings: use a built-in, or extend this tool with --embeds")
    plan = spec.cache_plan
    head = getattr(model.transformer, plan.blocks[0])[0]
    signature = BlockStreams(head, plan, plan.returns[plan.blocks[0]])
    probes, outputs = [], []
    hook = head.register_forward_pre_hook(
        lambda module, args, kwargs: probes.append(flat_probe(signature.argument(plan.probe, args, kwargs))[:1]),
        with_kwargs=True)
    output = model.output

    def recorded(x, timestep, cond, guidance):
        out = output(x, timestep, cond, guidance)
        outputs.append(out[:1].float())  # the positive side's row (batch 1, cfg 1: the only row)
        return out

    model.output = recorded
    try:
        with torch.no_grad():
            generate(Denoiser(model), request.generation(spec, positive, negative))
    finally:
        hook.remove()
        del model.output
    return [(relative_change(probes[t], probes[t - 1]), relative_change(outputs[t], outputs[t - 1]))
            for t in range(1, len(outputs))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--height", type=int, default=512)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--steps", type=int, default=28)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--degree", type=int, default=2)
    args = parser.parse_args(argv)
    fields = {"model": args.model, "width": args.width, "height": args.height, "frames": args.frames,
              "steps": args.steps, "cfg": 1.0, "batch": 1}
    model = registry.build(args.model, torch.device("cpu"))
    data = [pair for seed in args.seeds for pair in pairs(model, fields, seed)]
    x, y = numpy.array(data).T
    coefficients = numpy.polyfit(x, y, args.degree)
    residual = y - numpy.polyval(coefficients, x)
    print(json.dumps({"model": args.model, "fields": fields, "seeds": args.seeds, "points": len(x),
                      "x_range": [float(x.min()), float(x.max())], "y_range": [float(y.min()), float(y.max())],
                      "coefficients": [float(c) for c in coefficients],
                      "rms_residual": float(numpy.sqrt((residual ** 2).mean())),
                      "y_rms": float(numpy.sqrt((y ** 2).mean()))}, indent=1))


if __name__ == "__main__":
    main()
