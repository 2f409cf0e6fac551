"""The example workflows: each UI file and its API twin are one graph, and ComfyUI accepts every node and value.

The file checks need only the JSON and the pack's source; the checks against the real /object_info run
when COMFYUI_DIR points at a ComfyUI checkout (tests/host/conftest.py's `host` fixture starts it).
Nodes newer than that checkout (Flux.2's, HunyuanVideo 1.5's) are checked against the entries of
tests/comfyui_newer_nodes.py, read from ComfyUI's current source; the test ids of
test_a_node_newer_than_the_snapshot_matches_its_source name each of them.
"""

import ast
import json
import re
from pathlib import Path

import pytest
from comfyui_newer_nodes import NEWER_NODES, NEWER_OPTIONS, with_newer_nodes
from host.conftest import COMFYUI_DIR

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
PACK_NODES = ROOT / "nodes"

# Nodes that exist only in the page (the frontend's own), never in the API format or /object_info.
UI_ONLY = {"Note", "MarkdownNote"}
# The frontend's "control after generate" widget: an extra value after a seed-like INT widget,
# saved in widgets_values but not an input of the node.
CONTROL_AFTER_GENERATE = {"fixed", "increment", "decrement", "randomize"}
# Widgets the frontend adds beside a node's inputs: saved in widgets_values, never an API input
# (LoadImage's "choose file to upload" button).
FRONTEND_WIDGETS = {"IMAGEUPLOAD"}
# What ComfyUI lists as model files (folder_paths.supported_pt_extensions, and gguf).
MODEL_EXTENSIONS = (".safetensors", ".sft", ".ckpt", ".pt", ".pt2", ".pth", ".bin", ".pkl", ".gguf")


API = WORKFLOWS / "api"  # the API twins: a sub-folder, which ComfyUI's template browser does not list


def ui_files() -> list[Path]:
    return sorted(WORKFLOWS.glob("*.json"))


def twin_of(path: Path) -> Path:
    return API / (path.stem + ".api.json")


NAMES = [path.stem for path in ui_files()]


def load_ui(name: str) -> dict:
    return json.loads((WORKFLOWS / f"{name}.json").read_text())


def load_api(name: str) -> dict:
    return json.loads((API / f"{name}.api.json").read_text())


def widget_values(node: dict) -> dict:
    """A UI node's widget values by name: its `widget` inputs in order take `widgets_values` positionally."""
    assert isinstance(node.get("widgets_values", []), list), f"node {node['id']}: widgets_values is not a list"
    widgets = [entry for entry in node.get("inputs", []) if "widget" in entry]
    values = list(node.get("widgets_values") or [])
    # an INT widget (a seed) may be followed by its control-after-generate value, which is no input
    extra = len(values) - len(widgets)
    out, position = {}, 0
    for entry in widgets:
        assert position < len(values), f"node {node['id']} ({node['type']}): no value for widget {entry['name']}"
        if entry["type"] not in FRONTEND_WIDGETS:
            out[entry["widget"]["name"]] = values[position]
        position += 1
        if (extra and entry["type"] == "INT" and position < len(values)
                and values[position] in CONTROL_AFTER_GENERATE):
            position, extra = position + 1, extra - 1
    assert position == len(values), (f"node {node['id']} ({node['type']}): {len(values)} widget values for "
                                     f"{len(widgets)} widget inputs: {values}")
    return out


def ui_as_api(ui: dict) -> dict:
    """The API graph a UI workflow stands for: id → (class type, {input: [id, slot] or value}), no UI-only nodes."""
    links = {link[0]: link for link in ui["links"]}
    graph = {}
    for node in ui["nodes"]:
        if node["type"] in UI_ONLY:
            continue
        inputs = widget_values(node)
        for entry in node.get("inputs", []):
            if entry.get("link") is not None:
                _, origin, slot, *_ = links[entry["link"]]
                inputs[entry["widget"]["name"] if "widget" in entry else entry["name"]] = [str(origin), slot]
        graph[str(node["id"])] = (node["type"], inputs)
    return graph


