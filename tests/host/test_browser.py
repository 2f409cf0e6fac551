"""The page as a user sees it, in headless Chromium (the system's package; skipped with the reason where it is not
installed): ComfyUI's page opens with the pack loaded, a template loads through the template browser's route, runs,
and the xDiT Sampler shows the layout it ran on the node (web/xdit.js). The screenshot is kept beside the test's
files; with XDIT_SCREENSHOTS=DIR it is also written there (the README's pictures: docs/images)."""

import base64
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from host.conftest import COMFYUI_DIR, FLUX_TINY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.skipif(not COMFYUI_DIR, reason="needs a ComfyUI checkout: set COMFYUI_DIR (README, the tests)"),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium here (Debian: apt install chromium); the page's checks "
                                                "run where it is installed"),
]


class Page:
    """One Chromium tab over the DevTools protocol."""

    def __init__(self, port: int):
        import websocket

        for _ in range(120):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json", timeout=2) as reply:
                    target = next(t for t in json.loads(reply.read()) if t["type"] == "page")
                break
            except (OSError, StopIteration):
                time.sleep(0.5)
        else:
            raise AssertionError("Chromium's DevTools did not answer")
        self.ws = websocket.create_connection(target["webSocketDebuggerUrl"], timeout=300, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                return message.get("result", {})

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression[:80]}…: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, seconds: float = 120):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {expression}")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


def keep_screenshot(page: Page, path: Path) -> Path:
    """The page as it is now, at ``path``; with XDIT_SCREENSHOTS=DIR also in DIR (the README's: docs/images)."""
    page.screenshot(path)
    if os.environ.get("XDIT_SCREENSHOTS"):
        shutil.copy(path, Path(os.environ["XDIT_SCREENSHOTS"]) / path.name)
    return path


@pytest.fixture
def page(host, tmp_path):
    port = free_port()
    browser = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1500,900",
                                f"--remote-debugging-port={port}", "--remote-allow-origins=*",
                                f"--user-data-dir={tmp_path / 'profile'}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tab = Page(port)
        tab.call("Page.enable")
        tab.call("Page.navigate", url=host.url)
        tab.wait_for("!!(window.app && window.app.graph && window.app.graph.configure)")
        yield tab
    finally:
        browser.terminate()
        browser.wait(timeout=30)


def test_a_template_loads_runs_and_its_sampler_shows_the_layout_on_the_node(page, host, tmp_path):
    name = FLUX_TINY
    count = page.evaluate(f"""(async () => {{
        const reply = await fetch("/api/workflow_templates/comfyui-xdit/{name}.json");
        await window.app.loadGraphData(await reply.json());
        return window.app.graph._nodes.length; }})()""")
    assert count == len(json.loads((Path(__file__).resolve().parents[2] / "workflows" / f"{name}.json")
                                   .read_text())["nodes"])
    page.evaluate("""(() => {  // the first visit's "Get Started with a Template" dialog, then the graph in view
        document.querySelectorAll(".p-dialog-header-close, .p-dialog-close-button").forEach((b) => b.click());
        const commands = window.app.extensionManager && window.app.extensionManager.command;
        if (commands) commands.execute("Comfy.Canvas.FitView");
        return true; })()""")
    page.evaluate("window.app.queuePrompt(0, 1).then(() => true)")
    text = page.wait_for("""(() => {
        const node = window.app.graph._nodes.find((n) => n.type === "XDiTSampler");
        const widget = node && node.widgets && node.widgets.find((w) => w.name === "xdit_status");
        return widget ? widget.value : null; })()""", seconds=300)
    assert "world" in text and "s," in text, text  # the layout that ran, its time
    waits = page.evaluate("""window.app.graph._nodes.find((n) => n.type === "XDiTSampler").widgets
        .filter((w) => w.name === "$$node-text-preview").length""")
    assert waits == 0  # the waits' last line ("loading …") is gone once the node shows what ran
    time.sleep(1)  # the canvas draws the widget on its next frame
    assert keep_screenshot(page, tmp_path / "xdit-tiny-ran.png").stat().st_size > 10_000


