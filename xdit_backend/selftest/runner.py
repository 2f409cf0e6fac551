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


@dataclass(frozen=True)
class Section:
    name: str
    module: str  # in this package
    function: str
    gpu_s: float  # the time plan: its seconds on one H200 with torch 2.11 (docs/benchmarks.md, GPU figures)


# In the order they run: cheap and basic first, so a broken install fails fast; the measured ones last, so a run
# cut short by its budget loses figures already in docs/benchmarks.md. gpu_s: the slowest of three runs on an H200
# with torch 2.11, rounded up (seconds in the comments, in this order: the first whole run; a second machine, 10–50 %
# slower throughout; the first call that showed all 18 PASS; docs/benchmarks.md, GPU figures); compile's first
# graphs vary more and keep a margin. 472 s in all: one 10-minute call holds it.
SECTIONS = (
    Section("environment", "kernels", "environment", 1),  # 0.0 / 0.0 / 0.0
    Section("attention", "kernels", "attention_kernels", 24),  # 18.0 / 23.9 / 20.3
    Section("ring", "kernels", "ring", 2),  # 0.9 / 1.1 / 1.1
    Section("families", "models", "families", 23),  # 16.0 / 21.0 / 22.2
    Section("samplers", "models", "samplers", 2),  # 1.1 / 1.8 / 1.3
    Section("syncs", "models", "syncs", 1),  # 0.6 / 0.9 / 0.8
    Section("lora", "models", "lora", 1),  # 0.1 / 0.2 / 0.1
    Section("storage", "storage", "storage", 40),  # 30.2 / 40.0 / 35.3
    Section("memory", "memory", "memory", 15),  # 8.8 / 14.4 / 11.6
    Section("nccl", "nccl", "nccl", 50),  # 31.8 / 49.4 / 43.4
    Section("ranks", "ranks", "ranks", 130),  # 113.0 / 129.0 / 125.3
    Section("backend", "service", "backend", 26),  # 20.1 / 25.2 / 22.5
    Section("fault", "service", "fault", 1),  # 0.6 / 0.5 / 0.6
    Section("compile", "scale", "compiled", 30),  # 20.4 / 23.9 / 23.9
    Section("shares", "scale", "shares", 3),  # 2.5 / 3.0 / 2.5
    Section("full-size", "scale", "full_size", 46),  # 43.0 / 45.2 / 42.8
    Section("step-cache", "service", "step_cache", 49),  # 22.4 after shares drew the model / 48.2 alone / 22.5
    Section("demo", "service", "demo", 28),  # 22.0 / not started (that call's budget) / 27.7
)
NAMES = tuple(section.name for section in SECTIONS)


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
    planned_s: float = 0.0  # its Section.gpu_s, beside what it took, so the next GPU run can mend the plan
    cut: bool = False  # not started: its plan was more than what was left of the budget


def run_section(section: Section, ctx: Context) -> Result:
    run = getattr(importlib.import_module(f"{__package__}.{section.module}"), section.function)
    checks, started = Checks(), time.perf_counter()
    try:
        run(ctx, checks)
        verdict, reason = ("FAIL", "; ".join(checks.failed)) if checks.failed else ("PASS", "")
    except Skip as exc:
        verdict, reason = "SKIP", str(exc)
    except Exception as exc:  # the section's own failure: report it and go on with the next one
        verdict, reason = "FAIL", f"{type(exc).__name__}: {exc}"
        checks.record(traceback=traceback.format_exc()[-3000:])
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return Result(section.name, verdict, time.perf_counter() - started, checks.figures, reason, section.gpu_s)


def _line(result: Result) -> str:
    shown = {k: v for k, v in result.figures.items() if k != "traceback" and not isinstance(v, (dict, list))}
    figures = ", ".join(f"{k}={_short(v)}" for k, v in shown.items())
    why = f" — {result.reason}" if result.reason else ""
    took = f"{result.seconds:6.1f} s (plan {result.planned_s:.0f})"
    return f"{result.verdict:4}  {result.section:<11} {took}{why}" + (f"\n      {figures}" if figures else "")


def _short(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def no_cuda_reason() -> str | None:
    """Why the GPU suite cannot run here, or None when it can."""
    if torch.cuda.is_available():
        return None
    if not torch.version.cuda:
        return f"no CUDA device: torch {torch.__version__} is a CPU build"
    return f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"


def run_selftest(out: Path, only: tuple[str, ...] = (), cpu: bool = False, budget_s: float | None = None) -> int:
    """Every section (or ``only`` those) on cuda:0, or with ``cpu`` on the CPU; 1 if any section failed.

    With ``budget_s`` (seconds from the suite's first section), a section whose planned time (``Section.gpu_s``) is
    more than what is left of it is not started: it is listed as SKIP, and the summary gives the command that runs
    those left, so a call with a time limit ends with its figures written instead of being cut off in a section."""
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
    chosen = [section for section in SECTIONS if not only or section.name in only]
    out.mkdir(parents=True, exist_ok=True)
    print(f"xDiT selftest on {ctx.device}{' (dry run)' if cpu else ''}; figures in {out / 'selftest.json'}", flush=True)
    print(f"plan: {len(chosen)} sections, about {sum(s.gpu_s for s in chosen):.0f} s on an H200"
          + (f"; budget {budget_s:.0f} s" if budget_s is not None else ""), flush=True)
    results, started = [], time.perf_counter()
    with ctx.held:
        for section in chosen:
            left = None if budget_s is None else budget_s - (time.perf_counter() - started)
            if left is not None and section.gpu_s > left:
                results.append(Result(section.name, "SKIP", 0.0, {}, f"not started: planned {section.gpu_s:.0f} s, "
                                      f"{max(left, 0):.0f} s left of the {budget_s:.0f} s budget", section.gpu_s,
                                      cut=True))
            else:
                results.append(run_section(section, ctx))
            print(_line(results[-1]), flush=True)
            (out / "selftest.json").write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    failed = [r.section for r in results if r.verdict == "FAIL"]
    unstarted = [r.section for r in results if r.cut]
    print(f"\n{len(results) - len(failed)} of {len(results)} sections did not fail "
          f"({time.perf_counter() - started:.0f} s){'; FAILED: ' + ', '.join(failed) if failed else ''}")
    if unstarted:
        print(f"not started for the budget: {', '.join(unstarted)}; run them next: "
              f"xdit-backend selftest --only {' '.join(unstarted)}")
    return 1 if failed else 0
