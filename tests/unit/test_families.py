"""The families in-process: Wan's 5-D latents, step ranges that split one generation into two (Wan 2.2's two
experts), and the requests a family cannot run (each family's layouts against serial: test_parity.py)."""

import pytest
from parity import family, serial

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

TOLERANCE = 1e-4


def test_wan_latent_is_video_shaped():
    assert serial(family("wan-tiny")).shape == (1, 16, 2, 8, 8)  # 5 frames → 1 + 4/4 latent frames; 64 px / 8


def test_two_step_ranges_equal_one_run():
    """High-noise expert to step 2 with its leftover noise, then the low-noise expert from step 2
    without new noise (KSamplerAdvanced, as ComfyUI's Wan 2.2 workflow does) = one 4-step run."""
    whole = serial_latent(family("wan-tiny", steps=4))
    first = serial_latent(family("wan-tiny", steps=4, end_step=2, return_with_leftover_noise=True))
    second = serial_latent(family("wan-tiny", steps=4, start_step=2, add_noise=False), {"latent": first})
    assert (second - whole).abs().max() <= 1e-5
    assert (first - whole).abs().max() > 100 * TOLERANCE  # the first half alone is not the result


@pytest.mark.parametrize(("extra", "message"), [
    ({"frames": 6}, "frames 6 is not 1 \\+ a multiple of 4"),
    ({"width": 72}, "width 72 is not a multiple of 16"),
    ({"guidance": 3.5}, "has no guidance embedding"),
    ({"end_step": 9}, "end_step 9 is past the last of 3 steps"),
])
def test_requests_a_family_cannot_run_are_refused(extra, message):
    request = SampleRequest.parse(Message("sample", family("wan-tiny", **extra), {}))
    with pytest.raises(RequestError, match=message):
        request.check_model(registry.spec("wan-tiny"))


def test_an_image_model_refuses_frames_and_pixart_refuses_a_shift():
    for model, extra, message in (("sd3-tiny", {"frames": 5}, "makes images, not videos"),
                                  ("pixart-tiny", {"shift": 3.0}, "no flow shift")):
        request = SampleRequest.parse(Message("sample", family(model, **extra), {}))
        with pytest.raises(RequestError, match=message):
            request.check_model(registry.spec(model))
