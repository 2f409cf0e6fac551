"""LaunchOptions owns its command line: one declaration gives the CLI's flags, the argv the launcher
passes on, and the worker's parser, with one set of defaults."""

import argparse
import dataclasses
from pathlib import Path

from xdit_backend import cli
from xdit_backend.launch.options import LaunchOptions
from xdit_backend.service import worker

# every option away from its default (paths absolute, as from_args makes them)
EVERY = LaunchOptions(socket=Path("/tmp/xdit-opts/b.sock"), nproc=3, device="cpu", gpus=(0, 2, 5),
                      collective_timeout=123.25, heartbeat=7.5, max_payload_mb=77,
                      model_roots=("/tmp/xdit-opts/a", "/tmp/xdit-opts/b"), tcp="127.0.0.1:8765",
                      token_file="/tmp/xdit-opts/token", nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400",
                      topology_probe="off", idle_unload=90.5, idle_stop=3600.0)


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def test_every_option_differs_from_its_default():
    """The fixture really sets every field (a new option must be added to it)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchOptions)}
    assert [name for name, value in dataclasses.asdict(EVERY).items() if value == defaults[name]] == []


def test_argv_round_trips_through_the_cli_and_the_worker():
    """to_argv → the serve/start/sample parsers and the worker's parser → the same options."""
    argv = EVERY.to_argv()
    for command in ("serve", "start", "sample"):
        args = subcommand(command).parse_args([*argv, *(["--model", "m", "--out", "o"] if command == "sample" else [])])
        assert LaunchOptions.from_args(args) == EVERY, command
    assert worker.parse_args(argv) == EVERY


def test_absent_flags_take_the_dataclass_defaults():
    """The CLI and the worker have no defaults of their own: no flag means the field's default."""
    expected = LaunchOptions(socket=Path("/tmp/xdit-opts/b.sock"))
    assert LaunchOptions.from_args(subcommand("serve").parse_args(["--socket", "/tmp/xdit-opts/b.sock"])) == expected
    assert worker.parse_args(["--socket", "/tmp/xdit-opts/b.sock"]) == expected
    assert expected.to_argv() == ["--socket", "/tmp/xdit-opts/b.sock", "--collective-timeout", "600.0",
                                  "--heartbeat", "30.0", "--max-payload-mb", "1024", "--nnodes", "1",
                                  "--node-rank", "0", "--topology-probe", "on", "--idle-unload", "0.0",
                                  "--idle-stop", "0.0"]


def test_help_shows_the_declared_defaults():
    text = subcommand("serve").format_help()
    assert "(default 600)" in text and "(default 30)" in text and "(default 1024)" in text


def test_resolved_names_the_token_file_the_ranks_read():
    """With --tcp, resolved() fixes the token file (<socket>.token unless given), so every reader agrees."""
    options = LaunchOptions(socket=Path("/tmp/xdit-opts/b.sock"), nproc=1, device="cpu", tcp="127.0.0.1:1")
    assert options.resolved().token_file == "/tmp/xdit-opts/b.sock.token"
    assert LaunchOptions(socket=Path("/tmp/xdit-opts/b.sock"), nproc=1, device="cpu").resolved().token_file is None
