"""xDiT LTX-2 Guidance: an xDiT model with LTX-2's guidance beyond CFG (MODEL in, MODEL out, as ComfyUI's
LTXVSpatioTemporalGuidance and LTXVModalityGuidance patch its model; LTXVDualCFGGuider's audio scale beside them). The
passes run on the backend (xdit_backend/sampling/guidance.py), spread over the CFG-parallel GPUs."""

from __future__ import annotations

from comfy_api.latest import io

from .choices import ModelChoice
from .comfy_types import CATEGORY, XDiTModel


class XDiTLTX2Guidance(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTLTX2Guidance",
            display_name="xDiT LTX-2 Guidance",
            category=CATEGORY,
            description="LTX-2's guidance beyond CFG, as ComfyUI's LTXV nodes give it: the audio at its own CFG "
                        "scale (LTXV Dual CFG Guider), spatio-temporal guidance (STG: a pass with some blocks' "
                        "self-attention a value passthrough) and modality guidance (a pass with the audio-video "
                        "attention cut). Each extra pass is one more model call a step; with CFG parallel the "
                        "passes are shared by the two GPU groups. Between the xDiT loader and the sampler.",
            inputs=[
                XDiTModel.Input("model"),
                io.Float.Input("audio_cfg", default=0.0, min=0.0, max=100.0, step=0.1,
                               tooltip="the audio's CFG scale (the sampler's cfg is the video's); 0: the sampler's "
                                       "cfg for both (LTXV Dual CFG Guider's audio_cfg: 7)"),
                io.Float.Input("stg_scale", default=0.0, min=0.0, max=100.0, step=0.01,
                               tooltip="spatio-temporal guidance; 0: off (LTXV Spatio-Temporal Guidance's scale)"),
                io.String.Input("stg_blocks", default="29", tooltip="the blocks STG perturbs, comma-separated"),
                io.Float.Input("stg_start_percent", default=0.0, min=0.0, max=1.0, step=0.001),
                io.Float.Input("stg_end_percent", default=1.0, min=0.0, max=1.0, step=0.001),
                io.Float.Input("modality_scale", default=1.0, min=1.0, max=100.0, step=0.1,
                               tooltip="modality guidance (audio-video sync); 1: off (LTXV Modality Guidance's "
                                       "reference default: 3)"),
                io.Float.Input("modality_start_percent", default=0.0, min=0.0, max=1.0, step=0.001),
                io.Float.Input("modality_end_percent", default=1.0, min=0.0, max=1.0, step=0.001),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def choice(cls, model: ModelChoice, audio_cfg, stg_scale, stg_blocks, stg_start_percent, stg_end_percent,
               modality_scale, modality_start_percent, modality_end_percent) -> ModelChoice:
        return model.with_guidance(audio_cfg=audio_cfg or None, stg_scale=stg_scale, stg_blocks=stg_blocks,
                                   stg_start=stg_start_percent, stg_end=stg_end_percent,
                                   modality_scale=modality_scale, modality_start=modality_start_percent,
                                   modality_end=modality_end_percent)

    @classmethod
    def fingerprint_inputs(cls, model, **values):
        return cls.choice(model, **values).fingerprint()

    @classmethod
    def execute(cls, model, **values) -> io.NodeOutput:
        return io.NodeOutput(cls.choice(model, **values))
