"""The options a backend is launched with, declared once: each one's default, its command-line
flag and help, and the argv that carries the options on.

The CLI (``serve``, ``start``, ``sample``) adds the flags with ``add_arguments`` and reads them
with ``from_args``; the launcher passes ``to_argv()`` to ``xdit-backend serve`` (``start``) and to
every rank's ``python -m xdit_backend.service.worker``, whose parser is the same ``add_arguments``. A new
option is one field here. Light on purpose (no torch at import): the client and the ComfyUI nodes
import it.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import LaunchError, UsageError
from ..wire import paths
from .gpus import VISIBLE_ENV, available_gpus, chosen_gpus
from .idle import NODES_STOP_AFTER_S, NODES_UNLOAD_AFTER_S

LOOPBACK = ("127.0.0.1", "::1", "localhost")
CPU_RANKS = 2  # the ranks of a backend on the CPU when --nproc is not given

log = logging.getLogger("xdit_backend.launch")


def int_list(text: str) -> tuple[int, ...]:
    """"0,1,2" → (0, 1, 2): the command line's form of a list of GPU indices or block counts."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected whole numbers separated by commas, e.g. 0,1; got {text!r}") from None


def tcp_address(text: str) -> tuple[str, int]:
    """"127.0.0.1:8765" → ("127.0.0.1", 8765); "[::1]:8765" works too."""
    host, _, port = text.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise LaunchError(f"--tcp {text!r} is not HOST:PORT, e.g. --tcp 127.0.0.1:8765") from None


def _socket_help() -> str:
    return f"the backend's Unix socket (default: ${paths.SOCKET_ENV} or {paths.default_socket()})"


def _meta(help: str | Callable[[], str], *, flag: str = "", type=None, metavar: str | None = None,
          choices: tuple | None = None, repeat: bool = False) -> dict:
    return {"help": help, "flag": flag, "type": type, "metavar": metavar, "choices": choices, "repeat": repeat}


def option(default, help: str, **spelling):
    """A launch option: its default, and how the command line spells it (``--field-name`` unless
    ``flag`` says otherwise; ``repeat``: the flag may be given several times)."""
    return field(default=default, metadata=_meta(help, **spelling))


