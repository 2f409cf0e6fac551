"""Draw each workflow's thumbnail for ComfyUI's template browser, ``workflows/<name>.jpg`` beside ``<name>.json``
(ComfyUI shows a same-named .jpg as a custom node template's thumbnail).

    python tools/workflow_thumbnails.py [workflows/NAME.json ...]   # default: every UI workflow

The picture is the workflow's own graph, laid out as on the canvas: its nodes (the xDiT nodes in blue, notes in
yellow), their titles, and the links between them coloured by type, under the workflow's name. Each JPEG's comment
holds the SHA-256 of the UI file it was drawn from: tests/unit/test_workflow_list.py fails when a workflow changed
and its thumbnail was not drawn again.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
SIZE = (512, 384)
HEADER = 44  # pixels above the graph: the workflow's name
MARGIN = 14
BACKGROUND, NODE, XDIT, NOTE, TEXT = "#202020", "#353535", "#2a4d7a", "#5a5220", "#e8e8e8"
LINK_COLOURS = {"LATENT": "#ff9cf9", "CONDITIONING": "#ffa931", "MODEL": "#b39ddb", "XDIT_MODEL": "#7fb3ff",
                "CLIP": "#ffd500", "VAE": "#ff6e6e", "IMAGE": "#64b5f6", "SIGMAS": "#cdffcd"}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def render(workflow: dict, name: str, titles: dict[int, str] | None = None) -> Image.Image:
    """The graph of a UI workflow, fitted into SIZE below its name; ``titles``: each node's title by id (its API
    twin's, "xDiT Load Diffusion Model"), else the node's type."""
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.text((MARGIN, 12), name, fill=TEXT, font=ImageFont.load_default(20))
    nodes = {node["id"]: node for node in workflow["nodes"]}
    left = min(node["pos"][0] for node in nodes.values())
    top = min(node["pos"][1] for node in nodes.values())
    right = max(node["pos"][0] + node["size"][0] for node in nodes.values())
    bottom = max(node["pos"][1] + node["size"][1] for node in nodes.values())
    scale = min((SIZE[0] - 2 * MARGIN) / (right - left), (SIZE[1] - HEADER - MARGIN) / (bottom - top))

    def at(x: float, y: float) -> tuple[float, float]:
        return MARGIN + (x - left) * scale, HEADER + (y - top) * scale

    for _, source, source_slot, target, target_slot, kind in workflow["links"]:
        a, b = nodes[source], nodes[target]
        start = at(a["pos"][0] + a["size"][0], a["pos"][1] + 20 + 20 * source_slot)
        end = at(b["pos"][0], b["pos"][1] + 20 + 20 * target_slot)
        draw.line([start, end], fill=LINK_COLOURS.get(kind, "#9e9e9e"), width=2)
    font = ImageFont.load_default(max(9, int(13 * min(1.0, scale * 2.2))))
    for node in nodes.values():
        x0, y0 = at(*node["pos"])
        x1, y1 = at(node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
        fill = NOTE if node["type"] == "Note" else XDIT if node["type"].startswith("XDiT") else NODE
        draw.rounded_rectangle([x0, y0, x1, y1], radius=4, fill=fill, outline="#111111")
        title = node.get("title") or (titles or {}).get(node["id"]) or node["type"]
        while title and draw.textlength(title, font=font) > x1 - x0 - 6:
            title = title[:-1]
        draw.text((x0 + 3, y0 + 2), title, fill=TEXT, font=font)
    return image


def write(path: Path) -> Path:
    """Draw ``path``'s thumbnail beside it; its comment: the drawn file's digest."""
    target = path.with_suffix(".jpg")
    twin = path.parent / "api" / f"{path.stem}.api.json"
    titles = ({int(key): node.get("_meta", {}).get("title") for key, node in json.loads(twin.read_text()).items()}
              if twin.exists() else {})
    render(json.loads(path.read_text()), path.stem, titles).save(target, "JPEG", quality=85,
                                                                comment=digest(path).encode())
    return target


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted(WORKFLOWS.glob("*.json"))
    for path in paths:
        print(f"wrote {write(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
