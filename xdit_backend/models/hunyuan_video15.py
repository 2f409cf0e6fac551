"""HunyuanVideo 1.5 (480p, 720p; text and image to video): diffusers ``HunyuanVideo15Transformer3DModel``
fed as ComfyUI feeds its HunyuanVideo15 model.

Video latents [B, 32, T, h, w] from a 16× spatial, 4× temporal VAE, in (1, 1, 1) patches; 54
double-stream blocks attend to [image; text] jointly, 3-D RoPE on the image tokens only. The text
is the Qwen2.5-VL hidden states (3584) refined by a token refiner, plus optional byT5 glyph
features (1472; ComfyUI's ``conditioning_byt5small``), each tagged by a learned type embedding.
The model's input is 65 channels: the noisy latent, an image latent and a mask (image to video);
for text to video both are zero, as ComfyUI's concat_cond makes them without a start image.

Image to video (HunyuanVideo15ImageToVideo), read from ComfyUI's current source (Comfy-Org/ComfyUI
comfy/model_base.py ``HunyuanVideo15.concat_cond`` and ``extra_conds``, commit 094c74c; the shared snapshot
predates the family): ``concat_latent_image`` [B, 32, T', h', w'] (the start frame's latent, raw) resized to the
latent and shifted into model space per 32 channels, and ``concat_mask`` [B, 1, T'', H, W] (1: to be made)
inverted, resized and zero-padded over the frames (ComfyUI's falls back on the LATENT's noise mask, whose 32
channels its input cannot take; here a noise mask inpaints as with any model): the 33 channels concatenated to
the input, which travel with their tokens. ``clip_vision_output`` [B, 729, 1152] (CLIPVisionEncode's last hidden state: SigLIP's; ComfyUI's ``clip_fea``) through the image
embedder, tagged with the third type embedding, joins the text ahead of the byT5 and Qwen2.5-VL tokens, as
diffusers (the reference implementation's order: valid image, byT5, text) joins them; the joint text is a
sequence the blocks carry beside the video's, so it is split with the text under sequence parallelism and
travels with each step's first patch under PipeFusion.

This module runs the model with its own loop over diffusers' modules (the same stage methods
PipeFusion uses), not diffusers' forward: that forward builds an S × S boolean mask and a per
sample Python reordering on every call, and needs the SigLIP tokens even for text to video.
Text tokens masked out in every sample are dropped (they cannot change the image: masked as
keys, their own outputs are discarded); what remains is masked as keys only.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..sampling.model_sampling import FlowSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan
from .resize import upscale

# Comfy-Org/ComfyUI comfy/supported_models.py, class HunyuanVideo15: sampling_settings {"shift": 7.0},
# model_base.HunyuanVideo15 is ModelType.FLOW (discrete flow, timestep 1000·σ).
HYV15_DEFAULT_SHIFT = 7.0
TEXT, BYT5, IMAGE = 0, 1, 2  # rows of cond_type_embed: Qwen2.5-VL, byT5 and SigLIP (image to video) tokens
LATENT_CHANNELS = 32


def key_masked_attention(query, key, value, key_mask):
    """Attention on [B, S, H, D] where ``key_mask`` [B, S] (True: attend) masks keys only."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, H, S, D]
    mask = None if key_mask is None else key_mask[:, None, None, :]  # [B, 1, 1, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)  # [B, S, H, D]


class SerialAttention:
    """The core of the processor when nothing is parallel: the whole sequence, text keys maskable."""

    takes_key_mask = True

    def __call__(self, query, key, value, text_tokens: int = 0, key_mask=None):
        return key_masked_attention(query, key, value, key_mask)


