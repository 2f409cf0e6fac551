"""Which modules import which: the packages import one way (no cycle, no upward edge), and the client side
stays off the ranks' side."""

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "xdit_backend"
CORE = {"errors", "schema", "device"}  # the few modules everything may need: they import only each other

# A package → the packages its modules may import (a lazy import inside a function counts too). The direction:
# cli → selftest → bench → service → parallel → distributed → launch → wire; service → memory → models →
# sampling; client → launch → wire. Every package may import core.
MAY_IMPORT = {
    "core": set(),
    "wire": set(),
    "launch": {"wire"},
    "distributed": {"launch", "wire"},
    "sampling": set(),
    "models": {"sampling"},
    "memory": {"models"},
    "parallel": {"distributed", "models", "sampling"},
    "service": {"parallel", "distributed", "launch", "wire", "memory", "models", "sampling"},
    "client": {"launch", "wire"},
    "bench": {"service", "parallel", "distributed", "launch", "wire", "memory", "models", "sampling", "client"},
    "selftest": {"bench", "service", "parallel", "distributed", "launch", "wire", "memory", "models", "sampling",
                 "client"},
    "cli": {"selftest", "bench", "service", "parallel", "distributed", "launch", "wire", "memory", "models",
            "sampling", "client"},
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports anywhere in its source, read statically."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            base = base.rstrip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def package_of(module: str) -> str:
    """xdit_backend.service.leader → service; xdit_backend.client → client; errors, schema, device → core."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CORE:
        return "core"
    return parts[1]


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order), or None."""
    state: dict[str, str] = {}
    trail: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        trail.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        trail.pop()
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among the package's modules, lazy imports included."""
    assert cycle(import_graph()) is None, " → ".join(cycle(import_graph()))


def test_every_package_imports_only_packages_below_it():
    """Each import between packages follows MAY_IMPORT: no upward edge (service imports no bench, distributed
    no service, models no parallel, …)."""
    upward = sorted(f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
                    if package_of(target) not in MAY_IMPORT[package_of(module)] | {"core", package_of(module)})
    assert not upward, "\n".join(upward)


def test_the_engine_names_no_family():
    """parallel/, sampling/, memory/ and service/ import no family module (models/<family>.py, beside its
    <family>_checkpoint.py) and no converter: a family reaches the engine through its spec and plans."""
    families = {f"xdit_backend.models.{path.stem.removesuffix('_checkpoint')}"
                for path in (PACKAGE / "models").glob("*_checkpoint.py")}
    families |= {f"{name}_checkpoint" for name in families}
    named = sorted(f"{module} imports {target}" for module, targets in import_graph().items() for target in targets
                   if package_of(module) in ("parallel", "sampling", "memory", "service") and target in families)
    assert len(families) >= 20 and not named, "\n".join(named)


def test_the_package_table_runs_one_way():
    """MAY_IMPORT itself has no cycle, and names every package there is."""
    assert cycle({name: set(allowed) for name, allowed in MAY_IMPORT.items()}) is None
    assert {package_of(module) for module in modules()} == set(MAY_IMPORT)


def test_the_checks_see_a_cycle_and_an_upward_edge():
    """The checks above can fail: a two-module cycle is found, and so is service → bench."""
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert "bench" not in MAY_IMPORT["service"] and "service" not in MAY_IMPORT["distributed"]
    assert "xdit_backend.service.leader" in import_graph()["xdit_backend.service.worker"]  # the reader sees imports


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
    assert not {module for module in loaded if package_of(module) in ("distributed", "service")}, loaded
    assert "torch.distributed.elastic" not in loaded


def test_the_samplers_do_not_import_generate():
    """generate → samplers only (GenerationStopped lives in sampling/stop.py)."""
    assert "xdit_backend.sampling.generate" not in loaded_by("xdit_backend.sampling.samplers")


def test_light_modules_import_no_torch():
    """The schema and the launch options are read by the nodes and the client before any torch."""
    for module in ("xdit_backend.schema", "xdit_backend.launch.options", "xdit_backend.wire.paths",
                   "xdit_backend.errors"):
        code = f"import sys, {module}; print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert out.stdout.strip() == "False", module
