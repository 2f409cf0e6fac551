"""The families through a backend beyond the parity table (test_parity.py): step ranges over the socket, an edit
model's reference latent, and the image-to-video inputs."""

import pytest
from parity import TOLERANCE, bound, family, serial

from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent

def test_step_ranges_through_the_backend(backend2):
    """The same split over the socket, under a parallel layout."""
    base = {**family("wan-tiny", steps=4), "parallel": {"ulysses": 2}}
    whole, _ = backend2.sample(base)
    first, _ = backend2.sample({**base, "end_step": 2, "return_with_leftover_noise": True})
    second, _ = backend2.sample({**base, "start_step": 2, "add_noise": False}, {"latent": first["samples"]})
    assert (second["samples"] - whole["samples"]).abs().max() <= TOLERANCE


def test_a_reference_latent_through_the_backend_changes_qwen_image_and_stays_exact_under_ulysses_and_pipefusion(
        backend2):
    """An edit request end to end: the reference latent (reference_0, as --reference-latent and the nodes send
    it) moves the result well beyond the tolerance, and ulysses=2 and pipefusion=2 (full warm-up: the reference
    tokens travel with the chunk) give the serial latent. 10 × 6 latent cells of reference: 15 reference tokens
    with the 32 image tokens, which 2 does not divide (padded shares)."""
    message = family("qwen-image-tiny")
    spec = registry.spec("qwen-image-tiny")
    positive, negative = registry.random_conditioning("qwen-image-tiny", 1, 7, spec, references=((6, 10),))
    tensors = {**positive, **{f"negative_{key}": value for key, value in negative.items()}}
    serial = serial_latent(message, tensors)
    for degrees in ({"ulysses": 2}, {"pipefusion": 2, "num_pipeline_patch": 2, "warmup_steps": message["steps"]}):
        result, _ = backend2.sample({**message, "parallel": degrees}, tensors)
        difference = (result["samples"] - serial).abs().max().item()
        assert difference <= bound(serial), f"{degrees} with a reference: max |parallel − serial| = {difference:.3g}"
    without, _ = backend2.sample({**message, "parallel": {"ulysses": 2}},
                                 {k: v for k, v in tensors.items() if "reference" not in k})
    assert (without["samples"] - serial).abs().max() > 10 * bound(serial)  # 0.09: 50 × the bound (random weights)


def test_flux_kontext_tinys_own_reference_moves_the_result():
    """flux-kontext-tiny is flux-tiny (the same weights and seeded text) given a reference drawn from the seed: its
    serial latent differs from flux-tiny's by far more than the parity tolerance (its layouts: test_parity.py)."""
    kontext = serial(family("flux-kontext-tiny"))
    plain = serial({**family("flux-kontext-tiny"), "model": "flux-tiny"})
    assert (kontext - plain).abs().max() > 100 * bound(kontext)


@pytest.mark.parametrize("model", ["wan-i2v-tiny", "hunyuan-video-1.5-tiny", "cogvideox-1.5-i2v-tiny"])
def test_image_to_video_inputs_each_move_the_result_and_a_wrong_frame_count_is_named(backend2, model):
    """Wan 2.1 I2V's, HunyuanVideo 1.5's and CogVideoX1.5-I2V's image-to-video inputs end to end, under ComfyUI's
    names (as an --embeds file or the nodes send them): the start frame's latent, the frame mask and the image
    encoder's tokens (CLIP-H's, SigLIP's), those the model takes, each move the result by far more than the parity
    tolerance (the layouts' parity is in test_parity.py); a start latent whose frames are not the video's is refused
    naming both counts (CogVideoX's is padded, as ComfyUI pads it), and the backend serves on."""
    import torch

    from xdit_backend.client import BackendError

    message = {**family(model), "parallel": {"ulysses": 2}}
    spec = registry.spec(model)
    latent = spec.latent_shape(1, message["width"], message["height"], message["frames"])
    positive, negative = registry.random_conditioning(model, 1, 7, spec, latent=latent)
    tensors = {**positive, **{f"negative_{key}": value for key, value in negative.items()}}
    base, _ = backend2.sample(message, tensors)
    generator = torch.Generator().manual_seed(8)
    for key in [key for key in ("concat_latent_image", "concat_mask", "clip_vision_output") if key in tensors]:
        other = torch.randn(tensors[key].shape, generator=generator)  # not a constant: the embedder's LayerNorm
        changed = {**tensors, key: other, f"negative_{key}": other}  # takes a constant shift out
        moved, _ = backend2.sample(message, changed)
        # random weights: HunyuanVideo's 8 SigLIP tokens among 16 of text move it least, ~55 × the bound
        assert (moved["samples"] - base["samples"]).abs().max() > 20 * bound(base["samples"]), key
    short = {**tensors, "concat_latent_image": tensors["concat_latent_image"][:, :, :1]}
    if model.startswith("cogvideox"):
        backend2.sample(message, short)  # its frames padded with zeros (model_base.CogVideoX.concat_cond)
    else:
        with pytest.raises(BackendError, match=r"concat_latent_image has 1 frames; the latent has 2"):
            backend2.sample(message, short)
    again, _ = backend2.sample(message, tensors)
    assert torch.equal(again["samples"], base["samples"])
