"""HunyuanDiT 1.0–1.2: diffusers ``HunyuanDiT2DModel`` fed the way ComfyUI feeds its own HunyuanDiT.

Self-attention over the image tokens with a 2-D RoPE, cross-attention (RoPE on its queries) to the
text: Chinese CLIP (BERT) tokens [B, L1 ≥ 77, 1024] then mT5-XL tokens [B, L2 ≥ 256, 2048]
projected to 1024, each side's last 77 / 256 padded tokens replaced by a learned padding table.
Long skip connections join block ``depth − 1 − i`` to block ``i`` of the second half. 1.0 and 1.1
also embed the image size (``image_meta_size``) and a style; 1.2 does not.

The model wrapper runs diffusers' modules in the order of diffusers' (and ComfyUI's) forward but
prepares the text as ComfyUI does (comfy/ldm/hydit/models.py), so any token counts ComfyUI's
encoders give are taken (diffusers' forward takes exactly 77 + 256), and embeds the timestep
from float32.

Sequence parallelism cuts the patch embedding's output and the RoPE table (``rotary_table``, a
parameterless module the wrapper adds to the transformer so the plan can cut its output) and
gathers after ``proj_out``: self-attention communicates, cross-attention reads the whole text
with this rank's queries. PipeFusion: stale K/V in the self-attention only; a patch's skips are
its carried tensors (StagePlan.carries), pushed by first-half blocks and popped by second-half
blocks whichever stage runs them, so they travel between stages with the patch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UserError
from ..sampling.model_sampling import VSampling
from . import latent_formats
from .base import CachePlan, Cut, DiffusionModel, FamilySpec, SequencePlan, StagePlan

# comfy/supported_models.py, HunyuanDiT ("hydit": 1.2) and HunyuanDiT1 ("hydit1": 1.0 / 1.1, told
# apart by the size and style conditioning): V-prediction over ComfyUI's default "linear" betas.
LINEAR_START = 0.00085
LINEAR_END = {False: 0.018, True: 0.03}  # by size conditioning
ROPE_BASE_PIXELS = 512  # comfy/ldm/hydit/models.py calc_rope: the RoPE grid is fit into 512 // 8 // patch


class RotaryTable(torch.nn.Module):
    """HunyuanDiT's 2-D RoPE (cos, sin) [N, head_dim] for a [.., h, w] latent, as ComfyUI's calc_rope
    builds it: the token grid fit into a 32 × 32 base grid; the first half of each head's dims turns
    with the token's column, the second half with its row. A module so that the sequence plan can cut
    its output; it holds no parameters."""

    def __init__(self, head_dim: int, patch: int):
        super().__init__()
        self.head_dim, self.patch = head_dim, patch

    def forward(self, h: int, w: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.embeddings import get_2d_rotary_pos_embed_from_grid

        rows, columns = h // self.patch, w // self.patch
        start, stop = fit_into_base(rows, columns, ROPE_BASE_PIXELS // 8 // self.patch)
        # np.linspace(start, stop, n, endpoint=False) per axis, as ComfyUI's get_meshgrid (float64, then
        # float32). diffusers' get_2d_rotary_pos_embed scales only the stop by (n − 1)/n, which differs
        # wherever the grid does not start at 0: every image that is not square.
        axes = [(torch.arange(n, dtype=torch.float64) * ((b - a) / n) + a).float().to(device)
                for a, b, n in zip(start, stop, (rows, columns))]
        grid = torch.stack(torch.meshgrid(axes[1], axes[0], indexing="xy"))  # [2, rows, columns]: column, row
        return get_2d_rotary_pos_embed_from_grid(self.head_dim, grid.unsqueeze(1), use_real=True)  # [N, D] each


def fit_into_base(rows: int, columns: int, base: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The (top, left) and (bottom, right) a rows × columns grid spans when resized to fit a square
    base × base grid and centred (comfy/ldm/hydit/posemb_layers.py get_fill_resize_and_crop)."""
    if rows > columns:
        height, width = base, int(round(base / rows * columns))
    else:
        height, width = int(round(base / columns * rows)), base
    top, left = int(round((base - height) / 2.0)), int(round((base - width) / 2.0))
    return (top, left), (top + height, left + width)


