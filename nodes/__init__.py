"""The pack's ComfyUI nodes. They translate between ComfyUI types and xdit_backend.client, nothing else.

This package is imported relatively by the pack's root ``__init__.py``, never as a top-level
``nodes`` (that name is ComfyUI's own module). ComfyUI calls ``comfy_entrypoint`` at start-up;
only then are the node definitions (and ComfyUI's V3 node API) imported, and the observer of
ComfyUI's ``POST /free`` installed (free_hook.py).
"""


async def comfy_entrypoint():
    from .extension import XDiTExtension
    from .free_hook import install_on_comfyui

    install_on_comfyui()  # ComfyUI's "unload models" (POST /free) unloads the backend's too
    return XDiTExtension()
