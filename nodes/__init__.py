"""The pack's ComfyUI nodes. They translate between ComfyUI types and xdit_backend.client, nothing else.

This package is imported relatively by the pack's root ``__init__.py``, never as a top-level
``nodes`` (that name is ComfyUI's own module). The sampler, loader, parallel-config and backend
nodes are registered here as they land; until then the pack loads and registers none.
"""

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}
