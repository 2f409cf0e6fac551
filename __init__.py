"""comfyui-xdit: ComfyUI entry point.

ComfyUI imports this file as a package at start-up and then calls ``comfy_entrypoint`` (its V3
node API). Importing it starts no process, opens no socket, touches no GPU and imports no torch;
the node definitions are imported when ComfyUI asks for them, the backend when a node first runs.
"""

# ComfyUI imports this folder as a package. pytest imports this file as well (the folder is the tests' rootdir),
# alone, outside any package, where the folder's name is no Python name (a clone named comfyui-xdit).
if __package__:
    from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./web"  # web/xdit.js: the text the xDiT nodes return (status, the layout that ran) shown on them

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
