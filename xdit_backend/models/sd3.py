"""SD3 / SD3.5: diffusers ``SD3Transformer2DModel`` fed the way ComfyUI feeds its MM-DiT.

Joint text+image attention (and, in SD3.5-medium, an extra image-only attention in the first
blocks), absolute 2-D position embeddings added by the patch embedding. Sequence parallelism
cuts the image tokens right after ``pos_embed`` (positions already added) and the text tokens
where they enter, and gathers the image tokens after ``proj_out``. Model sampling: discrete flow,
shift 3.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from ..sampling.model_sampling import FlowSampling
from . import latent_formats, patch_embed
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan
from .joint_attention import JointAttentionProcessor

SD3_DEFAULT_SHIFT = 3.0  # ComfyUI's SD3 sampling_settings


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on sd3-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.04942, 0.1159, 0.01253)


@dataclass(frozen=True)
class SD3Spec(FamilySpec):
    context_dim: int  # T5 (4096) joint context, CLIP-L and CLIP-G features padded into it
    pooled_dim: int  # CLIP-L + CLIP-G pooled (2048)
    heads: int
    blocks: int

    family = "sd3"
    # comfy/ldm/modules/diffusionmodules/mmdit.py OpenAISignatureMMDITWrapper.forward(x, timesteps, context, y, …)
    comfy_model_inputs = {"y": "pooled"}
    latent_format = latent_formats.SD3
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(
        cuts=(Cut("pos_embed", None, 1),  # [B, N, C], absolute positions already added
              Cut("", "encoder_hidden_states", 1, text=True)),  # [B, L, 4096]
        attention=(("attn", JointAttentionProcessor), ("attn2", JointAttentionProcessor)))
    # attn2: SD3.5-medium's extra image-only self-attention in its first blocks
    takes_controlnets = True  # Stability's SD3.5 Large ControlNets (models/sd3_controlnet.py)
    # a ControlNet: its image and hint tokens, summed, cut as the model's image; image-only attention; never gathered
    control_plan = SequencePlan(cuts=(Cut("control_tokens", None, 1),),  # [B, N, D]
                                attention=(("attn", JointAttentionProcessor),), gather=None)
    stage_plan = StagePlan(block_lists=("transformer_blocks",),
                           attention=(("attn", JointAttentionProcessor, True), ("attn2", JointAttentionProcessor, False)), joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("encoder_hidden_states", "hidden_states")},
                           probe="temb", teacache=TEACACHE)

    @classmethod
    def from_config(cls, config: dict) -> SD3Spec:
        return cls(config["joint_attention_dim"], config["pooled_projection_dim"], config["num_attention_heads"],
                   config["num_layers"])

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(SD3_DEFAULT_SHIFT if shift is None else shift)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim), "pooled": (batch, self.pooled_dim)}


class SD3Model(DiffusionModel):
    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        self._residuals: list | None = None  # the running call's ControlNet residual per block, summed over them
        for index, block in enumerate(transformer.transformer_blocks):  # once: a compiled block's hooks never change
            block.register_forward_hook(partial(self._control_block, index))

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 16, h, w] at timestep 1000·σ [B], float32 into the sinusoidal
        embedding as in ComfyUI (not rounded to the weights' dtype)."""
        pooled = cond["pooled"].to(self.device, self.dtype)  # [B, 2048]
        self._residuals = self._control_residuals(x, pooled, timestep.to(self.device))
        try:
            return self.transformer(
                hidden_states=x,
                encoder_hidden_states=cond["context"].to(self.device, self.dtype),  # [B, L, 4096]
                pooled_projections=pooled,
                timestep=timestep.to(self.device, torch.float32),
                return_dict=False,
            )[0]
        finally:
            self._residuals = None

    def _control_residuals(self, x, pooled, timestep) -> list | None:
        """Each block's residual from the ControlNets active at this σ (``timestep`` is 1000·σ), times their
        strengths and summed in their order (ComfyUI's control_merge), or None."""
        active = [control for control in self.controlnets if control.active(float(timestep[0]) / 1000)]
        if not active:
            return None
        from .sd3_controlnet import model_residuals

        blocks = len(self.transformer.transformer_blocks)
        sums: list = [None] * blocks
        for control in active:
            samples = control.network(hidden_states=x, controlnet_cond=control.hint.expand(x.shape[0], -1, -1, -1),
                                      pooled_projections=pooled, timestep=timestep)  # per block: [B, N, D]
            width = control.network.config.num_attention_heads * control.network.config.attention_head_dim
            for block, add in enumerate(model_residuals(samples, blocks, width)):
                if add is not None:
                    add = add * control.strength
                    sums[block] = add if sums[block] is None else sums[block] + add
        return sums

    def _control_block(self, index: int, block, args, out):
        """After joint block ``index``: the ControlNets' residual added to its image tokens (ComfyUI's mmdit adds
        ``control["output"][i]`` after every block, the last one's too). Each rank's residual is its own share."""
        if self._residuals is None or self._residuals[index] is None:
            return out
        text, image = out  # [B, L, D] (None after the last block), [B, n, D]
        return text, image + self._residuals[index]

    # PipeFusion stages (base.DiffusionModel): text travels with the step's first patch; the last
    # block (context_pre_only) drops it.

    def positions(self, shape):
        return patch_embed.table(self.transformer.pos_embed, shape[-2], shape[-1])  # [1, N, D]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        pooled = cond["pooled"].to(self.device, self.dtype)  # [B, 2048]
        temb = self.transformer.time_text_embed(timestep.to(self.device, torch.float32), pooled)  # [B, D]
        return {"temb": temb, "context": cond["context"]}

    def embed(self, x, tokens, inputs, positions):
        return patch_embed.embed_rows(self.transformer.pos_embed, x, tokens, positions).contiguous()  # [B, n, D]

    def embed_text(self, inputs):
        return self.transformer.context_embedder(inputs["context"].to(self.device, self.dtype))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        return {"temb": inputs["temb"]}

    def run_block(self, block, image, text, kwargs):
        text, image = block(hidden_states=image, encoder_hidden_states=text, **kwargs)
        return image, text

    def head(self, image, inputs, tokens):
        return self.transformer.proj_out(self.transformer.norm_out(image, inputs["temb"]))  # [B, n, p·p·C]

    def unpatchify(self, tokens, shape):
        """As diffusers' forward ends, for a band of rows."""
        p, c = self.transformer.config.patch_size, self.transformer.out_channels
        rows, columns = shape[-2] // p, shape[-1] // p
        patches = tokens.reshape(tokens.shape[0], rows, columns, p, p, c)  # [B, rows, columns, p, p, C]
        return torch.einsum("nhwpqc->nchpwq", patches).reshape(tokens.shape[0], c, rows * p, columns * p)
