"""Build a workflow's UI file (what ComfyUI's page and template browser open) from its API twin.

    python tools/api_to_ui.py workflows/api/NAME.api.json --object-info http://127.0.0.1:8188 \
        --note "Model files" "Put the files in …" [--note TITLE TEXT …]

Each node's inputs and outputs come from the running ComfyUI's /object_info (the pack loaded in it): linked
inputs first, then the widgets in the node's input order, with the seed widgets' "control after generate" value;
nodes are placed in columns by their depth in the graph; the notes go below. tests/host/test_workflows.py checks
the pair (one graph, links on the right slots, every value valid in ComfyUI). Nodes and combo values newer than the
running ComfyUI come from tests/comfyui_newer_nodes.py (read from ComfyUI's current source), their inputs in the
order the table lists them.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from comfyui_newer_nodes import with_newer_nodes  # noqa: E402

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def object_info(url: str) -> dict:
    """Every node's inputs and outputs: the running ComfyUI's, with the newer nodes' and values' added."""
    with urllib.request.urlopen(f"{url}/object_info", timeout=60) as response:
        return with_newer_nodes(json.loads(response.read()))


def kind(spec: list) -> str:
    first = spec[0]
    return "COMBO" if isinstance(first, list) else first


def is_widget(spec: list) -> bool:
    """An input the page shows as a widget: a widget type, or several types with one as the widget (ComfyUI's
    io.MultiType: "FLOAT,INT" with widgetType FLOAT, LTXVEmptyLatentAudio's frame_rate)."""
    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    return kind(spec) in WIDGET_TYPES or options.get("widgetType") in WIDGET_TYPES


def build(api: dict, url: str, notes: list[tuple[str, str]]) -> dict:
    known = object_info(url)
    infos = {node["class_type"]: known[node["class_type"]] for node in api.values()}
    depth: dict[str, int] = {}

    def depth_of(node_id: str) -> int:
        if node_id not in depth:
            parents = [v[0] for v in api[node_id]["inputs"].values() if isinstance(v, list)]
            depth[node_id] = 1 + max((depth_of(p) for p in parents), default=-1)
        return depth[node_id]

    links, nodes, outputs = [], [], {}
    rows: dict[int, int] = {}
    for node_id in sorted(api, key=lambda n: (depth_of(n), int(n))):
        node, info = api[node_id], infos[api[node_id]["class_type"]]
        order = info.get("input_order") or {group: list(inputs) for group, inputs in info["input"].items()}
        specs = {**info["input"].get("required", {}), **info["input"].get("optional", {})}
        optional = set(info["input"].get("optional", {}))
        linked, widgets, values = [], [], []
        for name in [*order.get("required", []), *order.get("optional", [])]:
            spec, value = specs[name], node["inputs"].get(name)
            entry = {"localized_name": name, "name": name, "type": kind(spec)}
            if name in optional:
                entry["shape"] = 7
            if isinstance(value, list):
                link_id = len(links) + 1
                origin, slot = value
                links.append([link_id, int(origin), slot, int(node_id), None, entry["type"]])
                entry["link"] = link_id
                if is_widget(spec):  # a widget fed by a link: the page keeps the widget's own value
                    entry["widget"] = {"name": name}
                    widgets.append(entry)
                    options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                    values.append(options.get("default"))
                else:
                    linked.append(entry)
            elif is_widget(spec):
                if value is None:
                    continue  # an optional widget left out
                entry["widget"] = {"name": name}
                entry["link"] = None
                widgets.append(entry)
                values.append(value)
                options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
                if options.get("control_after_generate"):
                    values.append("fixed")
            else:
                if name not in optional:
                    raise ValueError(f"node {node_id}: required input {name} is not linked")
        column = depth_of(node_id)
        row = rows.get(column, 0)
        rows[column] = row + 1
        ui = {"id": int(node_id), "type": node["class_type"], "pos": [30 + 360 * column, 30 + 300 * row],
              "size": [330, 120 + 26 * len(widgets)], "flags": {}, "order": len(nodes), "mode": 0,
              "inputs": [*linked, *widgets],
              "outputs": [{"localized_name": name, "name": name, "type": out, "links": []}
                          for name, out in zip(info.get("output_name", info["output"]), info["output"])],
              "properties": {"Node name for S&R": node["class_type"]}, "widgets_values": values}
        nodes.append(ui)
        outputs[int(node_id)] = ui
    for link in links:
        _, origin, slot, target, _, _ = link
        outputs[origin]["outputs"][slot]["links"].append(link[0])
        target_node = outputs[target]
        link[4] = next(i for i, entry in enumerate(target_node["inputs"]) if entry.get("link") == link[0])
    last = max(int(n) for n in api)
    for i, (title, text) in enumerate(notes):
        nodes.append({"id": last + 1 + i, "type": "Note", "pos": [30 + 420 * i, 30 + 300 * (max(rows.values()) + 1)],
                      "size": [400, 250], "flags": {}, "order": len(nodes), "mode": 0, "inputs": [], "outputs": [],
                      "title": title, "properties": {}, "widgets_values": [text]})
    return {"id": str(uuid.uuid5(uuid.NAMESPACE_URL, json.dumps(api, sort_keys=True))), "revision": 0,
            "last_node_id": last + len(notes), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 0.7, "offset": [30, 30]}}, "version": 0.4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("api", type=Path)
    parser.add_argument("--object-info", default="http://127.0.0.1:8188")
    parser.add_argument("--note", nargs=2, action="append", default=[], metavar=("TITLE", "TEXT"))
    args = parser.parse_args()
    ui = build(json.loads(args.api.read_text()), args.object_info, [tuple(n) for n in args.note])
    folder = args.api.parent.parent if args.api.parent.name == "api" else args.api.parent  # workflows/api/ → workflows/
    (folder / args.api.name.replace(".api.json", ".json")).write_text(json.dumps(ui, indent=1) + "\n")


if __name__ == "__main__":
    main()
