"""A fake family spec that declares every kind of conditioning the new families need, for the request
and translation tests (tests/unit/test_conditioning_request.py, tests/unit/test_translate.py)."""

from dataclasses import dataclass

from xdit_backend.models.base import CachePlan, FamilySpec, SequencePlan, StagePlan
from xdit_backend.models.latent_formats import LatentFormat


@dataclass(frozen=True)
class EditSpec(FamilySpec):
    """Two text encoders (the second of any length, like HunyuanDiT's mT5), an optional glyph text
    (like HunyuanVideo 1.5's byT5) and reference latents (like Qwen-Image-Edit)."""

    family = "fake-edit"
    latent_format = LatentFormat(channels=16, scale=1.0)
    parallel_methods = ("ulysses",)
    sequence_plan = SequencePlan(cuts=(), attention=())
    stage_plan = StagePlan(block_lists=(), attention=())
    cache_plan = CachePlan(blocks=(), returns={}, probe="temb", teacache=(1.0, 0.0))
    optional_conditioning = ("context_mask", "context_mt5_mask", "glyph")
    comfy_conditioning = {"attention_mask": "context_mask", "conditioning_mt5xl": "context_mt5",
                          "attention_mask_mt5xl": "context_mt5_mask", "conditioning_glyph": "glyph"}
    takes_references = True
    heads: int = 2
    blocks: int = 1

    @classmethod
    def from_config(cls, config):
        return cls()

    def model_sampling(self, shift):
        raise NotImplementedError

    def conditioning_shapes(self, batch, text_tokens):
        return {"context": (batch, text_tokens, 8), "pooled": (batch, 4), "context_mt5": (batch, None, 6),
                "glyph": (batch, None, 3)}
