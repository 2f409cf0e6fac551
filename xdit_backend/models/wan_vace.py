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

Several WanVaceToVideo chained put a list of each (an entry per control video); the model runs its VACE blocks on
each entry's tokens on its own and adds every entry's hint times its strength (VaceWanModel.forward_orig). Here
the entries travel side by side in the channels (``vace_frames`` [B, 32·E, T, h, w], ``vace_mask`` [B, 64·E, …],
``vace_strength`` [B, E]; a model call's ``vace_context`` [B, 96·E, …]) and run folded into the batch: the VACE
patch embedding and blocks see B·E rows (each entry beside the model's own row), and each block's hints are summed
over the entries, times their strengths, into the model's B rows (hooks on diffusers' modules).

Under sequence parallelism the control tokens are cut as the image's (the same frames × rows × columns grid), the
VACE blocks' self-attention runs through the same sequence-parallel kernel, and each rank adds its share of the
hints: nothing is gathered for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from .base import Cut, SequencePlan, StagePlan
from .wan import WanModel, WanProcessor, WanSpec

FRAME_CHANNELS, MASK_CHANNELS = 32, 64  # WanVaceToVideo's: the inactive and reactive latents, the 8×8 mask


@dataclass(frozen=True)
class WanVaceSpec(WanSpec):
    vace_layers: tuple[int, ...] = ()  # the model blocks after which the VACE blocks' hints are added

    family = "wan_vace"
    # the VACE inputs as WanVaceToVideo puts them on the conditioning (a list entry per control video); a VACE model
    # is text to video: an image-to-video node's inputs are refused by name
    comfy_conditioning = {"vace_frames": "vace_frames", "vace_mask": "vace_mask", "vace_strength": "vace_strength"}
    # the xDiT MODEL's calls: ComfyUI's WAN21_Vace has made vace_context (in model space, an entry per control
    # video) and vace_strength from them (comfy/model_base.py extra_conds)
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
    # the blocks in execution order (diffusers runs every VACE block first): weight sharding, sharded loading and
    # compile take both lists, so a VACE model's control blocks are sharded as its own are
    stage_plan = StagePlan(block_lists=("vace_blocks", "blocks"), attention=WanSpec.stage_plan.attention)

    @classmethod
    def from_config(cls, config: dict) -> WanVaceSpec:
        base = WanSpec.from_config(config)
        return cls(base.context_dim, base.heads, base.blocks + len(config["vace_layers"]), base.channels,
                   base.in_channels, tuple(config["vace_layers"]))

    @property
    def optional_conditioning(self) -> tuple[str, ...]:
        return (*super().optional_conditioning, "vace_frames", "vace_mask", "vace_strength", "vace_context")

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """E control videos side by side in the channels (the module docstring); ``prepare_conditioning`` checks
        that the entries agree."""
        return {**super().conditioning_shapes(batch, text_tokens),
                "vace_frames": (batch, None, None, None, None),  # [B, 32·E, T, h, w] raw latents, the latent's size
                "vace_mask": (batch, None, None, None, None),  # [B, 64·E, T, h, w]
                "vace_strength": (batch, None),  # [B, E]
                # or both as ComfyUI's model call brings them: the frames in model space and the mask, concatenated
                "vace_context": (batch, None, None, None, None)}  # [B, 96·E, T, h, w]

    def drawn_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """One control video."""
        return {**super().conditioning_shapes(batch, text_tokens),
                "vace_frames": (batch, FRAME_CHANNELS, None, None, None),
                "vace_mask": (batch, MASK_CHANNELS, None, None, None), "vace_strength": (batch, 1),
                "vace_context": (batch, FRAME_CHANNELS + MASK_CHANNELS, None, None, None)}

    def prepare_conditioning(self, cond: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One side's VACE inputs, checked: each a whole number of entries (32, 64 or 96 channels each), the same
        number in all."""
        per_entry = {"vace_frames": FRAME_CHANNELS, "vace_mask": MASK_CHANNELS,
                     "vace_context": FRAME_CHANNELS + MASK_CHANNELS}
        entries = {key: cond[key].shape[1] / channels for key, channels in per_entry.items() if key in cond}
        if "vace_strength" in cond:
            entries["vace_strength"] = cond["vace_strength"].shape[1]
        if any(count != int(count) for count in entries.values()) or len(set(entries.values())) > 1:
            raise UserError(f"VACE inputs of disagreeing control videos: {self._channels_text(cond)}",
                            "send E control videos as vace_frames [B, 32·E, T, h, w], vace_mask [B, 64·E, T, h, w] "
                            "and vace_strength [B, E] (WanVaceToVideo's lists, side by side in the channels)")
        return cond

    @staticmethod
    def _channels_text(cond: dict) -> str:
        return ", ".join(f"{key} {list(cond[key].shape)}" for key in
                         ("vace_frames", "vace_mask", "vace_strength", "vace_context") if key in cond)


class WanVaceModel(WanModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._strength: torch.Tensor | None = None  # the running call's strength per row and entry [B, E]
        embedding = self.transformer.vace_patch_embedding
        embedding.register_forward_pre_hook(self._entries_to_rows)
        embedding.register_forward_hook(self._rows_to_channels)
        for block in self.transformer.vace_blocks:  # once: a compiled block's hooks never change
            block.register_forward_pre_hook(self._beside_each_entry)
            block.register_forward_hook(self._scaled)

    @property
    def _entries(self) -> int:
        return self._strength.shape[1]

    def extra_inputs(self, x, cond) -> dict:
        """The control videos [B, 96·E, T, h, w] and, per row, their strengths (applied to each hint: ``_scaled``)."""
        strength = cond.get("vace_strength")
        self._strength = (torch.ones(x.shape[0], 1, device=self.device) if strength is None
                          else strength.to(self.device, torch.float32))  # [B, E]
        return {"control_hidden_states": self.vace_context(x.shape, cond),
                "control_hidden_states_scale": torch.ones(len(self.spec.vace_layers), device=self.device)}

    def vace_context(self, shape, cond) -> torch.Tensor:
        """WAN21_Vace.extra_conds' vace_context for a latent of ``shape``: per entry, each 16 channels of its frames
        in model space (zeros without them), then its mask (ones without it): [B, 96·E, T, h, w] in the model's
        dtype; as it is when a model call brings it made."""
        made = cond.get("vace_context")
        if made is not None:
            return made.to(self.device, self.dtype)
        b, _, frames, h, w = shape
        video = cond.get("vace_frames")
        video = (torch.zeros(b, FRAME_CHANNELS, frames, h, w, device=self.device) if video is None
                 else video.to(self.device, torch.float32, copy=True))
        for start in range(0, video.shape[1], 16):
            video[:, start:start + 16] = self.latent_format.process_in(video[:, start:start + 16])
        entries = video.shape[1] // FRAME_CHANNELS
        mask = cond.get("vace_mask")
        mask = (torch.ones(b, MASK_CHANNELS * entries, frames, h, w, device=self.device) if mask is None
                else mask.to(self.device, torch.float32))
        video, mask = (t.unflatten(1, (entries, -1)) for t in (video, mask))  # [B, E, 32 | 64, T, h, w]
        return torch.cat([video, mask], dim=2).flatten(1, 2).to(self.dtype)  # [B, 96·E, T, h, w]

    def _entries_to_rows(self, embedding, args):
        """The VACE patch embedding's input [B, 96·E, T, h, w] → [B·E, 96, T, h, w]: each entry a row."""
        (context,) = args
        return (context.unflatten(1, (self._entries, -1)).flatten(0, 1),)

    def _rows_to_channels(self, embedding, args, out):
        """Its output [B·E, D, T', h', w'] → [B, E·D, T', h', w'], the model's B rows (diffusers pads and flattens
        it as one control: [B, n, E·D])."""
        return out.unflatten(0, (-1, self._entries)).flatten(1, 2)

    def _beside_each_entry(self, block, args):
        """A VACE block's inputs over B·E rows: the first block's control tokens [B, n, E·D] unfolded into rows
        [B·E, n, D], and the model's own inputs (embedded latent, prompt, time) repeated beside each entry."""
        hidden, text, control, time, rotary = args
        entries = self._entries
        if entries == 1:
            return None
        if control.shape[0] == hidden.shape[0]:  # the first block: entries side by side in the channels
            control = control.unflatten(2, (entries, -1)).transpose(1, 2).flatten(0, 1)  # [B·E, n, D]
        hidden, text, time = (t.repeat_interleave(entries, dim=0) for t in (hidden, text, time))
        return hidden, text, control, time, rotary

    def _scaled(self, block, args, out):
        """A VACE block's hints [B·E, n, D], each times its row's and entry's strength, summed over the entries into
        the model's rows [B, n, D] (ComfyUI's ``x += c_skip * vace_strength[i]`` for each entry)."""
        hint, states = out
        scaled = hint.unflatten(0, (-1, self._entries)) * self._strength.to(hint.dtype)[:, :, None, None]
        return scaled.sum(dim=1), states
