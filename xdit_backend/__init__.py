"""xdit_backend: the multi-process parallel denoising backend behind the comfyui-xdit nodes.

Importing this package does nothing but define names; torch and diffusers load on first use.
"""

__version__ = "0.1.0"
