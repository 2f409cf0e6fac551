"""The pack's own ComfyUI socket types."""

from comfy_api.latest import io

XDiTModel = io.Custom("XDIT_MODEL")  # nodes/choices.ModelChoice
XDiTParallel = io.Custom("XDIT_PARALLEL")  # nodes/choices.ParallelChoice
CATEGORY = "sampling/xDiT"