def test_the_template_browser_shows_each_workflow_by_its_name_with_its_thumbnail(page, tmp_path):
    """Issue 30: ComfyUI's template browser, opened as a user opens it, lists the pack's workflows (only the UI files),
    each card titled by its name (<family>_<what it makes>_<GPUs>: the page shows nothing else of a custom node's
    template) with its thumbnail loaded; one found by the search box and clicked is on the canvas."""
    expected = sorted(path.stem for path in (Path(__file__).resolve().parents[2] / "workflows").glob("*.json"))
    page.evaluate("""(() => {
        document.querySelectorAll(".p-dialog-header-close, .p-dialog-close-button").forEach((b) => b.click());
        window.app.extensionManager.command.execute("Comfy.BrowseTemplates");
        return true; })()""")
    page.wait_for("""(() => { const item = [...document.querySelectorAll("li, [role=option], a, button, span")]
        .find((e) => e.textContent.trim() === "comfyui-xdit"); if (item) item.click(); return !!item; })()""")
    # the cards are drawn as they scroll into view: those drawn are the pack's, each titled by its name, its
    # description that name in words (the page's own), the thumbnails in view loaded (512 × 384: workflow_thumbnails.py)
    shown = page.wait_for("""(() => {
        const dialog = document.querySelector(".p-dialog");
        const thumbnails = [...dialog.querySelectorAll("img")].filter((i) => i.naturalWidth === 512 && i.naturalHeight === 384);
        return thumbnails.length >= 3 ? {text: dialog.innerText, thumbnails: thumbnails.length} : null; })()""", seconds=60)
    titles = [line.strip() for line in shown["text"].splitlines() if line.strip() in expected]
    assert len(titles) >= 3  # and the thumbnails in view loaded (the others load as they scroll into it)
    assert not [line for line in shown["text"].splitlines() if line.strip().endswith(".api")]  # no API twin
    assert all(title.replace("-", " ").replace("_", " ") in shown["text"] for title in titles)
    time.sleep(1)
    keep_screenshot(page, tmp_path / "template-browser.png")
    # a card opened as a user opens one: found by the browser's search box, clicked, its workflow on the canvas
    name = "flux1-dev_text-to-image_all-gpus"
    page.evaluate(f"""(() => {{
        const search = document.querySelector(".p-dialog input[placeholder^='Search']");
        search.value = "{name}";
        search.dispatchEvent(new Event("input", {{bubbles: true}}));
        return true; }})()""")
    page.wait_for(f"""(() => {{ const title = [...document.querySelectorAll(".p-dialog *")]
        .find((e) => e.children.length === 0 && e.textContent.trim() === "{name}");
        if (title) title.click(); return !!title; }})()""", seconds=30)
    nodes = len(json.loads((Path(__file__).resolve().parents[2] / "workflows" / f"{name}.json").read_text())["nodes"])
    page.wait_for(f"""!document.querySelector(".p-dialog") && window.app.graph._nodes.length === {nodes}
        && window.app.graph._nodes.some((n) => n.type === "XDiTSampler")""", seconds=30)
    page.evaluate("""(() => {  // at a zoom where the canvas draws text (fitting it all would draw boxes only)
        const canvas = window.app.canvas, nodes = window.app.graph._nodes;
        const left = Math.min(...nodes.map((n) => n.pos[0])), top = Math.min(...nodes.map((n) => n.pos[1]));
        canvas.ds.scale = 0.8;
        canvas.ds.offset = [20 / 0.8 - left, 110 / 0.8 - top];  // screen = (graph + offset) · scale
        canvas.setDirty(true, true);
        return true; })()""")
    time.sleep(1)
    keep_screenshot(page, tmp_path / "flux1-dev-workflow.png")
