"""Wan 2.1 VACE (1.3B, 14B): diffusers ``WanVACETransformer3DModel``, a Wan transformer with VACE blocks beside it,
fed as ComfyUI feeds its VaceWanModel (shared snapshot v0.3.64: comfy/model_base.py ``WAN21_Vace.extra_conds``,
comfy/ldm/wan/model.py ``VaceWanModel``, comfy_extras/nodes_wan.py ``WanVaceToVideo``).

WanVaceToVideo puts on the conditioning ``vace_frames`` [B, 32, T, h, w] (the control video's VAE latent twice:
where the mask keeps it and where it asks for it to be made, raw; a reference image's latent as its first frames),
``vace_mask`` [B, 64, T, h, w] (the pixel mask folded 8 × 8 into channels) and ``vace_strength``. The model puts
each 16 channels of the frames in model space, appends the mask (96 channels), embeds them with its own patch
convolution and runs its VACE blocks — Wan blocks whose first adds the embedded noisy latent — over those tokens,
at the model's positions and time, with the prompt; each VACE block's output, times the strength, is added to the
image tokens after the model block it belongs to (every num_layers / vace_blocks-th, from 0). Without them
ComfyUI uses zeros for the frames (in model space: not zero) and ones for the mask.

Under sequence parallelism the control tokens are cut as the image's (the same frames × rows × columns grid), the
VACE blocks' self-attention runs through the same sequence-parallel kernel, and each rank adds its share of the
hints: nothing is gathered for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Cut, SequencePlan
from .wan import WanModel, WanProcessor, WanSpec

FRAME_CHANNELS, MASK_CHANNELS = 32, 64  # WanVaceToVideo's: the inactive and reactive latents, the 8×8 mask


@dataclass(frozen=True)
class WanVaceSpec(WanSpec):
    vace_layers: tuple[int, ...] = ()  # the model blocks after which the VACE blocks' hints are added

    family = "wan_vace"
    # the VACE inputs as WanVaceToVideo puts them on the conditioning (one control video: lists of one); a VACE
    # model is text to video: an image-to-video node's inputs are refused by name
    comfy_conditioning = {"vace_frames": "vace_frames", "vace_mask": "vace_mask", "vace_strength": "vace_strength"}
    # the xDiT MODEL's calls: ComfyUI's WAN21_Vace has made vace_context (in model space, one control video) and
    # vace_strength from them (comfy/model_base.py extra_conds)
    comfy_model_inputs = {**WanSpec.comfy_model_inputs, "vace_context": "vace_context",
                          "vace_strength": "vace_strength"}
    # the VACE blocks add their hints between the model's blocks, inside one transformer call: no PipeFusion yet
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses"})
    # Wan's cuts, and the first VACE block's inputs: the embedded latent (its arg 0) and the control tokens (arg 2)
    sequence_plan = SequencePlan(cuts=(*WanSpec.sequence_plan.cuts, Cut("vace_blocks.0", 0, 1),
                                       Cut("vace_blocks.0", 2, 1)),  # [B, N, D] each
                                 attention=(("attn1", WanProcessor),))
    # the hints are added after the blocks, in the transformer's loop: a reused step would add them twice
    step_cache_refusal = "VACE adds its hints after the blocks, in the transformer's own loop"

    @classmethod
    def from_config(cls, config: dict) -> WanVaceSpec:
        base = WanSpec.from_config(config)
        return cls(base.context_dim, base.heads, base.blocks, base.channels, base.in_channels,
                   tuple(config["vace_layers"]))

    @property
    def optional_conditioning(self) -> tuple[str, ...]:
        return (*super().optional_conditioning, "vace_frames", "vace_mask", "vace_strength", "vace_context")

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        return {**super().conditioning_shapes(batch, text_tokens),
                "vace_frames": (batch, FRAME_CHANNELS, None, None, None),  # raw latents, the latent's size
                "vace_mask": (batch, MASK_CHANNELS, None, None, None),
                "vace_strength": (batch,),
                # or both as ComfyUI's model call brings them: the frames in model space and the mask, concatenated
                "vace_context": (batch, FRAME_CHANNELS + MASK_CHANNELS, None, None, None)}


class WanVaceModel(WanModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._strength: torch.Tensor | None = None  # the running call's strength per row [B]
        for block in self.transformer.vace_blocks:  # once: a compiled block's hooks never change
            block.register_forward_hook(self._scaled)

    def extra_inputs(self, x, cond) -> dict:
        """The control video [B, 96, T, h, w] and, per row, its strength (applied to each hint: ``_scaled``)."""
        b = x.shape[0]
        strength = cond.get("vace_strength")
        self._strength = (torch.ones(b, device=self.device) if strength is None
                          else strength.to(self.device, torch.float32).reshape(b))
        return {"control_hidden_states": self.vace_context(x.shape, cond),
                "control_hidden_states_scale": torch.ones(len(self.spec.vace_layers), device=self.device)}

    def vace_context(self, shape, cond) -> torch.Tensor:
        """WAN21_Vace.extra_conds' vace_context for a latent of ``shape``: each 16 channels of the frames in model
        space (zeros without them), then the mask (ones without it): [B, 96, T, h, w] in the model's dtype; as it
        is when a model call brings it made."""
        made = cond.get("vace_context")
        if made is not None:
            return made.to(self.device, self.dtype)
        b, _, frames, h, w = shape
        video = cond.get("vace_frames")
        video = (torch.zeros(b, FRAME_CHANNELS, frames, h, w, device=self.device) if video is None
                 else video.to(self.device, torch.float32, copy=True))
        for start in range(0, FRAME_CHANNELS, 16):
            video[:, start:start + 16] = self.latent_format.process_in(video[:, start:start + 16])
        mask = cond.get("vace_mask")
        mask = (torch.ones(b, MASK_CHANNELS, frames, h, w, device=self.device) if mask is None
                else mask.to(self.device, torch.float32))
        return torch.cat([video, mask], dim=1).to(self.dtype)

    def _scaled(self, block, args, out):
        """A VACE block's hint [B, n, D] times its row's strength (ComfyUI's ``c_skip * vace_strength``)."""
        hint, states = out
        return hint * self._strength.to(hint.dtype).view(-1, 1, 1), states
