"""Z-Image in one process: its own block loop computes what diffusers' forward does; with a plain attention core its
attention processor computes what diffusers' own processor computes, and the core sees only the main blocks'
sequence (the refiners' sequences are not cut, so they never go through sequence-parallel attention)."""

import torch
import torch.nn.functional as F

from xdit_backend.models import registry
from xdit_backend.models.z_image import ZImageAttention


def test_the_core_gets_the_main_blocks_unified_sequence_and_the_output_is_unchanged():
    model = registry.build("z-image-tiny", torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    x, context = torch.randn(1, 16, 8, 14, generator=g), torch.randn(1, 9, 64, generator=g)  # 4 × 7 = 28 tokens
    with torch.no_grad():
        expected = model.output(x, torch.tensor([0.4]), {"context": context}, None)
    seen = []

    def core(q, k, v, text_tokens):  # [B, S, H, D]
        seen.append((q.shape[1], text_tokens))
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    saved = model.transformer.attn_processors
    for name, module in model.transformer.named_modules():
        if name.endswith(".attention"):
            module.set_processor(ZImageAttention(core))
    with torch.no_grad():
        out = model.output(x, torch.tensor([0.4]), {"context": context}, None)
    model.transformer.set_attn_processor(saved)
    assert seen == [(32 + 32, 0)] * 2  # image 28 → 32, caption 9 → 32; two main blocks, no refiner
    assert (out - expected).abs().max() <= 1e-6


def test_its_own_block_loop_computes_diffusers_forward():
    """ZImageModel.output runs diffusers' modules from its own loop (a Fun ControlNet runs between them): the same
    output as diffusers' ZImageTransformer2DModel.forward, with and without image pad tokens, batch 1 and 2."""
    from xdit_backend.models.z_image import time_embedded_in

    model = registry.build("z-image-tiny", torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for batch, rows, columns, text in [(1, 8, 14, 9), (2, 8, 8, 32), (2, 6, 10, 5)]:  # 28, 16, 15 image tokens
        x, context = torch.randn(batch, 16, rows, columns, generator=g), torch.randn(batch, text, 64, generator=g)
        sigma = torch.full((batch,), 0.4)
        with torch.no_grad(), time_embedded_in(model.transformer.t_embedder, model.dtype):
            frames = model.transformer(list(x.unsqueeze(2).unbind(0)), 1 - sigma, list(context.unbind(0)),
                                       return_dict=False)[0]  # B × [16, 1, h, w]
        expected = -torch.stack(frames).squeeze(2)
        with torch.no_grad():
            ours = model.output(x, sigma, {"context": context}, None)
        assert (ours - expected).abs().max() <= 1e-5 * expected.abs().max()
