"""xDiT Backend: what the backend is doing (its GPUs, their memory, the models loaded and what each
holds per rank, when it unloads or stops by itself), and unloading models or stopping it."""

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
            description="Shows the xDiT backend's GPUs with their memory, and its loaded models with what each "
                        "holds per GPU; can unload them or stop the backend (the next xDiT Sampler run starts it "
                        "again).",
            inputs=[io.Combo.Input("action", options=ACTIONS),
                    io.Latent.Input("after", optional=True,
                                    tooltip="connect a sampler's LATENT to report the backend as that run left it "
                                            "(ComfyUI then runs this node after the sampler; unconnected, it may "
                                            "run first)")],
            outputs=[io.String.Output(display_name="status")],
            is_output_node=True,
            not_idempotent=True,
        )

    @classmethod
    def fingerprint_inputs(cls, action, after=None):
        return float("nan")  # never cached: the backend's state changes outside the graph

    @classmethod
    def execute(cls, action, after=None) -> io.NodeOutput:
        from xdit_backend.client import Client
        from xdit_backend.launch.status_text import describe
        from xdit_backend.wire.paths import default_socket

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

