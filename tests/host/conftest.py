"""The real ComfyUI for the tests in this folder: one headless host per pytest worker, shared by
test_comfyui_host.py and test_workflows.py (they run on one worker, tests/conftest.py's GROUPS), started by the
first test that asks for it.

ComfyUI runs on the CPU from a private base directory with the pack linked into its custom_nodes, and the pack's
backend uses a private socket.
"""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / "workflows"
FLUX_TINY = "test-flux-tiny_latent-no-downloads_all-gpus"  # the built-in test models' workflows: no model files
QWEN_TINY = "test-qwen-image-tiny_latent-no-downloads_all-gpus"
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")


class Host:
    """A running ComfyUI: the HTTP API and its websocket, as a client of POST /prompt sees them."""

    def __init__(self, base: Path, port: int, process: subprocess.Popen):
        self.base, self.port, self.process = base, port, process
        self.url = f"http://127.0.0.1:{port}"
        self.client_id = uuid.uuid4().hex

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict):
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                text = response.read()
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"POST {path}: {exc.code} {exc.read().decode()}") from None
        return json.loads(text) if text else None

    def queue(self, prompt: dict) -> str:
        return self.post("/prompt", {"prompt": prompt, "client_id": self.client_id})["prompt_id"]

    def follow(self, prompt_id: str, timeout: float = 300, on_progress=None) -> tuple[str, list]:
        """Websocket messages for the prompt until it ends: ("success" | "error" | "interrupted", progress)."""
        import websocket

        ws = websocket.create_connection(f"ws://127.0.0.1:{self.port}/ws?clientId={self.client_id}", timeout=timeout)
        progress, deadline, finished = [], time.monotonic() + timeout, False
        try:
            while time.monotonic() < deadline:
                if not finished and self.history(prompt_id):
                    # Finished, perhaps before we listened: read what is still queued, then stop when the
                    # socket goes quiet (breaking at once lost the last progress events under load).
                    finished = True
                    ws.settimeout(2.0)
                try:
                    message = ws.recv()
                except websocket.WebSocketTimeoutException:
                    break
                if not isinstance(message, str):
                    continue  # previews are binary
                event = json.loads(message)
                data = event.get("data", {})
                if data.get("prompt_id") not in (None, prompt_id):
                    continue
                if event["type"] == "progress":
                    progress.append((data["value"], data["max"]))
                    if on_progress:
                        on_progress(data)
                elif event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                    break
        finally:
            ws.close()
        for _ in range(100):
            record = self.history(prompt_id)
            if record and record.get("status", {}).get("completed") is not None:
                break
            time.sleep(0.1)
        status = record["status"]
        messages = [kind for kind, _ in status.get("messages", [])]
        outcome = ("success" if status["status_str"] == "success" else
                   "interrupted" if "execution_interrupted" in messages else "error")
        return outcome, progress

    def history(self, prompt_id: str) -> dict | None:
        return self.get(f"/history/{prompt_id}").get(prompt_id)

    def why(self, prompt_id: str) -> str:
        """The execution error of a prompt, for assertion messages."""
        for kind, data in self.history(prompt_id)["status"]["messages"]:
            if kind == "execution_error":
                return f"{data['node_type']}: {data['exception_message']}"
        return str(self.history(prompt_id)["status"])

    def error_of(self, prompt_id: str) -> dict:
        for kind, data in self.history(prompt_id)["status"]["messages"]:
            if kind == "execution_error":
                return data
        raise AssertionError("no execution_error recorded")

    def latest_latent(self, prefix: str) -> torch.Tensor:
        from safetensors.torch import load_file

        files = sorted((self.base / "output").rglob(f"{prefix}*.latent"), key=lambda p: p.stat().st_mtime)
        return load_file(str(files[-1]))["latent_tensor"]


def tiny_sd3_file(path: Path) -> None:
    """An SD3-medium-style model small enough for the CPU, in the original key layout, that
    ComfyUI's own loader detects (its rule: width = 64 × depth)."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file
    from unit.test_sd3_checkpoint import original_state_dict

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                                  attention_head_dim=64, num_attention_heads=2, joint_attention_dim=64,
                                  caption_projection_dim=128, pooled_projection_dim=32, pos_embed_max_size=32)
    save_file(original_state_dict(model), str(path))


def start_comfyui(base: Path, env: dict, log_path: Path):
    """ComfyUI headless on a free port, waited for: ``(Host, log)``, or ``(None, log)`` when it exited before
    answering; raises when it neither answers nor exits within two minutes."""
    port = free_port()
    log = open(log_path, "w")
    process = subprocess.Popen(
        [os.environ.get("COMFYUI_PYTHON", sys.executable), "main.py", "--cpu", "--listen", "127.0.0.1",
         "--port", str(port), "--base-directory", str(base), "--database-url", "sqlite:///:memory:"],
        cwd=COMFYUI_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)
    host = Host(base, port, process)
    deadline = time.monotonic() + 120
    while True:
        try:
            host.get("/system_stats")
            return host, log
        except OSError:
            if process.poll() is not None:
                return None, log
            if time.monotonic() > deadline:
                process.kill()
                raise AssertionError("ComfyUI did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.5)


@pytest.fixture(scope="session")
def host(tmp_path_factory):
    base = tmp_path_factory.mktemp("comfyui-base")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "comfyui-xdit").symlink_to(ROOT)
    (base / "models" / "diffusion_models").mkdir(parents=True)
    tiny_sd3_file(base / "models" / "diffusion_models" / "tiny-sd3.safetensors")
    sock_dir = Path(f"/tmp/xdit-host-{uuid.uuid4().hex[:8]}")
    env = {**os.environ, "XDIT_SOCKET": str(sock_dir / "backend.sock")}
    log_path = base / "comfyui.log"
    # A free port is free when asked, not when ComfyUI binds it: another test's process (a backend's TCP store,
    # a client's ephemeral port) may take it in between. ComfyUI then exits at once; start it on a new port.
    for _ in range(5):
        host, log = start_comfyui(base, env, log_path)
        if host is not None:
            break
        log.close()
        if "address already in use" not in log_path.read_text():
            raise AssertionError("ComfyUI did not start:\n" + log_path.read_text()[-3000:])
    else:
        raise AssertionError("ComfyUI found no free port in 5 tries:\n" + log_path.read_text()[-3000:])
    host.socket = sock_dir / "backend.sock"  # the backend the pack's nodes start and use
    yield host
    host.process.terminate()
    host.process.wait(timeout=30)
    from xdit_backend.launch import launcher

    launcher.stop(sock_dir / "backend.sock", timeout=15)
    log.close()


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    """ComfyUI imported into this process (on the CPU) and the pack as the package ``comfyui_xdit``, as ComfyUI
    imports it from custom_nodes."""
    import sys

    packages = tmp_path_factory.mktemp("packages")
    (packages / "comfyui_xdit").symlink_to(ROOT)
    sys.path[:0] = [COMFYUI_DIR, str(packages)]
    from comfy.cli_args import args

    args.cpu = True
    import importlib

    return tuple(importlib.import_module(f"comfyui_xdit.nodes.{name}") for name in ("remote_model", "choices"))