def pack_node_ids() -> set[str]:
    """The node ids the pack defines (node_id="…" in nodes/*.py; importing them needs ComfyUI)."""
    ids = set()
    for path in PACK_NODES.glob("*.py"):
        ids.update(re.findall(r'node_id="([^"]+)"', path.read_text()))
    return ids


def pack_input_names() -> set[str]:
    """Every input name the pack's nodes declare (io.<Type>.Input("name", …) in nodes/*.py)."""
    names = set()
    for path in PACK_NODES.glob("*.py"):
        for call in ast.walk(ast.parse(path.read_text())):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "Input"
                    and call.args and isinstance(call.args[0], ast.Constant)):
                names.add(call.args[0].value)
    return names


def file_names(api: dict) -> list[tuple[str, str, str]]:
    """(node id, input, value) for every input value that names a model file."""
    return [(node_id, name, value) for node_id, node in api.items() for name, value in node["inputs"].items()
            if isinstance(value, str) and value.lower().endswith(MODEL_EXTENSIONS)]


def note_path(value: str) -> str:
    """A model file's path under models/ as a Note names it: the xDiT loader lists models/checkpoints
    files as checkpoints/<name>, which already is that path; other names need their folder in front."""
    return re.escape(value) if value.startswith("checkpoints/") else r"[\w.-]+/" + re.escape(value)


def notes(ui: dict) -> str:
    return "\n".join(str(value) for node in ui["nodes"] if node["type"] in UI_ONLY
                     for value in node.get("widgets_values") or [])


# ---------------------------------------------------------------------------------------------- files


def test_every_workflow_is_a_ui_file_with_an_api_twin():
    """Each UI file has its api/<name>.api.json twin and each twin its UI file; no twin beside the UI files (the
    template browser would list it, and it does not load there)."""
    assert NAMES, "no workflows in workflows/"
    for path in ui_files():
        assert not path.name.endswith(".api.json"), f"{path.name} belongs in workflows/api/"
        assert twin_of(path).exists(), f"{path.name} has no api/{twin_of(path).name}"
    for path in API.glob("*.api.json"):
        assert (WORKFLOWS / path.name.replace(".api.json", ".json")).exists(), f"{path.name} has no UI file"


@pytest.mark.parametrize("name", NAMES)
def test_ui_file_is_a_page_workflow(name):
    """The UI file has the page's layout: version 0.4, nodes with id/type/pos/size/inputs/outputs, links."""
    ui = load_ui(name)
    assert ui["version"] == 0.4
    assert isinstance(ui["nodes"], list) and isinstance(ui["links"], list)
    ids = [node["id"] for node in ui["nodes"]]
    assert len(ids) == len(set(ids)), "node ids repeat"
    assert ui["last_node_id"] >= max(ids)
    assert ui["last_link_id"] >= max((link[0] for link in ui["links"]), default=0)
    for node in ui["nodes"]:
        for key in ("id", "type", "pos", "size", "inputs", "outputs", "mode"):  # widgets_values: if it has widgets
            assert key in node, f"node {node.get('id')}: no {key}"
        assert len(node["pos"]) == 2 and len(node["size"]) == 2
        assert node["mode"] == 0, f"node {node['id']} is muted or bypassed in an example workflow"


