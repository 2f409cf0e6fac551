"""LTX-2 (video with audio, ComfyUI's LTXAV on diffusers' modules): both outputs of every layout equal serial's,
the audio and the video really attend to each other, and image to video (LTXVImgToVideo's noise mask: a timestep
per token) keeps its fixed frame."""

import pytest
import torch

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

# 160 × 96 px × 17 frames: 3 × 3 × 5 = 45 video tokens (no degree below divides them: padded shares) and 17 audio
# latent frames (25 fps); cfg 3 with the built-in's seeded negative
LTX23 = {"model": "ltx2-tiny", "width": 160, "height": 96, "frames": 17, "steps": 3, "seed": 7, "cfg": 3.0}
EVEN = {**LTX23, "width": 128, "height": 128}  # 3 × 4 × 4 = 48 video tokens: every degree divides them
LTX20 = {**EVEN, "model": "ltx2.0-tiny"}
BATCH = {**EVEN, "batch": 2}


def image_to_video() -> dict:
    """LTXVImgToVideo's LATENT for EVEN: an encoded start image in the first latent frame, noise mask 0 there (strength
    1), 1 elsewhere: [1, 1, F, 1, 1]."""
    generator = torch.Generator().manual_seed(4)
    latent = torch.zeros(1, 128, 3, 4, 4)
    latent[:, :, :1] = torch.randn(1, 128, 1, 4, 4, generator=generator)
    mask = torch.ones(1, 1, 3, 1, 1)
    mask[:, :, :1] = 0.0
    return {"latent": latent, "noise_mask": mask}


def serial_parts(fields: dict, tensors: dict | None = None) -> dict[str, torch.Tensor]:
    request = SampleRequest.parse(Message("sample", fields, tensors or {}))
    return request.result(registry.spec(fields["model"]), serial_latent(fields, tensors))


ROWS = [
    *((LTX23, world, degrees) for world, degrees in [
        (2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (4, {"ulysses": 2, "ring": 2}), (4, {"ulysses": 4})]),
    (EVEN, 2, {"ulysses": 2}),
    (EVEN, 4, {"cfg": 2, "ring": 2}),
    (LTX20, 2, {"ring": 2}),
    (BATCH, 2, {"dp": 2}),
    (EVEN, 2, {"ulysses": 2, "shard_weights": True}),
]


@pytest.mark.parametrize("fields,world,degrees", [
    pytest.param(*row, id=f"{row[0]['model']}-{row[0]['width']}x{row[0]['height']}-b{row[0].get('batch', 1)}-world"
                 f"{row[1]}-" + "x".join(f"{k}{v}" for k, v in row[2].items())) for row in ROWS])
def test_video_and_audio_equal_serial(fields, world, degrees, backend):
    expected = serial_parts(fields)
    result, info = backend(world).sample({**fields, "parallel": degrees})
    assert info["world_size"] == world
    for name in ("samples", "audio_samples"):
        assert result[name].shape == expected[name].shape, name
        bound = 1e-4 * max(1.0, expected[name].abs().max().item())
        assert (result[name] - expected[name]).abs().max().item() <= bound, name


def test_image_to_video_equals_serial_and_keeps_its_frame(backend):
    """A timestep per video token (0 on the start frame) cut with the tokens; the start frame comes back as given."""
    tensors = image_to_video()
    expected = serial_parts(EVEN, tensors)
    assert (expected["samples"][:, :, :1] - tensors["latent"][:, :, :1]).abs().max() < 1e-5  # the sampler's rounding
    assert (expected["samples"][:, :, 1:] - tensors["latent"][:, :, 1:]).abs().max() > 0.1  # the rest is made
    result, _ = backend(2).sample({**EVEN, "parallel": {"ulysses": 2}}, tensors)
    for name in ("samples", "audio_samples"):
        assert (result[name] - expected[name]).abs().max().item() <= 1e-4 * max(1.0, expected[name].abs().max())
