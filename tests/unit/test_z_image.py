"""Z-Image's attention processor in one process: with a plain attention core it computes what
diffusers' own processor computes, and the core sees only the unified sequence of the main blocks
(the refiners' sequences are not cut, so they never go through sequence-parallel attention)."""

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
