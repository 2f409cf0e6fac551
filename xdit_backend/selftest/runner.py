"""Run the selftest's sections in order; print PASS / FAIL / SKIP per section with its figures.

A section is a function ``section(ctx, checks)``: it records figures and states expectations on
``checks``; raising ``Skip`` skips it with a reason; any other exception fails it, with the error.
Every section's figures, the verdicts and the environment go to ``OUT/selftest.json``.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
import traceback
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# (name, module, function), in the order they run: cheap and basic first, so a broken install fails fast
SECTIONS = (
    ("environment", "kernels", "environment"),
    ("attention", "kernels", "attention_kernels"),
    ("ring", "kernels", "ring"),
    ("families", "models", "families"),
    ("samplers", "models", "samplers"),
    ("syncs", "models", "syncs"),
    ("lora", "models", "lora"),
    ("storage", "storage", "storage"),
    ("memory", "memory", "memory"),
    ("nccl", "nccl", "nccl"),
    ("ranks", "ranks", "ranks"),
    ("backend", "service", "backend"),
    ("fault", "service", "fault"),
    ("compile", "scale", "compiled"),
    ("shares", "scale", "shares"),
    ("full-size", "scale", "full_size"),
    ("step-cache", "service", "step_cache"),
    ("demo", "service", "demo"),
)
NAMES = tuple(name for name, _, _ in SECTIONS)


class Skip(Exception):
    """A section that cannot run here; the message says why."""


@dataclass
class Context:
    device: torch.device
    out: Path
    quick: bool  # the CPU dry run: the smallest sizes, so the test suite can afford it
    shared: dict = field(default_factory=dict)  # what sections share (service.world_one's backend), by name
    held: ExitStack = field(default_factory=ExitStack)  # releases what they share when the selftest ends


@dataclass
class Checks:
    """What one section measured and what it expected; a failed expectation fails the section."""

    figures: dict = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def record(self, **figures) -> None:
        self.figures.update(figures)

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failed.append(what)
        return ok


@dataclass
class Result:
    section: str
    verdict: str  # PASS, FAIL or SKIP
    seconds: float
    figures: dict
    reason: str = ""


def run_section(name: str, ctx: Context) -> Result:
    module, function = next((m, f) for n, m, f in SECTIONS if n == name)
    section = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    checks, started = Checks(), time.perf_counter()
    try:
        section(ctx, checks)
        verdict, reason = ("FAIL", "; ".join(checks.failed)) if checks.failed else ("PASS", "")
    except Skip as exc:
        verdict, reason = "SKIP", str(exc)
    except Exception as exc:  # the section's own failure: report it and go on with the next one
        verdict, reason = "FAIL", f"{type(exc).__name__}: {exc}"
        checks.record(traceback=traceback.format_exc()[-3000:])
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return Result(name, verdict, time.perf_counter() - started, checks.figures, reason)


def _line(result: Result) -> str:
    shown = {k: v for k, v in result.figures.items() if k != "traceback" and not isinstance(v, (dict, list))}
    figures = ", ".join(f"{k}={_short(v)}" for k, v in shown.items())
    why = f" — {result.reason}" if result.reason else ""
    return f"{result.verdict:4}  {result.section:<11} {result.seconds:6.1f} s{why}" + (f"\n      {figures}" if figures else "")


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def no_cuda_reason() -> str | None:
    """Why the GPU suite cannot run here, or None when it can."""
    if torch.cuda.is_available():
        return None
    if not torch.version.cuda:
        return f"no CUDA device: torch {torch.__version__} is a CPU build"
    return f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"


def run_selftest(out: Path, only: tuple[str, ...] = (), cpu: bool = False) -> int:
    """Every section (or ``only`` those) on cuda:0, or with ``cpu`` on the CPU; 1 if any section failed."""
    reason = no_cuda_reason()
    if reason and not cpu:
        print(f"SKIP  selftest — {reason}; run it on a GPU machine "
              "(or `xdit-backend selftest --cpu` for a dry run of the sections that run on the CPU)")
        return 0
    unknown = sorted(set(only) - set(NAMES))
    if unknown:
        print(f"unknown section(s) {', '.join(unknown)}; the sections are: {', '.join(NAMES)}", file=sys.stderr)
        return 2
    ctx = Context(torch.device("cpu") if cpu else torch.device("cuda", 0), out, quick=cpu)
    out.mkdir(parents=True, exist_ok=True)
    print(f"xDiT selftest on {ctx.device}{' (dry run)' if cpu else ''}; figures in {out / 'selftest.json'}", flush=True)
    results, started = [], time.perf_counter()
    with ctx.held:
        for name in NAMES:
            if only and name not in only:
                continue
            results.append(run_section(name, ctx))
            print(_line(results[-1]), flush=True)
            (out / "selftest.json").write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    failed = [r.section for r in results if r.verdict == "FAIL"]
    print(f"\n{len(results) - len(failed)} of {len(results)} sections did not fail "
          f"({time.perf_counter() - started:.0f} s){'; FAILED: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0