class HunyuanVideo15Processor:
    """HunyuanVideo 1.5's joint attention with a pluggable core: q, k, v [B, S, H, D] laid out
    [text (L tokens); image], image RoPE applied, → core → the image and text output projections.
    The token refiner's attention modules (named ``attn`` too, over the whole text before any cut)
    get diffusers' plain processor, unchanged."""

    def __init__(self, core):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.core, self.refiner = core, AttnProcessor2_0()

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None:  # a token-refiner block: self-attention over the whole text
            return self.refiner(attn, hidden_states, attention_mask=attention_mask)
        from diffusers.models.embeddings import apply_rotary_emb

        image = [proj(hidden_states).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v)]
        text = [proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))  # [B, L, H, D]
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
        image[0], image[1] = attn.norm_q(image[0]), attn.norm_k(image[1])  # [B, N, H, D]
        text[0], text[1] = attn.norm_added_q(text[0]), attn.norm_added_k(text[1])
        if image_rotary_emb is not None:  # (cos, sin) [N, D] each: the image tokens' positions
            image[0] = apply_rotary_emb(image[0], image_rotary_emb, sequence_dim=1)
            image[1] = apply_rotary_emb(image[1], image_rotary_emb, sequence_dim=1)
        L = encoder_hidden_states.shape[1]
        query, key, value = (torch.cat([t, x], dim=1) for t, x in zip(text, image))  # [B, L + N, H, D]
        if attention_mask is None:
            out = self.core(query, key, value, text_tokens=L)
        elif getattr(self.core, "takes_key_mask", False):
            image_keys = attention_mask.new_ones(attention_mask.shape[0], hidden_states.shape[1])  # [B, N]
            out = self.core(query, key, value, text_tokens=L, key_mask=torch.cat([attention_mask, image_keys], 1))
        else:
            raise UserError("HunyuanVideo 1.5 under sequence parallelism or PipeFusion needs every text token of "
                            "a batch to be real: the text masks of its prompts differ",
                            "give the prompts of one batch text of the same length (or no masks), or run it "
                            "without ring, ulysses and pipefusion")
        out = out.flatten(2, 3).to(query.dtype)  # [B, L + N, H·D]
        image_out = attn.to_out[1](attn.to_out[0](out[:, L:].contiguous()))
        return image_out, attn.to_add_out(out[:, :L].contiguous())


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on hunyuan-video-1.5-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.04535, 0.116, -0.007889)


@dataclass(frozen=True)
class HunyuanVideo15Spec(FamilySpec):
    context_dim: int  # Qwen2.5-VL-7B hidden states (3584)
    byt5_dim: int  # byT5-small glyph features (1472)
    heads: int
    blocks: int
    in_channels: int = 2 * LATENT_CHANNELS + 1  # the latent, the start image's latent and the mask
    image_dim: int = 1152  # SigLIP's hidden states (the image embedder's input)

    family = "hunyuan_video15"
    latent_format = latent_formats.HUNYUAN_VIDEO15
    video = True
    vae_factor = 16  # Comfy-Org/ComfyUI comfy/latent_formats.py HunyuanVideo15: spacial_downscale_ratio 16
    patch = (1, 1, 1)
    parallel_methods = frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"})
    # [B, L], [B, L2]: 1 real token, 0 padding. The byT5 glyph text is there only when the prompt quotes text:
    # Comfy-Org/ComfyUI comfy/text_encoders/hunyuan_video.py adds conditioning_byt5small only for "byt5" tokens
    optional_conditioning = ("context_mask", "context_byt5", "context_byt5_mask", "concat_latent_image", "concat_mask",
                             "clip_vision_output")
    # Comfy-Org/ComfyUI comfy/model_base.py HunyuanVideo15.extra_conds: conditioning_byt5small → txt_byt5,
    # clip_vision_output.last_hidden_state → clip_fea; concat_cond reads concat_latent_image and concat_mask
    comfy_conditioning = {"conditioning_byt5small": "context_byt5", "concat_latent_image": "concat_latent_image",
                          "concat_mask": "concat_mask", "clip_vision_output.last_hidden_state": "clip_vision_output"}
    sequence_plan = SequencePlan(
        cuts=(Cut("rope", None, 0),  # (cos, sin) [N, D] each
              Cut("transformer_blocks.0", 0, 1),  # the image tokens [B, N, D]
              Cut("transformer_blocks.0", 1, 1, text=True)),  # the refined text [B, L, D]
        attention=(("attn", HunyuanVideo15Processor),))
    stage_plan = StagePlan(block_lists=("transformer_blocks",),
                           attention=(("attn", HunyuanVideo15Processor, True),), joint_text=True)
    cache_plan = CachePlan(blocks=("transformer_blocks",),
                           returns={"transformer_blocks": ("hidden_states", "encoder_hidden_states")},
                           probe="temb", teacache=TEACACHE)

    @classmethod
    def from_config(cls, config: dict) -> HunyuanVideo15Spec:
        return cls(config["text_embed_dim"], config["text_embed_2_dim"], config["num_attention_heads"],
                   config["num_layers"], config["in_channels"], config["image_embed_dim"])

    @property
    def concat_channels(self) -> int:
        return self.in_channels - LATENT_CHANNELS  # 33: the start image's latent and the mask


    def split_text_tokens(self, cond: dict) -> int:
        """Qwen2.5-VL's, byT5's and the SigLIP tokens, padding included (at most what the blocks carry)."""
        return sum(cond[key].shape[1] for key in ("context", "context_byt5", "clip_vision_output") if key in cond)

    def model_sampling(self, shift: float | None) -> FlowSampling:
        return FlowSampling(HYV15_DEFAULT_SHIFT if shift is None else shift)

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple]:
        """The Qwen2.5-VL text and the byT5 glyph text (any length; 0 tokens when the prompt quotes none)."""
        return {"context": (batch, text_tokens, self.context_dim), "context_byt5": (batch, None, self.byt5_dim),
                "concat_latent_image": (batch, LATENT_CHANNELS, None, None, None),  # raw, [B, 32, T', h', w']
                "concat_mask": (batch, 1, None, None, None),  # [B, 1, T'', H, W], 1: to be made
                "clip_vision_output": (batch, None, self.image_dim)}  # SigLIP's last hidden state [B, 729, 1152]


