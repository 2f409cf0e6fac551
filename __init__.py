"""comfyui-xdit: ComfyUI entry point.

ComfyUI imports this file as a package at start-up. It only defines the node mappings: no
process, socket, CUDA call or environment change happens here, and the backend package is
imported by the nodes when they first run.
"""

from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
