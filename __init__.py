"""comfyui-xdit: ComfyUI entry point.

ComfyUI imports this file as a package at start-up and then calls ``comfy_entrypoint`` (its V3
node API). Importing it starts no process, opens no socket, touches no GPU and imports no torch;
the node definitions are imported when ComfyUI asks for them, the backend when a node first runs.
"""

from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./web"  # web/xdit.js: the text the xDiT nodes return (status, the layout that ran) shown on them

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
