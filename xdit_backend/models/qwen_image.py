"""Qwen-Image and Qwen-Image-Edit: diffusers ``QwenImageTransformer2DModel`` fed as ComfyUI feeds its own.

An MM-DiT: every block carries the Qwen2.5-VL text tokens [B, L, 3584] and the image tokens (2×2
patches of a 16-channel Wan-2.1 latent) side by side and attends over [text; image] jointly, with
3-axis RoPE. Qwen-Image-Edit is the same architecture given reference latents (ComfyUI's
``reference_latents``): each is packed as more image tokens after the noisy latent's, with its own
positions (frame index 1, 2, …), and the output keeps the first N tokens. Qwen-Image-Edit-2511 (diffusers'
``zero_cond_t``; ComfyUI's "index_timestep_zero" reference method, the default of a file that carries the
``__index_timestep_zero__`` marker) modulates the reference tokens' image stream at timestep 0: the time
embedding is taken at [t; 0], and each image token picks its half by ``modulate_index`` (1 on the references),
which sequence parallelism cuts with the tokens and a PipeFusion chunk builds from its tokens' indices.

Positions follow ComfyUI (comfy/ldm/qwen_image/model.py), where diffusers differs: an image's rows
and columns are centred at ``len // 2`` (diffusers: ``len - len // 2``, one off for an odd count) and
the text starts after the noisy latent's half-size only (diffusers: the largest image's). The
timestep enters the sinusoidal embedding in float32, as in ComfyUI (diffusers rounds σ to the
weights' dtype first).

Sequence parallelism cuts the whole image sequence (noisy and reference tokens: one sequence in the
transformer's ``hidden_states``), the text, and the RoPE tables of both, and gathers after
``proj_out``; the attention is ``QwenImageAttention`` with a pluggable core.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats, model_patch, qwen_image_controlnet
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan, reference_rows, references
from .patch_embed import pack, pad_to_patch, unpack

QWEN_IMAGE_DEFAULT_SHIFT = 1.15  # ComfyUI's supported_models.QwenImage sampling_settings (ModelSamplingFlux)
ROPE_THETA = 10000  # comfy/ldm/qwen_image/model.py's EmbedND, diffusers' QwenEmbedRope


class QwenImageAttention:
    """Qwen-Image's joint attention (a diffusers processor for its ``attn`` modules) whose attention
    itself is ``core(q, k, v, text_tokens=L)`` on [text; image] (USPAttention, or PipeFusion's StaleKV)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                 attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        if encoder_hidden_states_mask is not None or attention_mask is not None:
            raise NotImplementedError("parallel Qwen-Image attention takes no mask (ComfyUI passes none)")
        head_dim = attn.inner_dim // attn.heads

        def heads(t):
            return t.unflatten(-1, (-1, head_dim))  # [B, S, H·D] → [B, S, H, D]

        image = [heads(proj(hidden_states)) for proj in (attn.to_q, attn.to_k, attn.to_v)]  # [B, N, H, D] each
        text = [heads(proj(encoder_hidden_states)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        text_tokens = encoder_hidden_states.shape[1]  # 0 for PipeFusion's patches that do not carry the text
        if image_rotary_emb is not None:
            image_freqs, text_freqs = image_rotary_emb  # complex [N, D/2], [L, D/2]
            image[:2] = [apply_rotary_emb_qwen(t, image_freqs, use_real=False) for t in image[:2]]
            if text_tokens:  # diffusers' rotation cannot reshape an empty tensor
                text[:2] = [apply_rotary_emb_qwen(t, text_freqs, use_real=False) for t in text[:2]]
        query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, image))  # [B, L + N, H, D]
        out = self.core(query, key, value, text_tokens=text_tokens).flatten(2, 3).to(query.dtype)  # [B, L + N, H·D]
        image_out = attn.to_out[0](out[:, text_tokens:].contiguous())
        return image_out, attn.to_add_out(out[:, :text_tokens].contiguous())


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on qwen-image-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (0.1524, -0.1917, 0.1079)


@dataclass(frozen=True)
class QwenImageSpec(FamilySpec):
    """What a Qwen-Image model takes and allows, read from its config."""

    context_dim: int  # Qwen2.5-VL-7B's hidden size (3584)
    heads: int
    blocks: int
    rope_axes: tuple[int, int, int]  # RoPE channels per axis (frame, row, column)
    timestep_zero: bool = False  # Qwen-Image-Edit-2511: the references modulated at timestep 0 (zero_cond_t)

    family = "qwen_image"
    # comfy/ldm/qwen_image/model.py QwenImageTransformer2DModel.forward(x, timestep, context, attention_mask,
    # guidance, ref_latents, …): text to image, and the edit models' reference latents (its "index" method)
    latent_format = latent_formats.WAN21  # supported_models.QwenImage.latent_format = latent_formats.Wan21
    takes_references = True
    takes_model_patches = True  # DiffSynth's block-wise ControlNet (models/model_patch.py)
    takes_controlnets = True  # InstantX's (models/qwen_image_controlnet.py)
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    sequence_plan = SequencePlan(
        cuts=(Cut("", "hidden_states", 1),  # [B, N + R, 64]: noisy then reference tokens
              Cut("", "encoder_hidden_states", 1, text=True),  # [B, L, context_dim]
              Cut("image_rope", None, 0),  # [N + R, D/2] complex RoPE of the image tokens
              Cut("text_rope", None, 0, text=True),  # [L, D/2] of the text
              # [B, N + R]: 1 on the reference tokens (2511's timestep zero), each block's own input
              Cut("transformer_blocks.*", "modulate_index", 1, optional=True),
              # a model patch's hint tokens [1, N + R, D] and their mask [1, N + R, 1] (0 on the references')
              Cut("control_hint", None, 1)),
        attention=(("attn", QwenImageAttention),))
    # a ControlNet (models/qwen_image_controlnet.py): the model's cuts and attention, its hint cut like the image
    control_plan = SequencePlan(
        cuts=(Cut("", "hidden_states", 1),  # [B, N, 64]
              Cut("", "controlnet_cond", 1),  # [B, N, C·4]: the control latent, packed like the image
              Cut("", "encoder_hidden_states", 1, text=True),
              Cut("image_rope", None, 0),
              Cut("text_rope", None, 0, text=True)),
        attention=(("attn", QwenImageAttention),), gather=None)
    stage_plan = StagePlan(block_lists=("transformer_blocks",), attention=(("attn", QwenImageAttention, True),),
                           joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("encoder_hidden_states", "hidden_states")},
                           probe="temb", teacache=TEACACHE)

    @property
    def comfy_model_inputs(self) -> dict[str, str]:
        """ComfyUI's QwenImageTransformer2DModel.forward(x, timestep, context, attention_mask, guidance, ref_latents,
        …): text to image, and the edit models' reference latents, by the "index" method, or 2511's default
        "index_timestep_zero" (the same positions, the references modulated at timestep 0)."""
        return {"ref_latents": "references",
                "ref_latents_method": "index_timestep_zero" if self.timestep_zero else "index"}

    @classmethod
    def from_config(cls, config: dict) -> QwenImageSpec:
        for flag in ("use_additional_t_cond", "use_layer3d_rope", "guidance_embeds"):
            if config.get(flag):
                raise UserError(f"this Qwen-Image model sets {flag} (Qwen-Image-Layered / a guidance-distilled "
                                "variant), which this backend does not run yet",
                                "use Qwen-Image, Qwen-Image-2512 or Qwen-Image-Edit (-2509, -2511)")
        return cls(config["joint_attention_dim"], config["num_attention_heads"], config["num_layers"],
                   tuple(config["axes_dims_rope"]), bool(config.get("zero_cond_t")))

    def model_sampling(self, shift: float | None) -> FlowSampling:
        """Without a shift, ComfyUI's own: model_base.QwenImage is ModelType.FLUX, so ModelSamplingFlux at
        shift 1.15, timestep σ. A shift is what Qwen-Image's workflows set it with, ModelSamplingAuraFlow
        (comfy_extras/nodes_model_advanced.py: ModelSamplingDiscreteFlow, multiplier 1, so timestep σ too)."""
        if shift is None:
            return FlowSampling(QWEN_IMAGE_DEFAULT_SHIFT, flux=True)
        return FlowSampling(shift, multiplier=1.0)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int, ...]]:
        return {"context": (batch, text_tokens, self.context_dim)}


