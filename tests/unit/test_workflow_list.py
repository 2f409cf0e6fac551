"""workflows/README.md lists every workflow of the folder, and only those (issue 30: lists that went stale)."""

import re
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


def test_the_workflow_table_lists_each_workflow_once_and_no_other():
    ui = sorted(p.name.removesuffix(".json") for p in WORKFLOWS.glob("*.json") if not p.name.endswith(".api.json"))
    api = sorted(p.name.removesuffix(".api.json") for p in WORKFLOWS.glob("*.api.json"))
    rows = re.findall(r"^\| `([^`]+)` \|", (WORKFLOWS / "README.md").read_text(), re.M)
    assert ui == api  # each UI file has its API twin
    assert sorted(rows) == ui and len(rows) == len(set(rows))
