"""Importing the pack does nothing: no process, thread, socket, CUDA or environment change."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.util, json, os, sys, threading
before_env = dict(os.environ)
before_threads = threading.active_count()
before_children = set(os.listdir("/proc/self/task"))
spec = importlib.util.spec_from_file_location("comfyui_xdit", sys.argv[1] + "/__init__.py",
                                              submodule_search_locations=[sys.argv[1]])
pack = importlib.util.module_from_spec(spec)
sys.modules["comfyui_xdit"] = pack
spec.loader.exec_module(pack)
fds = os.listdir("/proc/self/fd")
print(json.dumps({
    "entrypoint": callable(pack.comfy_entrypoint) and not hasattr(pack, "NODE_CLASS_MAPPINGS"),
    "env_changed": dict(os.environ) != before_env,
    "threads": threading.active_count() - before_threads,
    "heavy": sorted(m for m in ("torch", "diffusers", "yunchang", "xdit_backend.service.worker") if m in sys.modules),
    "sockets": [os.readlink(f"/proc/self/fd/{fd}") for fd in fds
                if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")],
}))
"""


def test_pack_root_loads_as_comfyui_loads_it_without_side_effects():
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT)], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report == {"entrypoint": True, "env_changed": False, "threads": 0, "heavy": [], "sockets": []}


def test_the_pack_root_imports_alone_as_pytest_imports_it_in_a_clone_named_comfyui_xdit():
    """pytest imports its rootdir's __init__.py, and where the folder's name is no Python name (the README clones into
    comfyui-xdit) it imports it alone, outside any package: a relative import there failed every test."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('__init__', sys.argv[1]); "
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); print(module.WEB_DIRECTORY)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "__init__.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "./web"


def test_nodes_is_not_installed_as_a_top_level_package(tmp_path):
    """ComfyUI owns the top-level name `nodes`; installing this project must not shadow it."""
    code = "import importlib.util; print(importlib.util.find_spec('nodes') is None, " \
           "importlib.util.find_spec('xdit_backend') is not None)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_backend_modules_import_without_starting_anything():
    code = ("import threading, xdit_backend.cli, xdit_backend.client, xdit_backend.launch.launcher; "
            "print(threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_status_and_stop_load_no_torch(tmp_path):
    """The commands that only talk to a backend (and the client's frames without tensors) leave torch
    unloaded: `xdit-backend status` answers at once, and a ComfyUI-less script can poll it cheaply."""
    code = ("import sys; from xdit_backend import cli; "
            "codes = [cli.main([c, '--socket', sys.argv[1]]) for c in ('status', 'stop')]; "
            "print(codes, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "none.sock")], capture_output=True,
                         text=True, check=False)
    assert out.stdout.split("]")[-1].strip() == "False", out.stdout + out.stderr


CUDA_PROBE = r"""
import json, sys
import torch
# Every question to torch.cuda, and to torch.accelerator (on a CUDA build it counts the GPUs), recorded and
# answered "no"
asked = []
for module, names in ((torch.cuda, ("is_available", "device_count", "init", "_lazy_init", "get_device_capability",
                                    "current_device")), (torch.accelerator, ("is_available", "device_count"))):
    for name in names:
        setattr(module, name, lambda *a, _name=f"{module.__name__}.{name}", **k: asked.append(_name) or False)
for module in json.loads(sys.argv[1]):
    __import__(module)
print(json.dumps({"asked": asked, "initialized": torch.cuda.is_initialized()}))
"""


def _cuda_questions(modules: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CUDA_PROBE, json.dumps(modules)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_what_a_cuda_backends_fork_server_imports_asks_nothing_of_cuda():
    """The launcher's fork server imports the preload before forking the ranks: had one of those modules asked
    CUDA anything there (even how many GPUs), no rank could use its GPU (the first GPU run failed so: diffusers
    asks at import). The probe is not blind: diffusers, imported under it, is seen asking."""
    from xdit_backend.launch.launcher import rank_preload

    assert _cuda_questions(rank_preload("cuda")) == {"asked": [], "initialized": False}
    assert _cuda_questions(["diffusers.models.transformers"])["asked"], "the probe no longer sees diffusers ask"


def test_a_cpu_backends_fork_server_imports_diffusers_for_its_ranks():
    from xdit_backend.launch.launcher import RANK_PRELOAD, rank_preload

    assert rank_preload("cpu") == list(RANK_PRELOAD) and any(m.startswith("diffusers") for m in RANK_PRELOAD)