class HunyuanDiTProcessor:
    """HunyuanDiT's self-attention (``attn1``: QK layer norm, RoPE on queries and keys) whose attention
    itself is ``core(q, k, v, text_tokens=0)`` on [B, S, H, D] (sequence parallelism's USPAttention)."""

    def __init__(self, core):
        self.core = core

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is not None or attention_mask is not None:
            raise NotImplementedError("HunyuanDiTProcessor is for HunyuanDiT's self-attention (attn1) only")

        def heads(t):  # [B, S, H·D] → [B, S, H, D]
            return t.unflatten(-1, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))  # layer norm over D
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:  # this rank's rows of the table: its tokens' positions
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = self.core(query, key, value, text_tokens=0).flatten(2, 3).to(query.dtype)  # [B, S, H·D]
        return attn.to_out[1](attn.to_out[0](out))


# teacache: the polynomial that maps the relative change of the first block's time embedding between
# steps to the change of the model's output: fitted on hunyuan-dit-tiny (random weights; no trained weights
# here), tools/fit_teacache.py, data and fit in docs/step-cache.md. Refit on a trained file.
TEACACHE = (-0.2438, 0.4233, -0.1111)


@dataclass(frozen=True)
class HunyuanDiTSpec(FamilySpec):
    context_dim: int  # Chinese CLIP (BERT) width: 1024
    mt5_dim: int  # mT5-XL width: 2048
    text_len: int  # CLIP tokens whose padding is replaced: 77
    mt5_len: int  # mT5 tokens the pooler reads (and whose padding is replaced): 256
    heads: int
    blocks: int
    size_conditioning: bool  # 1.0 / 1.1: image size and style embedded; 1.2: neither

    family = "hunyuan_dit"
    latent_format = latent_formats.SDXL  # comfy/supported_models.py HunyuanDiT
    parallel_methods = frozenset({"dp", "cfg", "ring", "ulysses", "pipefusion"})
    takes_shift = False  # discrete V-prediction sampling
    optional_conditioning = ("context_mask", "context_mt5_mask")
    # comfy/model_base.py HunyuanDiT.extra_conds: the options CLIPTextEncodeHunyuanDiT's encoder sets
    comfy_conditioning = {"attention_mask": "context_mask", "conditioning_mt5xl": "context_mt5",
                          "attention_mask_mt5xl": "context_mt5_mask"}
    sequence_plan = SequencePlan(
        cuts=(Cut("pos_embed", None, 1),  # the patch tokens [B, N, D]
              Cut("rotary_table", None, 0)),  # RoPE (cos, sin) [N, head_dim] each
        attention=(("attn1", HunyuanDiTProcessor),))  # cross-attention (attn2) reads the whole text
    takes_controlnets = True  # Tencent's 1.2 ControlNets (models/hunyuan_dit_controlnet.py)
    # a ControlNet: its patch embedding's outputs (the latent's, the hint's) and its RoPE cut as the model's
    control_plan = SequencePlan(cuts=(Cut("pos_embed", None, 1), Cut("rotary_table", None, 0)),
                                attention=(("attn1", HunyuanDiTProcessor),), gather=None)
    stage_plan = StagePlan(block_lists=("blocks",), attention=(("attn1", HunyuanDiTProcessor, False),),
                           carries=True)  # the long skips travel with the patch
    cache_plan = CachePlan(blocks=("blocks",),
                           returns={"blocks": ("hidden_states",)},
                           probe="temb", teacache=TEACACHE)

    @classmethod
    def from_config(cls, config: dict) -> HunyuanDiTSpec:
        return cls(config.get("cross_attention_dim", 1024), config.get("cross_attention_dim_t5", 2048),
                   config.get("text_len", 77), config.get("text_len_t5", 256), config.get("num_attention_heads", 16),
                   config.get("num_layers", 28), bool(config.get("use_style_cond_and_image_meta_size", True)))

    def model_sampling(self, shift: float | None) -> VSampling:
        return VSampling(LINEAR_START, LINEAR_END[self.size_conditioning], beta_schedule="linear")

    def conditioning_shapes(self, batch: int, text_tokens: int) -> dict[str, tuple[int | None, ...]]:
        """CLIP tokens as the context, mT5 tokens of any count (ComfyUI pads them to at least 256)."""
        return {"context": (batch, text_tokens, self.context_dim), "context_mt5": (batch, None, self.mt5_dim)}


