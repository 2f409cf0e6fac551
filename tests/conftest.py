"""Fixtures that start real backends (gloo on the CPU) in private temporary directories."""

import importlib.util
import os
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from xdit_backend.client import Client
from xdit_backend.distributed.topology import KEPT_ENV
from xdit_backend.launch import launcher
from xdit_backend.launch.worker_env import FAULT_ENV

from zygote import Zygote

# Small, fast requests for the tiny model: the tests check behaviour, not speed.
SMALL = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 1}
def load_node_module(name: str):
    """The pack's nodes/<name>.py by its path (`nodes` is ComfyUI's name, never imported as such), as
    module ``comfyui_xdit_<name>``."""
    path = Path(__file__).resolve().parent.parent / "nodes" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"comfyui_xdit_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def flux_tiny_conditioning(seed: int = 5, batch: int = 2, text_tokens: int = 8) -> dict:
    """Text embeddings for flux-tiny, positive and negative, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"context": (batch, text_tokens, 64), "pooled": (batch, 32)}
    tensors = {k: torch.randn(s, generator=generator) for k, s in shapes.items()}
    tensors.update({f"negative_{k}": torch.randn(s, generator=generator) for k, s in shapes.items()})
    return tensors


def serial_of(fields: dict, tensors: dict) -> torch.Tensor:
    """The serial latent of a request, computed in this process by the world-1 code path."""
    from xdit_backend.service.reference import serial_latent

    return serial_latent(fields, tensors)


LONG = {"model": "flux-tiny", "width": 512, "height": 512, "steps": 2000, "seed": 1}


def short_socket_dir() -> Path:
    """A private directory with a short path (Unix socket paths are limited to 107 bytes)."""
    return Path(tempfile.mkdtemp(prefix="xdit-test-", dir="/tmp"))


def fault_file(sock: Path) -> Path:
    return sock.parent / "fault"


def arm_fault(client: Client, rank: int, call: int) -> None:
    """Rank ``rank``'s ``call``-th model call of ``client``'s backend's next request raises a simulated
    out-of-memory (the executor's FAULT_ENV; the backend must come from ``Backends.start``)."""
    fault_file(client.socket_path).write_text(f"{rank}:{call}")


ZYGOTE = Zygote()  # this worker's; started by its first backend, stopped at the session's end


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie waiting for its parent counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between the open and the read
        return False


def pytest_sessionfinish(session):
    ZYGOTE.stop()


def pytest_configure(config):
    """A pytest-xdist worker computes on its share of the cores (torch's default is all of them): two workers with
    two threads each on 2 cores spin in OpenMP's barriers (tests/unit: 78 s and 138 CPU-s, against 56 s and 98)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


class Backends:
    """Starts backends for a test and makes sure every one is gone afterwards."""

    def __init__(self):
        self.started: list[tuple[Path, set[int]]] = []

    def start(self, nproc: int, fresh: bool = False, environment: dict[str, str] | None = None, **options) -> Client:
        """A CPU backend; without timing its links at start (a test that reads them passes topology_probe="on"),
        so that ``--parallel auto`` keeps its fixed order and the tests' layouts do not depend on the load.
        Its ranks look for an armed fault beside its socket (``arm_fault``) and keep their links' figures there.
        Its launcher is forked from this worker's zygote (tests/zygote.py), or with ``fresh`` started as
        ``xdit-backend start`` starts one (a new process, its ranks forked from a fork server); ``environment``: more
        variables for its ranks."""
        options = {"topology_probe": "off", **options}
        sock = short_socket_dir() / "backend.sock"
        status = launcher.start(launcher.LaunchOptions(socket=sock, nproc=nproc, device="cpu", **options),
                                environment={FAULT_ENV: str(fault_file(sock)),  # links timed afresh, kept beside it
                                             KEPT_ENV: str(sock.parent / "topology.json"), **(environment or {})},
                                spawn=None if fresh else ZYGOTE.spawn)
        self.started.append((sock, {status["pid"], *(r["pid"] for r in status["ranks"])}))
        return Client(sock)

    def track(self, sock: Path) -> None:
        """Also clean up whatever runs at ``sock`` (e.g. a backend a client restarted)."""
        status = Client(sock).status()
        self.started.append((sock, {status["pid"], *(r["pid"] for r in status["ranks"])}))

    def cleanup(self) -> None:
        for sock, pids in self.started:
            launcher.stop(sock, timeout=15)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(sock.parent, ignore_errors=True)


@pytest.fixture
def backends():
    manager = Backends()
    yield manager
    manager.cleanup()


@pytest.fixture
def zygote_launches(monkeypatch):
    """Every backend ``launcher.start`` starts during the test (a client's auto-start, the demo's, a bench's) is
    forked from this worker's zygote, as ``Backends.start`` does: for tests whose subject is what runs on the
    backend, not the user's way to start one (test_lifecycle, test_launcher and ComfyUI's tests keep that)."""
    monkeypatch.setattr(launcher, "_spawn_serve", ZYGOTE.spawn)


class SharedBackends:
    """One backend per world size for the whole session (per pytest-xdist worker), started when a test
    first asks for it and started again when a test left it dead. Tests that kill, stop, idle or restart
    a backend, or start one with options or environment of their own, take private ones from ``backends``."""

    KEEP_RANKS = 7  # ranks alive per worker at once (worlds 1, 2 and 4: ~4 GB); beyond, the least recently used stops

    def __init__(self):
        self.manager = Backends()
        self.clients: dict[int, Client] = {}  # least recently used first

    def get(self, world: int) -> Client:
        client = self.clients.pop(world, None)
        if client is None or not self.serving(client, world):
            while self.clients and sum(self.clients) + world > self.KEEP_RANKS:
                oldest = next(iter(self.clients))
                launcher.stop(self.clients.pop(oldest).socket_path, timeout=15)
            client = self.manager.start(world)
        self.clients[world] = client
        return client

    @staticmethod
    def serving(client: Client, world: int) -> bool:
        try:
            return len(client.status()["ranks"]) == world
        except Exception:  # gone, or not answering: a later test gets a new one
            return False


@pytest.fixture(scope="session")
def shared_backends():
    shared = SharedBackends()
    yield shared
    shared.manager.cleanup()


@pytest.fixture
def backend(shared_backends):
    """``backend(world)``: the session's backend of that world size, alive."""
    return shared_backends.get


@pytest.fixture
def backend1(shared_backends):
    return shared_backends.get(1)


@pytest.fixture
def backend2(shared_backends):
    return shared_backends.get(2)


@pytest.fixture
def backend3(shared_backends):
    return shared_backends.get(3)


@pytest.fixture
def backend4(shared_backends):
    """4 processes on however many cores."""
    return shared_backends.get(4)


FOLDERS = ("unit", "ranks", "backend", "host")  # by cost: in-process, spawned gloo worlds, a backend, the real ComfyUI

# How pytest-xdist shares the work out (the scheduler below, with --no-loadscope-reorder in pyproject.toml): a test
# file is one unit, run whole by one worker (its module fixtures and the worker's shared backends serve all its
# tests), except files in one of GROUPS, which run together on one worker. Units go out in the order below, the
# costliest first, so that no long unit starts last and holds the run up while the other workers wait.
GROUPS = {  # file: group
    "backend/test_compile.py": "compile", "backend/test_lora_patches.py": "compile",  # the second compiles warm
    "host/test_comfyui_host.py": "host", "host/test_workflows.py": "host",  # one ComfyUI (tests/host/conftest.py)
    "host/test_xdit_model.py": "host", "host/test_noise_mask.py": "host", "host/test_browser.py": "host",
}
COSTLIEST = (  # by the CPU seconds of a cold run (docs/benchmarks.md), heaviest first; the rest follow by folder
    "compile", "backend/test_selftest.py", "backend/test_lifecycle.py", "backend/test_faults.py",
    "backend/test_parity.py", "backend/test_step_cache.py", "host", "backend/test_pipefusion.py",
    "backend/test_concurrency.py", "backend/test_idle.py", "backend/test_server.py",
)


def unit_of(nodeid: str) -> str:
    """A test's unit of work: its group, or its file (relative to tests/)."""
    file = nodeid.split("::", 1)[0].removeprefix("tests/")
    return GROUPS.get(file, file)


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduling with our units as the scopes (its own --dist loadgroup marks a test by
    rewriting its node id, which pytest 9.2 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return ByUnit(config, log)


def pytest_collection_modifyitems(config, items):
    """Each test marked with its folder (``pytest -m unit`` is the loop while working); the costliest units
    first."""
    root = Path(__file__).resolve().parent
    folders = {}
    for item in items:
        folders[item] = item.path.resolve().relative_to(root).parts[0]
        if folders[item] in FOLDERS:
            item.add_marker(folders[item])

    def cost_order(item) -> tuple[int, int]:
        unit = unit_of(item.nodeid)
        return (COSTLIEST.index(unit) if unit in COSTLIEST else len(COSTLIEST),
                -FOLDERS.index(folders[item]) if folders[item] in FOLDERS else 0)

    items.sort(key=cost_order)  # stable: each file's tests keep their order
