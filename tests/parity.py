"""Serial references for the parity tests, computed once per (request fields, conditioning) in a session.

A request's conditioning is named here (tensors are not hashable): None is the conditioning rank 0 makes up
from the seed for a request without tensors; the others are prompts the tests send."""

import json
from functools import cache

import torch
from conftest import flux_tiny_conditioning

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

TOLERANCE = 1e-4  # float32: of the latent's largest value, absolute below 1 (tests/backend/test_parity.py)


def uneven_cogvideox() -> dict:
    """7 text tokens (5B takes any length): with 30 video tokens (2 frames × 3 × 5), neither divides by 4."""
    generator = torch.Generator().manual_seed(3)
    return {"context": torch.randn(1, 7, 64, generator=generator),
            "negative_context": torch.randn(1, 7, 64, generator=generator)}


def ti2v_first_frame(batch: int = 1) -> dict:
    """Wan22ImageToVideoLatent's LATENT for wan-ti2v-tiny at 128² px, 5 frames ([1, 48, 2, 8, 8]): the start image's
    latent in the first frame (raw), the mean elsewhere (process_out of zero), and its noise mask, 0 on that frame."""
    from xdit_backend.models import latent_formats

    generator = torch.Generator().manual_seed(5)
    latent = latent_formats.WAN22.process_out(torch.zeros(batch, 48, 2, 8, 8))
    latent[:, :, :1] = torch.randn(batch, 48, 1, 8, 8, generator=generator)
    mask = torch.ones(batch, 1, 2, 8, 8)
    mask[:, :, :1] = 0.0
    return {"latent": latent, "noise_mask": mask}


TI2V = {"model": "wan-ti2v-tiny", "width": 128, "height": 128, "frames": 5, "steps": 3, "seed": 7, "cfg": 3.5}

# Each family at a size whose token count (32) every degree below divides; cfg 3.5 with the built-in's seeded
# negative, so cfg=2 has two passes to split
SIZES = {
    "sd3-tiny": {"width": 128, "height": 64},
    "flux-fill-tiny": {"width": 128, "height": 64},  # 32 image tokens, 80 channels concatenated (image, 8×8 mask)
    "flux-kontext-tiny": {"width": 128, "height": 64},  # 32 image tokens and 15 of the reference's, drawn from the seed
    "pixart-tiny": {"width": 128, "height": 64},
    "wan-tiny": {"width": 64, "height": 64, "frames": 5},  # latent [1, 16, 2, 8, 8]
    # the same latent, with the start frame's latent and mask concatenated (20 channels) and 8 CLIP tokens
    "wan-i2v-tiny": {"width": 64, "height": 64, "frames": 5},
    # latent [1, 32, 2, 4, 4]: 32 image tokens (16× VAE, 1×1×1 patches); text 8 byT5 + 8 Qwen2.5-VL tokens
    "hunyuan-video-1.5-tiny": {"width": 64, "height": 64, "frames": 5},
    "z-image-tiny": {"width": 128, "height": 64},  # unified sequence: 32 image + 32 caption tokens (8 padded)
    "hunyuan-dit-tiny": {"width": 128, "height": 64},
    "flux2-tiny": {"width": 128, "height": 64},  # latent [1, 128, 4, 8]: 32 tokens (and 512 of text)
    "chroma-tiny": {"width": 128, "height": 64},  # 32 image tokens, 8 text tokens; 344 modulation vectors
    "qwen-image-tiny": {"width": 128, "height": 64},  # 4 × 8 = 32 image tokens, 8 text tokens
    "qwen-image-edit-2511-tiny": {"width": 128, "height": 64},  # and 15 reference tokens, at timestep 0
    "cogvideox-tiny": {"width": 64, "height": 64, "frames": 5},  # latent [1, 16, 2, 8, 8]: 32 tokens, text 8
    # the same latent in time patches of 2: 16 tokens, and the start image's latent concatenated
    "cogvideox-1.5-i2v-tiny": {"width": 64, "height": 64, "frames": 5},
}


def family(model: str, **extra) -> dict:
    return {"model": model, **SIZES[model], "steps": 3, "seed": 7, "cfg": 3.5, **extra}


PIPELINED = [model for model in SIZES if "pipefusion" in registry.spec(model).parallel_methods]


def bound(reference: torch.Tensor) -> float:
    return TOLERANCE * max(1.0, reference.abs().max().item())


CONDITIONING = {
    "flux": flux_tiny_conditioning,  # a batch of 2, 8 text tokens, positive and negative
    "flux-7-tokens": lambda: flux_tiny_conditioning(seed=11, batch=1, text_tokens=7),  # no degree divides 7
    "cogvideox-7-tokens": uneven_cogvideox,
    "ti2v-first-frame": ti2v_first_frame,
    "ti2v-first-frames-2": lambda: ti2v_first_frame(batch=2),  # two start images: dp takes one each
}


@cache
def conditioning(name: str | None) -> dict:
    return {} if name is None else CONDITIONING[name]()


def serial(fields: dict, name: str | None = None) -> torch.Tensor:
    """The serial latent of the request ``fields`` with the conditioning ``name`` (computed once)."""
    return _serial(json.dumps(fields, sort_keys=True), name)


@cache
def _serial(fields: str, name: str | None) -> torch.Tensor:
    return serial_latent(json.loads(fields), conditioning(name))


def serial_parts(fields: dict, tensors: dict | None = None) -> dict[str, torch.Tensor]:
    """A video-with-audio request's serial result by part (``samples``, ``audio_samples``), as the backend replies;
    without tensors of its own, from the serial latent computed once (``serial``)."""
    from xdit_backend.service.request import SampleRequest
    from xdit_backend.wire.protocol import Message

    latent = serial(fields) if tensors is None else serial_latent(fields, tensors)
    request = SampleRequest.parse(Message("sample", fields, tensors or {}))
    return request.result(registry.spec(fields["model"]), latent)


def assert_parts_equal(result: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Each part of a backend's result equals its serial one within the parity bound of that part."""
    for name in ("samples", "audio_samples"):
        assert result[name].shape == expected[name].shape, name
        assert (result[name] - expected[name]).abs().max().item() <= bound(expected[name]), name
