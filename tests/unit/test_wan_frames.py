"""Wan 2.2 TI2V-5B under a noise mask, in one process: a PipeFusion chunk's tokens take the modulation of their own
frames, equal to diffusers' per-token form of the whole sequence at those tokens (the layouts against serial and
ComfyUI: tests/backend/test_parity.py, tests/host/test_xdit_model.py)."""

import torch

from xdit_backend.models import registry


def test_a_chunks_tokens_are_modulated_by_their_own_frames():
    model = registry.build("wan-ti2v-tiny", torch.device("cpu"), torch.float32)
    shape = (2, 48, 3, 8, 8)  # [B, C, T, h, w]: 3 frames × 4 × 4 = 48 tokens
    generator = torch.Generator().manual_seed(4)
    mask = torch.ones(shape)
    mask[:, :, 0] = 0.0  # the first frame fixed
    mask[1, :, 2, :4] = 0.0  # half of row 1's last frame kept: its mean 0.5
    cond = {"context": torch.randn(2, 5, 64, generator=generator), "denoise_mask": mask}
    timestep = torch.tensor([700.0, 250.0])
    inputs = model.step_inputs(shape, timestep, cond, None)
    tokens = torch.tensor([1, 15, 16, 17, 30, 33, 47])  # a sequence rank's share of a band, across all frames

    per_token = (mask.mean(dim=(1, 3, 4)) * timestep[:, None]).repeat_interleave(16, dim=1)  # [B, 48]
    embedder = model.transformer.condition_embedder
    temb, projection, _, _ = embedder(per_token.flatten(), cond["context"], None, timestep_seq_len=48)
    expected = projection.unflatten(2, (6, -1))[:, tokens]  # [B, n, 6, D]
    assert torch.allclose(model.block_kwargs(inputs, model.positions(shape), tokens, 0)["temb"], expected, atol=1e-6)

    image = torch.randn(2, len(tokens), model.width, generator=generator)
    t = model.transformer
    shift, scale = (t.scale_shift_table.unsqueeze(0) + temb[:, tokens].unsqueeze(2)).chunk(2, dim=2)
    head = t.proj_out(t.norm_out(image) * (1 + scale.squeeze(2)) + shift.squeeze(2))
    assert torch.allclose(model.head(image, inputs, tokens), head, atol=1e-6)
    assert not torch.allclose(inputs["projection"][:, 0], inputs["projection"][:, 1])  # the frames differ