class HunyuanVideo15Model(DiffusionModel):
    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        transformer.set_attn_processor(HunyuanVideo15Processor(SerialAttention()))  # sequence.attach restores it
        # id of a request's first text mask (its conditioning's tensors, the same every step) → (a weak reference
        # to it, the ids of both masks, the joint text tokens kept): entries die with their request's tensors
        self._kept_text: dict[int, tuple] = {}

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """The velocity for x [B, 32, T, h, w] at timestep 1000·σ [B]."""
        t = self.transformer
        inputs = self.step_inputs(tuple(x.shape), timestep, cond, guidance)
        rope = t.rope(self._grid(x.shape))  # (cos, sin) [N, D]: a module call, so the plan cuts it
        image = t.x_embedder(self.with_concat(x, cond))  # [B, 65, T, h, w] → [B, N, D]
        text = inputs["text"]  # [B, L, D]
        for block in t.transformer_blocks:  # positional, as the sequence plan cuts block 0's inputs
            image, text = block(image, text, inputs["temb"], inputs["mask"], rope)
        return self.unpatchify(self.head(image, inputs, None), tuple(x.shape))

    def concat(self, shape, cond) -> torch.Tensor | None:
        """ComfyUI's HunyuanVideo15.concat_cond for a latent of ``shape`` [B, 32, T, h, w]: the start image's latent
        (model space, resized) and the inverted mask, [B, 33, T, h, w]; zeros without either (text to video)."""
        if not self.spec.concat_channels:
            return None
        b, _, frames, h, w = shape
        image = cond.get("concat_latent_image")
        if image is None:
            image = torch.zeros(b, self.spec.concat_channels - 1, frames, h, w, device=self.device)
        elif image.shape[2] != frames:
            raise UserError(f"concat_latent_image has {image.shape[2]} frames; the latent has {frames}",
                            "make the start image's latent as HunyuanVideo15ImageToVideo does: as many frames as the "
                            "video's")
        else:
            image = self.image_in(image, h, w)  # [B, 32·k, T, h, w]
        mask = cond.get("concat_mask")
        if mask is None:
            mask = torch.zeros(b, 1, frames, h, w, device=self.device)
        else:
            mask = upscale(1.0 - mask.to(self.device, torch.float32), h, w)
            if mask.shape[2] < frames:
                mask = F.pad(mask, (0, 0, 0, 0, 0, frames - mask.shape[2]))
        return torch.cat([image, mask], dim=1)  # [B, 32 + 1, T, h, w]

    def _grid(self, shape):
        """A [1, 1, T, h, w] tensor: all the RoPE module reads is its shape and device."""
        return torch.empty((1, 1, *shape[2:]), device=self.device)

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        """Time embedding and the joint text [byT5; Qwen2.5-VL], refined and type-tagged; text tokens
        padded in every sample dropped, a key mask [B, L] kept only where samples differ."""
        t = self.transformer
        timestep = timestep.to(self.device, torch.float32)  # [B] 1000·σ, unrounded into the sinusoids
        temb = t.time_embed.timestep_embedder(t.time_embed.time_proj(timestep).to(self.dtype))  # [B, D]
        context = cond["context"].to(self.device, self.dtype)  # [B, L, 3584]
        mask = cond.get("context_mask")
        mask = None if mask is None else mask.to(self.device)
        text = t.context_embedder(context, timestep, mask)  # [B, L, D]
        text = text + t.cond_type_embed.weight[TEXT]
        byt5 = cond.get("context_byt5")
        if byt5 is None:
            byt5 = context.new_zeros(context.shape[0], 0, self.spec.byt5_dim)
        byt5 = t.context_embedder_2(byt5.to(self.device, self.dtype)) + t.cond_type_embed.weight[BYT5]  # [B, L2, D]
        image = self.image_tokens(cond, context.shape[0])  # [B, 729 or 0, D]
        masks = (cond.get("context_byt5_mask"), cond.get("context_mask"))
        text = torch.cat([image, byt5, text], dim=1)  # [B, I + L2 + L, D]
        key_mask = None
        if any(m is not None for m in masks):
            keep, key_mask = self._text_kept(masks, (byt5.shape[:2], context.shape[:2]))
            text = torch.cat([text[:, :image.shape[1]], text[:, image.shape[1]:][:, keep]], dim=1)  # [B, I + L', D]
            if key_mask is not None:
                key_mask = torch.cat([key_mask.new_ones(key_mask.shape[0], image.shape[1]), key_mask], dim=1)
        return {"temb": temb, "text": text, "mask": key_mask}

    def image_tokens(self, cond: dict, batch: int) -> torch.Tensor:
        """The SigLIP tokens of the start image through the image embedder, type-tagged: [B, I, D] (I = 0 without
        one: text to video, where diffusers masks zeros out and ComfyUI passes no clip_fea)."""
        t = self.transformer
        clip = cond.get("clip_vision_output")
        if clip is None:
            return torch.zeros(batch, 0, self.width, device=self.device, dtype=self.dtype)
        return t.image_embedder(clip.to(self.device, self.dtype)) + t.cond_type_embed.weight[IMAGE]

    def _text_kept(self, masks, shapes) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indices of the joint text tokens real in some sample [L'], their key mask [B, L'], or None where
        every kept token is real in every sample), on the device. Worked out on the host once per request, at
        its first step: the masks are the request's tensors, the same objects every step, and reading them
        back at every step would make the host wait for the device each step."""
        first = next(m for m in masks if m is not None)
        found = self._kept_text.get(id(first))
        if found is not None and found[0]() is first and found[1] == tuple(map(id, masks)):
            return found[2:]
        key_mask = torch.cat([torch.ones(shape) if m is None else m.float().cpu()
                              for m, shape in zip(masks, shapes)], dim=1) > 0  # [B, L2 + L]
        keep = key_mask.any(dim=0).nonzero().squeeze(1)  # [L'] real in some sample
        key_mask = key_mask[:, keep]  # [B, L']
        kept = (keep.to(self.device), None if key_mask.all() else key_mask.to(self.device))
        self._kept_text = {k: v for k, v in self._kept_text.items() if v[0]() is not None}  # the ended requests'
        self._kept_text[id(first)] = (weakref.ref(first), tuple(map(id, masks)), *kept)
        return kept

    # PipeFusion stages (base.DiffusionModel): a patch is the same band of rows in every frame.

    def joint_text_tokens(self, cond) -> int:
        """How many text tokens travel through the blocks: byT5 and Qwen2.5-VL, those real in some sample."""
        masks = [cond.get("context_byt5_mask"), cond.get("context_mask")]
        byt5 = cond.get("context_byt5")
        lengths = [0 if byt5 is None else byt5.shape[1], cond["context"].shape[1]]
        clip = cond.get("clip_vision_output")
        return (0 if clip is None else clip.shape[1]) + sum(length if m is None else int((m > 0).any(dim=0).sum())
                                                             for m, length in zip(masks, lengths))

    def positions(self, shape):
        return self.transformer.rope(self._grid(shape))  # (cos, sin) [N, D] each

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.x_embedder(x)  # [B, 65, T, rows, w] (PipeFusion concatenated them) → [B, n, D]

    def embed_text(self, inputs):
        return inputs["text"]

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        cos, sin = positions
        return {"temb": inputs["temb"], "attention_mask": inputs["mask"], "freqs_cis": (cos[tokens], sin[tokens])}

    def run_block(self, block, image, text, kwargs):
        return block(image, text, **kwargs)

    def head(self, image, inputs, tokens):
        return self.transformer.proj_out(self.transformer.norm_out(image, inputs["temb"]))  # [B, n, 32]

    def unpatchify(self, tokens, shape):
        """[B, n, C] (1 × 1 × 1 patches, frames × rows × columns) → [B, C, T, rows, w]."""
        b, _, frames, rows, columns = shape
        return tokens.reshape(b, frames, rows, columns, -1).permute(0, 4, 1, 2, 3)
