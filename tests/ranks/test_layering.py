"""Which modules import which: no import cycles, and the client side stays off the ranks' side."""

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import {module}
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("xdit_backend", "torch.distributed.elastic")))))
"""


def loaded_by(module: str) -> set[str]:
    """The project modules (and torch.distributed.elastic) importing ``module`` loads, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], capture_output=True, text=True,
                         check=True)
    return set(json.loads(out.stdout))


def test_the_launcher_does_not_import_the_client():
    """client → launcher only: the launcher probes, asks and stops a backend through endpoint."""
    assert "xdit_backend.client" not in loaded_by("xdit_backend.launch.launcher")


def test_the_client_loads_nothing_of_the_ranks_side():
    """The ComfyUI process imports the client: no control plane, worker, server or elastic agent."""
    loaded = loaded_by("xdit_backend.client")
    assert not loaded & {"xdit_backend.distributed.control", "xdit_backend.service.worker", "xdit_backend.service.server",
                         "torch.distributed.elastic"}, loaded


def test_the_samplers_do_not_import_generate():
    """generate → samplers only (GenerationStopped lives in sampling/stop.py)."""
    assert "xdit_backend.sampling.generate" not in loaded_by("xdit_backend.sampling.samplers")


def test_light_modules_import_no_torch():
    """The schema and the launch options are read by the nodes and the client before any torch."""
    for module in ("xdit_backend.schema", "xdit_backend.launch.options", "xdit_backend.wire.paths", "xdit_backend.errors"):
        code = f"import sys, {module}; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", module