def image_positions(h: int, w: int, index: int) -> torch.Tensor:
    """[(h/2)·(w/2), 3] (index, row, column) positions of a latent's 2×2-patch tokens, rows and
    columns centred as ComfyUI's ``process_img`` centres them (minus len // 2)."""
    rows, columns = (h + 1) // 2, (w + 1) // 2
    r = torch.arange(rows, dtype=torch.float64).view(-1, 1).expand(rows, columns) - rows // 2
    c = torch.arange(columns, dtype=torch.float64).view(1, -1).expand(rows, columns) - columns // 2
    return torch.stack([torch.full_like(r, index), r, c], dim=-1).reshape(-1, 3)


def text_positions(h: int, w: int, text_tokens: int) -> torch.Tensor:
    """[L, 3] positions of the text: every axis counts from the noisy latent's largest half-size in tokens."""
    start = max((w + 1) // 2 // 2, (h + 1) // 2 // 2)
    return torch.arange(start, start + text_tokens, dtype=torch.float64).view(-1, 1).expand(-1, 3)


def rope(positions: torch.Tensor, axes: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Complex RoPE factors [S, D/2] of positions [S, 3]: angles in float64, cos and sin rounded to the
    compute dtype, as ComfyUI's EmbedND (comfy/ldm/flux/math.py rope) and its ``.to(x.dtype)``."""
    angles = torch.cat([positions[:, i:i + 1] / ROPE_THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
                        for i, d in enumerate(axes)], dim=1)  # [S, D/2]
    cos, sin = (f(angles).float().to(dtype).float() for f in (torch.cos, torch.sin))
    return torch.complex(cos, sin).to(device)


def squeeze_frames(latent: torch.Tensor, what: str) -> torch.Tensor:
    """ComfyUI carries Qwen-Image latents as [B, 16, 1, h, w] (Wan21's latent_dimensions = 3); → [B, 16, h, w]."""
    if latent.dim() == 5 and latent.shape[2] == 1:
        return latent[:, :, 0]
    if latent.dim() != 4:
        raise UserError(f"{what} has shape {list(latent.shape)}; Qwen-Image takes an image latent [B, 16, h, w] "
                        "(or ComfyUI's [B, 16, 1, h, w])", "encode the image with the Qwen-Image (Wan 2.1) VAE")
    return latent


@contextmanager
def rope_and_time(transformer, tables: tuple[torch.Tensor, torch.Tensor], timestep: torch.Tensor):
    """For one forward of diffusers' Qwen-Image: ``pos_embed`` returns ``tables`` (image, text RoPE in
    ComfyUI's positions), each passed through its module (``image_rope``, ``text_rope``: a sequence-
    parallel plan cuts the image and the text table by their own lengths), and the time embedding gets σ
    [B] in float32 (diffusers casts it to the weights' dtype; ComfyUI does not)."""
    def ours(module, args, out):  # each table through its own pass-through module, where the plan cuts it
        return transformer.image_rope(tables[0]), transformer.text_rope(tables[1])

    handles = [transformer.pos_embed.register_forward_hook(ours, prepend=True),
               transformer.time_text_embed.register_forward_pre_hook(
                   lambda module, args: (timestep, *args[1:]))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class QwenImageModel(DiffusionModel):
    """A loaded Qwen-Image transformer (whole, or one PipeFusion stage of it)."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # pass-through modules (no parameters, no state) the RoPE tables leave through (``rope_and_time``), and the
        # model patches' hints (``_patch_block``): where a sequence-parallel plan cuts them
        transformer.image_rope, transformer.text_rope = torch.nn.Identity(), torch.nn.Identity()
        transformer.control_hint = torch.nn.Identity()
        self._residuals: list | None = None  # the running call's ControlNet residual per block, summed over them
        self._hints: list | None = None  # the running call's (hint, mask) per patch: whole, cut at block 0
        self._hints_local = False  # or already this rank's tokens' (a PipeFusion chunk's: block_kwargs)
        for index, block in enumerate(transformer.transformer_blocks):  # once: a compiled block's hooks never change
            block.register_forward_hook(partial(self._patch_block, index))

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for ``x`` [B, 16, h, w] at σ [B]; reference latents [B, 16, h', w'] (raw VAE
        space) join as more image tokens, and only the noisy latent's come out."""
        b, _, h, w = x.shape
        context = cond["context"].to(self.device, self.dtype)  # [B, L, context_dim]
        latents = self._reference_latents(cond, b)  # [B, 16, h', w']…
        tokens = [pack(x), *map(pack, latents)]  # [B, N, 64], [B, R_i, 64]…
        positions = [image_positions(h, w, 0), *(image_positions(*latent.shape[-2:], index)
                                                 for index, latent in enumerate(latents, start=1))]  # [N, 3]…
        tables = (rope(torch.cat(positions), self.spec.rope_axes, self.dtype, self.device),  # [N + R, D/2]
                  rope(text_positions(h, w, context.shape[1]), self.spec.rope_axes, self.dtype, self.device))
        timestep = timestep.to(self.device, torch.float32)  # [B] σ
        # every image's (frames, rows, columns) in tokens: diffusers' RoPE (replaced by ``tables``) and, with
        # zero_cond_t, its modulate_index (0 on the noisy tokens, 1 on the references')
        shapes = [(1, h // 2, w // 2), *((1, latent.shape[-2] // 2, latent.shape[-1] // 2) for latent in latents)]
        self._hints, self._hints_local = self._patch_hints(sum(t.shape[1] for t in tokens)), False
        self._residuals = self._control_residuals(tokens[0], context, timestep, tables, shapes[0])
        try:
            with rope_and_time(self.transformer, tables, self._time(timestep)):
                velocity = self.transformer(
                    hidden_states=torch.cat(tokens, dim=1),  # [B, N + R, 64]
                    encoder_hidden_states=context,
                    timestep=timestep,
                    img_shapes=[shapes] * b,
                    return_dict=False,
                )[0]  # [B, N + R, 64]
        finally:
            self._hints = self._residuals = None
        return unpack(velocity[:, :h // 2 * (w // 2)], h, w)  # the noisy latent's tokens → [B, 16, h, w]

    def _control_residuals(self, tokens, context, timestep, tables, shape) -> list | None:
        """Each block's residual from the ControlNets active at this σ, summed in their order (ComfyUI's
        control_merge), or None. ``tokens`` [B, N, 64] the noisy latent's (a ControlNet sees no references),
        ``tables`` the model's RoPE tables, ``shape`` the latent's (frames, rows, columns) in tokens."""
        active = [control for control in self.controlnets if control.active(float(timestep[0]))]
        if not active:
            return None
        residuals = [None] * self.transformer.config.num_layers
        for control in active:
            with rope_and_time(control.network, tables, timestep.to(self.dtype)):  # ComfyUI: timesteps.to(dtype)
                samples = control.network(
                    hidden_states=tokens, controlnet_cond=control.hint.expand(tokens.shape[0], -1, -1),
                    conditioning_scale=control.strength, encoder_hidden_states=context, timestep=timestep,
                    img_shapes=[[shape]] * tokens.shape[0], return_dict=False)  # per network block: [B, N, D]
            for block, add in enumerate(qwen_image_controlnet.model_residuals(samples, len(residuals))):
                residuals[block] = add if residuals[block] is None else residuals[block] + add
        return residuals

    def _patch_hints(self, image_tokens: int) -> list | None:
        """Each model patch's hint over the call's N + R image tokens [1, N + R, D] (zeros on the references') and
        the mask of the tokens it controls [1, N + R, 1]: ComfyUI's patch adds to ``img[:, :N]`` only."""
        hints = []
        for patch in self._patches():
            noisy = patch.hint.shape[1]
            hint = torch.nn.functional.pad(patch.hint, (0, 0, 0, image_tokens - noisy))  # [1, N + R, D]
            mask = (torch.arange(image_tokens, device=hint.device) < noisy).to(hint.dtype).view(1, -1, 1)
            hints.append((hint, mask))
        return hints or None

    def _patch_block(self, index: int, block, args, out):
        """ComfyUI's ``double_block`` patches after block ``index`` (comfy/ldm/qwen_image/model.py): each patch's
        control, times its strength, added to the noisy image tokens, in order. Under sequence parallelism the
        hints are cut at block 0 like the image (``control_hint`` in the plan): each rank controls its own tokens."""
        if self._hints is None and self._residuals is None:
            return out
        if index == 0 and self._hints is not None and not self._hints_local:
            self._hints = [self.transformer.control_hint(pair) for pair in self._hints]  # [1, n, D], [1, n, 1]
        text, image = out  # [B, L, D], [B, n, D]
        for patch, (hint, mask) in zip(self._patches(), self._hints or ()):
            image = image + patch.network.controlnet_blocks[index](image, hint) * patch.strength * mask
        if self._residuals is not None:  # ControlNets' after the patches, as comfy/ldm/qwen_image/model.py adds them
            image = image + self._residuals[index]
        return text, image

    def _patches(self) -> list:
        return [patch for patch in self.model_patches if isinstance(patch, model_patch.AppliedPatch)]

    def _reference_latents(self, cond: dict, batch: int) -> list[torch.Tensor]:
        """The reference latents in model space, padded to the patch, over the call's rows: [batch, 16, h', w']."""
        latents = []
        for index, reference in enumerate(references(cond)):
            latent = squeeze_frames(reference, f"reference latent {index}").to(self.device)
            latent = pad_to_patch(self.latent_format.process_in(latent.float()).to(self.dtype), self.spec.patch)
            latents.append(reference_rows(latent, batch, index))
        return latents

    def _references(self, cond: dict, batch: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The reference latents as packed tokens [batch, R_i, 64] and their positions [R_i, 3] (frame index 1,
        2, …)."""
        latents = self._reference_latents(cond, batch)
        return ([pack(latent) for latent in latents],
                [image_positions(*latent.shape[-2:], index) for index, latent in enumerate(latents, start=1)])

    def _time(self, timestep: torch.Tensor) -> torch.Tensor:
        """σ [B] as the time embedding takes it: [t; 0] [2B] for 2511 (zero_cond_t), whose blocks modulate the
        references by the second half (and the text, and the output layer, by the first)."""
        return torch.cat([timestep, timestep * 0]) if self.spec.timestep_zero else timestep

    # PipeFusion stages (base.DiffusionModel): text (and references) travel with the step's first patch.

    def positions(self, shape):
        """The image RoPE [N, D/2] of the whole latent, and the latent's size for the text's."""
        h, w = shape[-2:]
        return rope(image_positions(h, w, 0), self.spec.rope_axes, self.dtype, self.device), (h, w)

    def stage_references(self, cond, positions):
        tokens, placed = self._references(cond, cond["context"].shape[0])
        if not tokens:
            return None, positions
        image, size = positions
        extra = rope(torch.cat(placed), self.spec.rope_axes, self.dtype, self.device)  # [R, D/2]
        return torch.cat(tokens, dim=1), (torch.cat([image, extra]), size)  # [B, R, 64], ([N + R, D/2], (h, w))

    def embed_references(self, tokens):
        return self.transformer.img_in(tokens)  # [B, R, 64] → [B, R, D]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """The time embedding the blocks take ([B, D], or 2511's [2B, D] at [t; 0]) and the output layer's ([B, D])."""
        context = cond["context"]
        t = self.transformer
        anchor = torch.empty(0, device=self.device, dtype=self.dtype)  # the embedding's dtype
        timestep = timestep.to(self.device, torch.float32)
        temb = t.time_text_embed(self._time(timestep), anchor)  # [B or 2B, D]
        return {"temb": temb, "out_temb": temb[:timestep.shape[0]], "context": context}

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.img_in(pack(x))  # [B, C, rows, w] → [B, n, 64] → [B, n, D]

    def embed_text(self, inputs):
        t = self.transformer
        return t.txt_in(t.txt_norm(inputs["context"].to(self.device, self.dtype)))  # [B, L, D]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        image, (h, w) = positions
        text = rope(text_positions(h, w, text_tokens), self.spec.rope_axes, self.dtype, self.device)  # [L, D/2]
        kwargs = {"temb": inputs["temb"], "image_rotary_emb": (image[tokens], text)}
        if self.spec.timestep_zero:  # [B, n]: 1 on the reference tokens (indices past the noisy latent's N)
            noisy = (h + 1) // 2 * ((w + 1) // 2)
            kwargs["modulate_index"] = (tokens >= noisy).int().expand(inputs["out_temb"].shape[0], -1)
        self._hints, self._hints_local = self._chunk_hints(tokens), True
        return kwargs

    def _chunk_hints(self, tokens: torch.Tensor) -> list | None:
        """Each model patch's hint and mask at a PipeFusion chunk's tokens [n] (indices into [noisy; references]):
        [1, n, D] and [1, n, 1], 0 on the references'."""
        hints = []
        for patch in self._patches():
            noisy = patch.hint.shape[1]
            at = tokens.to(patch.hint.device)
            mask = (at < noisy).to(patch.hint.dtype).view(1, -1, 1)
            hints.append((patch.hint[:, at.clamp(max=noisy - 1)], mask))  # [1, n, D], [1, n, 1]
        return hints or None

    def run_block(self, block, image, text, kwargs):
        text, image = block(hidden_states=image, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                            **kwargs)
        return image, text

    def head(self, image, inputs, tokens):
        return self.transformer.proj_out(self.transformer.norm_out(image, inputs["out_temb"]))  # [B, n, 64]

    def unpatchify(self, tokens, shape):
        return unpack(tokens, shape[-2], shape[-1])  # [B, n, 64] → [B, 16, rows, w]