@dataclass(frozen=True)
class LaunchOptions:
    socket: Path = field(metadata=_meta(_socket_help, type=Path))  # required: no default
    nproc: int | None = option(None, "ranks (default: every GPU; 2 on the CPU)", type=int)
    device: str | None = option(None, "default: cuda when a GPU is visible", choices=("cpu", "cuda"))
    gpus: tuple[int, ...] | None = option(
        None, "GPU indices for the ranks, e.g. 0,1,2,3: nvidia-smi's numbers, or positions in $CUDA_VISIBLE_DEVICES "
              "when it is set (ComfyUI's --cuda-device N sets it)", type=int_list)
    collective_timeout: float = option(600.0, "seconds any collective may wait before the backend fails",
                                       type=float)
    heartbeat: float = option(30.0, "idle seconds between rank checks", type=float)
    max_payload_mb: int = option(1024, "largest request payload", type=int)
    # when given, model and LoRA paths must resolve inside one of them
    model_roots: tuple[str, ...] = option(
        (), "a folder model and LoRA files may come from (repeatable); with none given, any path the backend's "
            "user can read", flag="--model-root", metavar="DIR", repeat=True)
    # "127.0.0.1:PORT": also listen on loopback TCP, for clients holding the token
    tcp: str | None = option(None, "also listen on loopback TCP; clients must send the token first (see --token-file)",
                             metavar="127.0.0.1:PORT")
    # the TCP token (default: <socket>.token, written 0600 at start)
    token_file: str | None = option(None, "the TCP token (default: <socket>.token, created 0600 with a random token)",
                                    metavar="PATH")
    # machines; with more than one, every node runs its own launcher with the same endpoint
    nnodes: int = option(1, "machines; see the README's multi-node set-up", type=int)
    # this machine's place: node 0 holds global rank 0, hence the socket and the queue
    node_rank: int = option(0, "this machine's number; node 0 holds the socket", type=int)
    rdzv_endpoint: str | None = option(None, "node 0's address and a free port, the same on every node (needed "
                                             "when --nnodes > 1)", metavar="HOST:PORT")
    # "on": the links' figures kept for this machine, timed at the first start (topology.py); "again": timed anew;
    # "off": no figures (status shows none; auto keeps its fixed order)
    topology_probe: str = option("on", "time each pair of ranks' link and the compute rate, for status and "
                                       "--parallel auto: on (default) times them at the first start on this "
                                       "machine and reuses them after, so auto picks the same layout every start; "
                                       "again times them anew; off for multi-node or a faster start",
                                 choices=("on", "again", "off"))

    # seconds without a request before the models are unloaded / the backend stops (idle.py); 0: never
    idle_unload: float = option(0.0, "unload the models after this many seconds without a request; 0: never (a "
                                     f"backend the ComfyUI nodes start uses {NODES_UNLOAD_AFTER_S:g})",
                                type=float, metavar="S")
    idle_stop: float = option(0.0, "stop the backend after this many seconds without a request; 0: never (a "
                                   f"backend the ComfyUI nodes start uses {NODES_STOP_AFTER_S:g})",
                              type=float, metavar="S")

    # ------------------------------------------------------------------ the command line

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
        """Add a flag per option (or per option named in ``only``). Every flag defaults to None
        (absent), so ``from_args`` takes the defaults from the fields above, the one place they live."""
        for f in fields(cls):
            if only is not None and f.name not in only:
                continue
            meta = f.metadata
            help = meta["help"]() if callable(meta["help"]) else meta["help"]
            if isinstance(f.default, (int, float)):
                help += f" (default {f.default:g})"
            kwargs = {"dest": f.name, "default": None, "help": help}
            kwargs.update({k: meta[k] for k in ("type", "metavar", "choices") if meta[k] is not None})
            if meta["repeat"]:
                kwargs["action"] = "append"
            parser.add_argument(_flag(f), **kwargs)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> LaunchOptions:
        """The options the flags give (paths made absolute; absent flags take the defaults)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        values["socket"] = paths.resolve_socket(values.get("socket"))
        if "model_roots" in values:
            values["model_roots"] = tuple(str(Path(root).expanduser().resolve()) for root in values["model_roots"])
        if values.get("token_file"):
            values["token_file"] = str(Path(values["token_file"]).expanduser().resolve())
        return cls(**{**values, **overrides})

    def to_argv(self) -> list[str]:
        """These options as flags: ``from_args`` of them parsed gives these options back."""
        argv = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.metadata["repeat"]:
                argv += [arg for item in value for arg in (_flag(f), str(item))]
            else:
                argv += [_flag(f), _text(value)]
        return argv

    # ------------------------------------------------------------------ checks and the state file

    def resolved(self) -> LaunchOptions:
        """Fill in the device, the number of ranks and the token file from what this machine has."""
        gpu_count = cuda_device_count() if self.device != "cpu" else 0
        device = self.device or ("cuda" if gpu_count else "cpu")
        nproc = self.nproc
        if device == "cuda" and not gpu_count:
            raise UsageError(f"--device cuda, but this machine sees no CUDA device ({cuda_absence()})",
                             "use --device cpu (or leave --device out), or run on a machine with an NVIDIA GPU and "
                             "torch's CUDA build", node_hint="install torch's CUDA build in ComfyUI's Python (its "
                                                             "GPU build) on a machine with an NVIDIA GPU")
        if device == "cpu" and self.gpus:
            raise UsageError(f"--gpus {_text(self.gpus)} names GPUs, but the ranks run on the CPU"
                             f"{' (--device cpu)' if self.device else ' (no CUDA device here)'}",
                             "leave --gpus out (--nproc N sets the CPU ranks), or use --device cuda where GPUs are "
                             "visible", node_hint="clear the xDiT Parallel Config's gpus: the backend finds no GPU "
                                                  f"here and runs {self.nproc or CPU_RANKS} ranks on the CPU")
        if device == "cuda":  # the GPUs this process sees, counted as the ranks will (gpus.py)
            available = available_gpus(os.environ, gpu_count)
            if self.gpus:
                chosen_gpus(os.environ, self.gpus, len(available))  # refuses an index the list lacks
            elif VISIBLE_ENV in os.environ:
                log.warning("%s=%s in this environment (ComfyUI's --cuda-device sets it): the backend sees %d GPU(s), "
                            "%s; start without it to use every GPU", VISIBLE_ENV, os.environ[VISIBLE_ENV],
                            len(available), ",".join(available))
        if nproc is None:
            nproc = len(self.gpus) if self.gpus else (len(available) if device == "cuda" else CPU_RANKS)
        if self.gpus and len(self.gpus) != nproc:
            raise LaunchError(f"--gpus lists {len(self.gpus)} GPUs but --nproc is {nproc}; give one GPU per rank")
        if nproc < 1:
            raise LaunchError(f"--nproc must be at least 1, got {nproc}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise LaunchError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT (node 0's address, "
                              "the same on every node)")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} must lie in 0..{self.nnodes - 1} for --nnodes {self.nnodes}")
        token_file = self.token_file
        if self.tcp:
            host = tcp_address(self.tcp)[0]
            if host not in LOOPBACK:
                raise LaunchError(f"--tcp {self.tcp}: the backend listens on loopback only ({', '.join(LOOPBACK)}); "
                                  "reach it from other machines through an SSH tunnel, never an open port")
            token_file = token_file or str(paths.token_path(self.socket))
        if not 0 < self.heartbeat * 2 <= self.collective_timeout:
            raise LaunchError(f"--heartbeat {self.heartbeat:g} must be positive and at most half of "
                              f"--collective-timeout {self.collective_timeout:g}, so idle ranks never time out")
        for name in ("idle_unload", "idle_stop"):
            if getattr(self, name) < 0:
                raise LaunchError(f"--{name.replace('_', '-')} {getattr(self, name):g} must be 0 (never) or a number "
                                  "of seconds")
        return LaunchOptions(**{**asdict(self), "device": device, "nproc": nproc, "token_file": token_file})

    def to_json(self) -> dict:
        return {**asdict(self), "socket": str(self.socket), "gpus": list(self.gpus) if self.gpus else None,
                "model_roots": list(self.model_roots)}

    @classmethod
    def from_json(cls, data: dict) -> LaunchOptions:
        gpus = tuple(data["gpus"]) if data.get("gpus") else None
        return cls(**{**data, "socket": Path(data["socket"]), "gpus": gpus,
                      "model_roots": tuple(data.get("model_roots", ()))})


def _flag(f) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _text(value) -> str:
    """A value as its flag's text: a GPU list as 0,1; a float exactly (repr)."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_absence() -> str:
    """Why torch sees no GPU here, for a message: a CPU build, or a CUDA build without a usable device."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but finds no usable GPU or driver"