@pytest.mark.parametrize("name", NAMES)
def test_ui_links_agree_with_the_nodes_slots(name):
    """Every link joins an existing output slot to an existing input slot of its type, and the nodes list it."""
    ui = load_ui(name)
    nodes = {node["id"]: node for node in ui["nodes"]}
    link_ids = set()
    for link_id, origin, origin_slot, target, target_slot, kind in ui["links"]:
        assert link_id not in link_ids, f"link {link_id} repeats"
        link_ids.add(link_id)
        assert origin in nodes and target in nodes, f"link {link_id} joins a missing node"
        output = nodes[origin]["outputs"][origin_slot]
        entry = nodes[target]["inputs"][target_slot]
        assert link_id in (output.get("links") or []), f"link {link_id} missing from node {origin}'s output"
        assert entry["link"] == link_id, f"link {link_id} missing from node {target}'s input {entry['name']}"
        assert output["type"] == kind == entry["type"], \
            f"link {link_id}: {output['type']} → {kind} → {entry['type']}"
    for node in ui["nodes"]:
        for entry in node["inputs"]:
            assert entry.get("link") is None or entry["link"] in link_ids, f"node {node['id']}: dangling input"
        for output in node["outputs"]:
            assert set(output.get("links") or []) <= link_ids, f"node {node['id']}: dangling output link"


@pytest.mark.parametrize("name", NAMES)
def test_api_twin_is_the_same_graph(name):
    """The API twin has the UI file's nodes (less UI-only ones), class types, links and widget values."""
    ui, api = load_ui(name), load_api(name)
    expected = ui_as_api(ui)
    got = {node_id: (node["class_type"], node["inputs"]) for node_id, node in api.items()}
    assert sorted(got) == sorted(expected), "node ids differ"
    for node_id, (class_type, inputs) in expected.items():
        assert got[node_id][0] == class_type, f"node {node_id}"
        assert got[node_id][1] == inputs, f"node {node_id} ({class_type})"
    titles = {str(node["id"]): node["title"] for node in ui["nodes"] if "title" in node}
    for node_id, title in titles.items():
        if node_id in api:
            assert api[node_id].get("_meta", {}).get("title") == title, f"node {node_id}: title"


@pytest.mark.parametrize("name", NAMES)
def test_xdit_nodes_and_inputs_exist_in_the_pack(name):
    """Every xDiT node type in the workflow is one the pack defines, with inputs the pack declares."""
    ids, inputs = pack_node_ids(), pack_input_names()
    assert {"XDiTLoadDiffusionModel", "XDiTSampler"} <= ids, "the pack's node ids were not found in nodes/*.py"
    api = load_api(name)
    used = [node for node in api.values() if node["class_type"].startswith("XDiT")]
    assert used, "an example workflow of the pack without its nodes"
    for node in used:
        assert node["class_type"] in ids, node["class_type"]
        assert set(node["inputs"]) <= inputs, (node["class_type"], set(node["inputs"]) - inputs)


@pytest.mark.parametrize("name", NAMES)
def test_the_note_says_where_each_model_file_goes(name):
    """A Note in the UI file names every model file the workflow uses with its models/<folder>/ path."""
    ui, api = load_ui(name), load_api(name)
    text = notes(ui)
    assert text, "no Note in the UI file"
    for node_id, input_name, value in file_names(api):
        assert re.search("models/" + note_path(value), text), f"node {node_id} {input_name}: {value}"


# ------------------------------------------------------------------------------------------- ComfyUI

needs_comfyui = pytest.mark.skipif(not COMFYUI_DIR, reason="needs a ComfyUI checkout: set COMFYUI_DIR (and run "
                                   "with a Python that has ComfyUI's requirements) to check the workflows "
                                   "against the real /object_info")

PROBE = "xdit-probe-{}.safetensors"
INPUT_PROBE = "xdit-probe-input.png"  # in ComfyUI's input folder, which LoadImage lists
VIDEO_PROBE = "xdit-probe-input.mp4"  # and LoadVideo
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv")


@pytest.fixture(scope="module")
def comfy(host):
    """/object_info with an empty probe file in every models/<folder> and in input/: a combo listing one
    reads that folder."""
    folders = host.get("/models")
    for folder in folders:
        directory = host.base / "models" / folder
        directory.mkdir(parents=True, exist_ok=True)
        (directory / PROBE.format(folder)).touch()
    (host.base / "input").mkdir(exist_ok=True)
    (host.base / "input" / INPUT_PROBE).touch()
    (host.base / "input" / VIDEO_PROBE).touch()
    return host.get("/object_info"), folders


