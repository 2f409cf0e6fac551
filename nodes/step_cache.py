"""xDiT Step Cache: an xDiT model with the backend's step cache switched on (MODEL in, MODEL out, as
ComfyUI's own cache nodes attach to the model). The cache itself is xdit_backend/parallel/step_cache.py."""

from __future__ import annotations

from comfy_api.latest import io

from xdit_backend import schema

from .choices import ModelChoice
from .comfy_types import CATEGORY, XDiTModel

METHODS = [method for method in schema.CACHE_METHODS if method != "none"]  # no cache: leave the node out
DEFAULTS = ", ".join(f"{method} {threshold}" for method, threshold in schema.CACHE_THRESHOLDS.items())


class XDiTStepCache(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        threshold, start, end = (schema.FIELDS[name] for name in ("cache_threshold", "cache_start", "cache_end"))
        return io.Schema(
            node_id="XDiTStepCache",
            display_name="xDiT Step Cache",
            category=CATEGORY,
            description="Skips the transformer blocks after the first on steps where they barely change, on "
                        "every GPU at once: faster, slightly different from the uncached picture. Put it between "
                        "the xDiT loader (or LoRA) and the sampler; bypass it for the uncached run.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("cache", options=METHODS, default=METHODS[0],
                               tooltip="fbcache: reuse while the first block's output changes little; teacache: "
                                       "while the time embedding's change, added up over the steps, stays small"),
                io.Float.Input("threshold", default=0.0, min=threshold.low, max=threshold.high, step=0.01,
                               tooltip=f"0: the method's default ({DEFAULTS}). Higher reuses more steps (faster) "
                                       "and moves further from the uncached picture; lower stays closer to it."),
                io.Int.Input("start", default=start.default, min=start.low, max=start.high,
                             tooltip="steps always computed at the start (they set the composition); "
                                     "higher is closer to the uncached picture, lower reuses more"),
                io.Int.Input("end", default=end.default, min=end.low, max=end.high,
                             tooltip="steps always computed at the end (they set the finest detail); "
                                     "higher is closer to the uncached picture, lower reuses more"),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def choice(cls, model: ModelChoice, cache: str, threshold: float, start: int, end: int) -> ModelChoice:
        return model.with_cache(cache, threshold or None, start, end)

    @classmethod
    def fingerprint_inputs(cls, model, cache, threshold, start, end):
        return cls.choice(model, cache, threshold, start, end).fingerprint()

    @classmethod
    def execute(cls, model, cache, threshold, start, end) -> io.NodeOutput:
        return io.NodeOutput(cls.choice(model, cache, threshold, start, end))
