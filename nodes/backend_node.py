"""xDiT Backend: what the backend is doing, and unloading models or stopping it."""

from __future__ import annotations

from comfy_api.latest import io, ui

from .comfy_types import CATEGORY

ACTIONS = ["status", "unload models", "stop backend"]


class XDiTBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTBackend",
            display_name="xDiT Backend",
            category=CATEGORY,
            description="Shows the xDiT backend's GPUs and loaded models; can unload them or stop the backend "
                        "(the next xDiT Sampler run starts it again).",
            inputs=[io.Combo.Input("action", options=ACTIONS)],
            outputs=[io.String.Output(display_name="status")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, action):
        return float("nan")  # never cached: the backend's state changes outside the graph

    @classmethod
    def execute(cls, action) -> io.NodeOutput:
        from xdit_backend.client import Client
        from xdit_backend.paths import default_socket

        client = Client(default_socket())
        if client.hello_or_none() is None:
            text = f"no backend at {client.socket_path}: the first xDiT Sampler run starts one"
        elif action == "unload models":
            text = "unloaded: " + (", ".join(client.unload()) or "nothing was loaded")
        elif action == "stop backend":
            client.shutdown()
            text = "backend stopped; the next xDiT Sampler run starts it again"
        else:
            text = describe(client.status())
        return io.NodeOutput(text, ui=ui.PreviewText(text))


def describe(status: dict) -> str:
    ranks = status.get("ranks", [])
    devices = ", ".join(f"rank {r['rank']}: {_device(r)}" for r in ranks)
    models = "\n  ".join(status.get("models", [])) or "none"
    return (f"xDiT backend {status.get('version')} (pid {status.get('pid')}), world size {status.get('world_size')}, "
            f"attention {status.get('attention_kernel')}, up {status.get('uptime_s', 0):.0f} s\n"
            f"{devices}\nmodels loaded:\n  {models}")


def _device(rank: dict) -> str:
    """``cuda:0 = GPU 3 (NVIDIA H100 …, GPU-8f1…)``: the rank's local device and the physical GPU
    (nvidia-smi's number or CUDA_VISIBLE_DEVICES's entry) it is."""
    if rank.get("gpu") is None:
        return f"{rank['device']} ({rank['device_name']})"
    uuid = f", {rank['uuid']}" if rank.get("uuid") else ""
    return f"{rank['device']} = GPU {rank['gpu']} ({rank['device_name']}{uuid})"