def input_spec(info: dict, class_type: str, name: str):
    spec = info[class_type]["input"]
    for group in ("required", "optional"):
        if name in spec.get(group, {}):
            return spec[group][name]
    return None


def combo_options(spec) -> list | None:
    kind = spec[0]
    if isinstance(kind, list):
        return kind
    if kind == "COMBO":
        return spec[1].get("options", [])
    return None


def problems(api: dict, ui: dict, info: dict, folders: list[str]) -> list[str]:
    """What ComfyUI would refuse in an API workflow (beyond files that are not installed here)."""
    found = []
    for node_id, node in api.items():
        class_type = node["class_type"]
        if class_type not in info:
            found.append(f"{node_id}: no node type {class_type}")
            continue
        required = info[class_type]["input"].get("required", {})
        found += [f"{node_id} {class_type}: required input {name} missing" for name in required
                  if name not in node["inputs"]]
        for name, value in node["inputs"].items():
            where = f"{node_id} {class_type}.{name} = {value!r}"
            spec = input_spec(info, class_type, name)
            if spec is None:
                found.append(f"{where}: no such input")
                continue
            kind, options = spec[0], (spec[1] if len(spec) > 1 else {})
            if isinstance(value, list):  # a link: the source's output type must be the input's
                if value[0] not in api:
                    found.append(f"{where}: links to a missing node")
                    continue
                source = api[value[0]]["class_type"]
                if source not in info:
                    continue  # reported as that node's own problem
                out_type = info[source]["output"][value[1]]
                if "*" not in (kind, out_type) and out_type != kind:
                    found.append(f"{where}: {source} gives {out_type}, the input takes {kind}")
                continue
            listed = combo_options(spec)
            if listed is not None:
                if value in listed:
                    continue
                # A file-name combo (it lists the probe file of some models folder): without model files
                # ComfyUI lists none of the workflow's files, so any model-file name is accepted here,
                # provided the UI file's Note says to put it in one of the folders that combo reads.
                reads = [folder for folder in folders if any(str(option).endswith(PROBE.format(folder))
                                                             for option in listed)]
                inputs = [(probe, kinds) for probe, kinds in ((INPUT_PROBE, IMAGE_EXTENSIONS),
                                                              (VIDEO_PROBE, VIDEO_EXTENSIONS)) if probe in listed]
                if inputs:  # an input image or video (LoadImage, LoadVideo): the Note says where it goes
                    if not value.lower().endswith(tuple(e for _, kinds in inputs for e in kinds)):
                        found.append(f"{where}: not a file name of the kind the combo lists from ComfyUI's input "
                                     "folder")
                    elif f"ComfyUI/input/{value}" not in notes(ui):
                        found.append(f"{where}: the Note does not put it in ComfyUI/input/")
                elif not reads:
                    found.append(f"{where}: not among {listed}")
                elif not value.lower().endswith(MODEL_EXTENSIONS):
                    found.append(f"{where}: not a model file name (the combo lists files of {reads})")
                elif not any(f"models/{folder}/{value}" in notes(ui)
                             # the xDiT loader lists models/checkpoints files as checkpoints/<name>
                             or (value.startswith(f"{folder}/") and f"models/{value}" in notes(ui))
                             for folder in reads):
                    found.append(f"{where}: the Note does not put it in models/{' or '.join(reads)}/")
            elif kind == "INT" or kind == "FLOAT":
                number_type = int if kind == "INT" else (int, float)
                if isinstance(value, bool) or not isinstance(value, number_type):
                    found.append(f"{where}: not {kind}")
                elif not options.get("min", value) <= value <= options.get("max", value):
                    found.append(f"{where}: outside [{options.get('min')}, {options.get('max')}]")
            elif kind in ("BOOLEAN", "STRING") and not isinstance(value, bool if kind == "BOOLEAN" else str):
                found.append(f"{where}: not {kind}")
    return found


