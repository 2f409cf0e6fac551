"""workflows/README.md lists every workflow of the folder, and only those (issue 30: lists that went stale)."""

import re
from pathlib import Path

WORKFLOWS = Path(__file__).resolve().parents[2] / "workflows"


def test_the_workflow_table_lists_each_workflow_once_and_no_other():
    ui = sorted(p.name.removesuffix(".json") for p in WORKFLOWS.glob("*.json"))  # (their API twins: test_workflows.py)
    rows = re.findall(r"^\| `([^`]+)` \|", (WORKFLOWS / "README.md").read_text(), re.M)
    assert sorted(rows) == ui and len(rows) == len(set(rows))


def test_each_workflow_has_its_thumbnail_drawn_from_its_current_file():
    """ComfyUI's template browser shows <name>.jpg as <name>.json's thumbnail; each JPEG's comment is the digest of
    the UI file it was drawn from (python tools/workflow_thumbnails.py draws them again)."""
    import hashlib

    from PIL import Image

    for path in sorted(WORKFLOWS.glob("*.json")):
        thumbnail = path.with_suffix(".jpg")
        assert thumbnail.exists(), f"{path.name} has no thumbnail: run python tools/workflow_thumbnails.py {path}"
        with Image.open(thumbnail) as image:
            assert image.format == "JPEG" and image.size == (512, 384)
            drawn_from = image.info.get("comment", b"").decode()
        assert drawn_from == hashlib.sha256(path.read_bytes()).hexdigest(), (
            f"{thumbnail.name} was drawn from an older {path.name}: run python tools/workflow_thumbnails.py {path}")


def test_each_name_says_its_family_what_it_makes_and_its_gpus_truly():
    """ComfyUI's template browser shows a custom node's template by its file name alone (issue 30: a description of
    what it makes and on how many GPUs), so the name is <family>_<what it makes>_<GPUs>, and its GPUs are the
    workflow's: `all-gpus` where every xDiT Parallel Config is on auto (or none is connected: every GPU, a layout
    chosen per call), `N-gpus` where the fixed degrees multiply to N."""
    import json

    for path in sorted((WORKFLOWS / "api").glob("*.api.json")):
        name = path.name.removesuffix(".api.json")
        match = re.fullmatch(r"([a-z0-9-]+)_([a-z0-9-]+)_(all|\d+)-gpus", name)
        assert match, f"{name}: not <family>_<what it makes>_<all|N>-gpus"
        configs = [node["inputs"] for node in json.loads(path.read_text()).values()
                   if node["class_type"] == "XDiTParallelConfig"]
        if match.group(3) == "all":
            assert all(config["auto"] for config in configs), f"{name} says all GPUs but fixes its layout"
        else:
            assert configs and not any(config["auto"] for config in configs), f"{name} says a count but runs auto"
            for config in configs:
                degrees = (config["dp"] * (2 if config["cfg_parallel"] else 1) * config["pipefusion"]
                           * config["ring"] * config["ulysses"])
                assert degrees == int(match.group(3)), f"{name}: its layout's degrees multiply to {degrees}"


def test_every_workflow_the_readme_names_exists():
    named = set(re.findall(r"`([a-z0-9-]+_[a-z0-9-]+_(?:all|\d+)-gpus)`", (WORKFLOWS.parent / "README.md").read_text()))
    assert named and not named - {p.stem for p in WORKFLOWS.glob("*.json")}