class HunyuanDiTModel(DiffusionModel):
    """A loaded HunyuanDiT transformer; ``output`` is ComfyUI's HunYuanDiT.forward on diffusers' modules."""

    def __init__(self, transformer, *args, **kwargs):
        super().__init__(transformer, *args, **kwargs)
        # each block's layer, taken before a PipeFusion stage drops the others (it decides the skips)
        self.layers = {block: layer for layer, block in enumerate(transformer.blocks)}
        if not hasattr(transformer, "rotary_table"):
            config = transformer.config
            transformer.rotary_table = RotaryTable(config.attention_head_dim, config.patch_size)

    def output(self, x, timestep, cond, guidance) -> torch.Tensor:
        """v for x [B, 4, h, w] (already scaled by 1/√(σ²+1)) at the discrete timestep [B] (float32)."""
        t = self.transformer
        b, c, h, w = x.shape
        text = self._text(cond)  # [B, L1 + L2, 1024]
        temb = self._embedding(timestep, cond, b, h, w)  # [B, D]
        controls = self._control_residuals(x, timestep, cond)  # [B, N/P, D] per skip, or None
        rope = t.rotary_table(h, w, device=self.device)  # (cos, sin) [N, head_dim]; cut to N/P
        hidden = t.pos_embed(x.to(self.device, self.dtype))  # [B, N, D]; cut to [B, N/P, D]
        kwargs = {"text": text, "temb": temb, "rope": rope, "carry": [], "controls": controls}
        for block in t.blocks:
            hidden, _ = self.run_block(block, hidden, None, kwargs)
        hidden = t.proj_out(t.norm_out(hidden, temb.to(torch.float32)))  # [B, N, p·p·2C]; gathered
        return self.unpatchify(hidden, tuple(x.shape))

    # PipeFusion's stage methods (base.DiffusionModel)

    def positions(self, shape):
        return self.transformer.rotary_table(shape[-2], shape[-1], device=self.device)  # (cos, sin) [N, head_dim]

    def step_inputs(self, shape, timestep, cond, guidance) -> dict:
        b, (h, w) = cond["context"].shape[0], shape[-2:]  # b: cond and uncond batched, the latent's batch × 2
        return {"text": self._text(cond), "temb": self._embedding(timestep, cond, b, h, w)}

    def embed(self, x, tokens, inputs, positions):
        return self.transformer.pos_embed(x.to(self.device, self.dtype))  # [B, n, D]: no position added (RoPE)

    def block_kwargs(self, inputs, positions, tokens, text_tokens):
        return {**inputs, "rope": tuple(table[tokens] for table in positions)}  # (cos, sin) [n, head_dim]

    def run_block(self, block, image, text, kwargs):
        """One block; block ``depth − 1 − layer``'s output is popped as the skip of a second-half block,
        and a first-half block's output pushed for its partner (``kwargs["carry"]``: the patch's skips)."""
        layer, depth, skips = self.layers[block], self.spec.blocks, kwargs["carry"]
        skip = skips.pop() if layer > depth // 2 else None
        if skip is not None and kwargs.get("controls"):  # ComfyUI: skips.pop() + controls.pop(), last first
            skip = skip + kwargs["controls"].pop()
        image = block(image, encoder_hidden_states=kwargs["text"], temb=kwargs["temb"],
                      image_rotary_emb=kwargs["rope"], skip=skip)
        if layer < depth // 2 - 1:
            skips.append(image)
        return image, text

    def carried(self, block) -> int:
        """Skips pushed by the layers before ``block`` (those < depth/2 − 1) less those popped (> depth/2)."""
        layer, half = self.layers[block], self.spec.blocks // 2
        return min(layer, half - 1) - max(0, layer - half - 1)

    def head(self, image, inputs, tokens):
        t = self.transformer
        return t.proj_out(t.norm_out(image, inputs["temb"].to(torch.float32)))  # [B, n, p·p·2C]

    def unpatchify(self, tokens, shape):
        """[B, n, p·p·2C] of a band → v [B, C, rows, w]; the learned variance dropped, as ComfyUI does."""
        b, c, h, w = shape
        p = self.transformer.config.patch_size
        patches = tokens.reshape(b, h // p, w // p, p, p, -1)  # [B, rows, columns, p, p, 2C]
        return torch.einsum("nhwpqc->nchpwq", patches).reshape(b, -1, h, w)[:, :c]  # [B, C, h, w]

    def _control_residuals(self, x, timestep, cond) -> list | None:
        """The residual of each skip from the ControlNets active at this timestep, times their strengths and summed
        in their order (ComfyUI's control_merge), or None. Each ControlNet computes its text and time from its own
        modules; it must have a block per skip, as ComfyUI's model requires."""
        if not self.controlnets:
            return None  # before reading σ on the host: every step of every generation passes here
        sigma = float(self.spec.model_sampling(None).sigma(timestep[:1].float().cpu())[0])
        active = [control for control in self.controlnets if control.active(sigma)]
        if not active:
            return None
        skips, b, (h, w) = self.spec.blocks // 2 - 1, x.shape[0], x.shape[-2:]
        sums = None
        for control in active:
            network = control.network
            if len(network.blocks) != skips:
                raise UserError(f"a HunyuanDiT ControlNet of {len(network.blocks)} blocks for a model with {skips} "
                                "long skips", "use a ControlNet made for this model (HunyuanDiT 1.2's: 19 blocks)")
            samples = network(x.to(self.device, self.dtype), control.hint.expand(b, -1, -1, -1),
                              self._text(cond, network), self._embedding(timestep, cond, b, h, w, network))
            adds = [sample * control.strength for sample in samples]  # StrengthType.CONSTANT
            sums = adds if sums is None else [a + s for a, s in zip(sums, adds)]
        return sums

    def _text(self, cond: dict, network=None) -> torch.Tensor:
        """[CLIP; projected mT5] tokens [B, L1 + L2, 1024], the last 77 (256) padded tokens of each
        replaced by the padding table's rows, as ComfyUI's HunYuanDiT.forward does (by ``network``'s modules: the
        model's, or a ControlNet's own)."""
        t, spec = network or self.transformer, self.spec
        clip = cond["context"].to(self.device, self.dtype)  # [B, L1, 1024]
        mt5 = cond["context_mt5"].to(self.device, self.dtype)  # [B, L2, 2048]
        for name, tokens, least in (("context", clip, spec.text_len), ("context_mt5", mt5, spec.mt5_len)):
            if tokens.shape[1] < least:
                raise UserError(f"{name} has {tokens.shape[1]} tokens; HunyuanDiT takes at least {least} "
                                f"(ComfyUI's encoders pad to {least})",
                                "encode the prompt with CLIPTextEncodeHunyuanDiT or ComfyUI's HunyuanDiT text encoders")
        b, l2, _ = mt5.shape
        mt5 = t.text_embedder(mt5.reshape(b * l2, -1)).view(b, l2, -1)  # [B, L2, 1024]
        padding = t.text_embedding_padding.to(self.dtype)  # [77 + 256, 1024]
        sides = []
        for tokens, key, rows in ((clip, "context_mask", padding[:spec.text_len]),
                                  (mt5, "context_mt5_mask", padding[spec.text_len:])):
            mask = cond.get(key)
            if mask is not None:
                tail = mask[:, -len(rows):].to(self.device).bool().unsqueeze(2)  # [B, n, 1]
                tokens = torch.cat([tokens[:, :-len(rows)], torch.where(tail, tokens[:, -len(rows):], rows)], dim=1)
            sides.append(tokens)
        return torch.cat(sides, dim=1)

    def _embedding(self, timestep: torch.Tensor, cond: dict, b: int, h: int, w: int, network=None) -> torch.Tensor:
        """The time embedding (from float32 timesteps, as ComfyUI's t_embedder) plus the pooled mT5
        (its first 256 tokens) and, for 1.0 / 1.1, the image size and style: [B, D] (by ``network``'s modules)."""
        embed = (network or self.transformer).time_extra_emb
        mt5 = cond["context_mt5"][:, :self.spec.mt5_len].to(self.device, self.dtype)  # [B, 256, 2048]
        # comfy/model_base.py HunyuanDiT.extra_conds: [height, width, target height, target width,
        # crop top, crop left] in pixels, the latent's size when no option sets them
        size = torch.tensor([h * 8.0, w * 8.0, h * 8.0, w * 8.0, 0.0, 0.0], device=self.device).repeat(b, 1)
        style = torch.zeros(b, dtype=torch.long, device=self.device)  # ComfyUI passes no style: 0
        return embed(timestep.to(self.device, torch.float32), mt5, size, style, hidden_dtype=self.dtype)