@needs_comfyui
def test_ui_only_nodes_are_unknown_to_comfyui(comfy):
    """Note and MarkdownNote, left out of the API twins, are indeed not ComfyUI node types."""
    info, _ = comfy
    assert not UI_ONLY & set(info)


@needs_comfyui
def test_the_probe_tells_file_combos_apart(comfy):
    """The probe files show up in the xDiT loader's list (and in no sampler's), so file combos are found."""
    info, folders = comfy
    assert "diffusion_models" in folders
    listed = combo_options(input_spec(info, "XDiTLoadDiffusionModel", "model_name"))
    assert PROBE.format("diffusion_models") in listed
    assert not any("xdit-probe" in option for option in combo_options(input_spec(info, "XDiTSampler", "sampler_name")))


def newer_uses() -> list[tuple[str, str, str]]:
    """(workflow, node id, what) for each node or combo value of a workflow that the source table checks."""
    uses = []
    for name in NAMES:
        for node_id, node in load_api(name).items():
            if node["class_type"] in NEWER_NODES:
                uses.append((name, node_id, node["class_type"]))
            for (class_type, input_name), (values, _) in NEWER_OPTIONS.items():
                value = node["inputs"].get(input_name)
                if node["class_type"] == class_type and value in values:
                    uses.append((name, node_id, f"{class_type}.{input_name}={value}"))
    return uses


NEWER_USES = newer_uses()


def test_the_source_table_is_complete_and_used():
    """Each entry of the newer-nodes table cites its source and some workflow uses it (no stale rows)."""
    used = {what.split(".")[0].split("=")[0] for _, _, what in NEWER_USES}
    for name, entry in NEWER_NODES.items():
        assert entry["source"] and entry["output"] and entry["input"]["required"], name
        assert name in used, f"no workflow uses {name}: delete its NEWER_NODES entry"
    for (class_type, input_name), (values, source) in NEWER_OPTIONS.items():
        assert source and class_type in used, f"no workflow uses {class_type}.{input_name} = {values}"


@needs_comfyui
def test_the_source_table_holds_only_what_the_snapshot_lacks(comfy):
    """A node or value the running ComfyUI has is checked against it, not against the table."""
    info, _ = comfy
    stale = [name for name in NEWER_NODES if name in info]
    assert not stale, f"this ComfyUI has {stale}: delete them from tests/comfyui_newer_nodes.py NEWER_NODES"
    for (class_type, input_name), (values, _) in NEWER_OPTIONS.items():
        listed = combo_options(input_spec(info, class_type, input_name))
        stale = [value for value in values if value in listed]
        assert not stale, f"this ComfyUI's {class_type}.{input_name} has {stale}: delete them from NEWER_OPTIONS"


@needs_comfyui
@pytest.mark.parametrize("name", NAMES)
def test_every_node_and_value_is_valid_in_comfyui(comfy, name):
    """Every node type exists in the running ComfyUI and every API input is one its node accepts; the
    nodes and values newer than it, against the table of ComfyUI's current source (listed by the next test)."""
    info, folders = comfy
    assert problems(load_api(name), load_ui(name), with_newer_nodes(info), folders) == []


@needs_comfyui
@pytest.mark.parametrize("name, node_id, what", NEWER_USES, ids=[f"{name}:{what}" for name, _, what in NEWER_USES])
def test_a_node_newer_than_the_snapshot_matches_its_source(comfy, name, node_id, what):
    """The node (or combo value) is missing from the running ComfyUI and valid by the source table."""
    info, folders = comfy
    api, ui = load_api(name), load_ui(name)

    def of_node(found: list[str]) -> list[str]:
        return [line for line in found if line.startswith((f"{node_id} ", f"{node_id}:"))]

    assert of_node(problems(api, ui, with_newer_nodes(info), folders)) == []
    assert of_node(problems(api, ui, info, folders)) != []  # the running ComfyUI alone refuses it
