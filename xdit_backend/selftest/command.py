"""``xdit-backend selftest``: its flags and the call it makes, in the shape cli.py's table takes.

Apart from runner.py, which imports torch at the top: the suite is imported only when it runs, so
``--help`` loads none of it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


class Selftest:
    name = "selftest"
    help = ("the GPU smoke suite: PASS/FAIL per section with its figures (skips without CUDA); the first thing to "
            "run on a GPU machine")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", type=Path, default=Path("selftest-out"), help="folder for selftest.json")
        parser.add_argument("--only", nargs="+", default=(), metavar="SECTION", help="run only these sections")
        parser.add_argument("--cpu", action="store_true",
                            help="a dry run on the CPU: the sections that can run there, at the smallest sizes")
        parser.add_argument("--budget-s", type=float, default=None, metavar="SECONDS",
                            help="start no section whose planned time is more than what is left of these seconds "
                                 "(a call with a time limit: it ends with its figures written, and names the "
                                 "sections left for the next call)")

    def run(self, args: argparse.Namespace) -> int:
        from .runner import run_selftest

        return run_selftest(args.out, tuple(args.only), args.cpu, args.budget_s)
