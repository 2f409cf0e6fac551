"""Noise, schedule and the whole generation against independent references (ComfyUI's math)."""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from xdit_backend.models import registry
from xdit_backend.sampling.generate import comfy_noise
from xdit_backend.sampling.schedules import flux_sigmas

FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159  # ComfyUI latent_formats.Flux


@pytest.mark.parametrize("seed", [0, 1, 42, 2**32 + 7, 2**64 - 1])
@pytest.mark.parametrize("shape", [(1, 16, 8, 8), (2, 16, 128, 96)])
def test_noise_is_comfyuis_noise(seed, shape):
    """The backend's noise equals torch.manual_seed(seed); torch.randn(shape), bit for bit."""
    torch.manual_seed(seed)
    expected = torch.randn(shape)
    assert torch.equal(comfy_noise(shape, seed), expected)


def test_noise_leaves_the_global_generator_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    comfy_noise((1, 16, 4, 4), 9)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("steps", [1, 4, 20, 28])
def test_flux_sigmas_shape(steps):
    sigmas = flux_sigmas(steps, 1.15)
    assert sigmas.shape == (steps + 1,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert (sigmas[1:] < sigmas[:-1]).all()


@pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                    reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's own schedule")
@pytest.mark.parametrize("steps,shift", [(1, 1.15), (4, 1.15), (20, 1.15), (28, 3.0), (50, 0.5)])
def test_flux_sigmas_match_comfyui(steps, shift):
    """Same sigmas as ComfyUI's ModelSamplingFlux + simple scheduler, exactly."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.model_sampling
    import comfy.samplers

    sampling = comfy.model_sampling.ModelSamplingFlux()
    sampling.set_parameters(shift=shift)
    assert torch.equal(flux_sigmas(steps, shift), comfy.samplers.simple_scheduler(sampling, steps))


# ----------------------------------------------------------------------------- end to end


def pack_ref(x):
    """b c (h 2) (w 2) → b (h w) (c 2 2), written with unfold (not the code under test)."""
    b, c, h, w = x.shape
    patches = x.unfold(2, 2, 2).unfold(3, 2, 2)  # [B, C, h/2, w/2, 2, 2]
    return patches.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_ref(tokens, h, w):
    return F.fold(tokens.transpose(1, 2), output_size=(h, w), kernel_size=2, stride=2)  # [B, C, h, w]


def ids_ref(h, w):
    rows, cols = torch.meshgrid(torch.arange(h // 2), torch.arange(w // 2), indexing="ij")
    return torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()


def reference_generation(transformer, seed, steps, cfg, guidance, positive, negative, latent=None):
    """A plain loop over the diffusers transformer with ComfyUI's sampling math, for flux-tiny."""
    shape = latent.shape if latent is not None else (positive["context"].shape[0], 16, 8, 16)
    torch.manual_seed(seed)
    noise = torch.randn(shape)
    start = torch.zeros(shape) if latent is None else (latent - FLUX_SHIFT) * FLUX_SCALE
    sigmas = flux_sigmas(steps, 1.15)  # checked against ComfyUI above
    x = sigmas[0] * noise + (1 - sigmas[0]) * start
    h, w = shape[2], shape[3]

    def x0(x, sigma, cond):
        b = x.shape[0]
        v = transformer(hidden_states=pack_ref(x), encoder_hidden_states=cond["context"],
                        pooled_projections=cond["pooled"], timestep=torch.full((b,), float(sigma)),
                        img_ids=ids_ref(h, w), txt_ids=torch.zeros(cond["context"].shape[1], 3),
                        guidance=torch.full((b,), guidance), return_dict=False)[0]
        return x - unpack_ref(v, h, w) * sigma

    for i in range(steps):
        denoised = x0(x, sigmas[i], positive)
        if cfg != 1.0:
            uncond = x0(x, sigmas[i], negative)
            denoised = uncond + (denoised - uncond) * cfg
        x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return x / FLUX_SCALE + FLUX_SHIFT


@pytest.mark.parametrize("cfg,img2img", [(1.0, False), (3.5, False), (1.0, True)], ids=["plain", "cfg", "img2img"])
def test_backend_equals_a_plain_diffusers_loop(backend2, cfg, img2img):
    """Through a world-2 backend's socket: the latent equals the reference loop's to float tolerance."""
    model = registry.build("flux-tiny", torch.device("cpu"))
    positive = {"context": torch.randn(1, 6, 64), "pooled": torch.randn(1, 32)}
    negative = {"context": torch.randn(1, 6, 64), "pooled": torch.randn(1, 32)}
    latent = torch.randn(1, 16, 8, 16) if img2img else None
    fields = {"model": "flux-tiny", "width": 128, "height": 64, "steps": 4, "seed": 11, "cfg": cfg, "guidance": 2.5}
    tensors = {**positive, **{f"negative_{k}": v for k, v in negative.items()}}
    if latent is not None:
        tensors["latent"] = latent
    result, _ = backend2.sample(fields, tensors)
    with torch.no_grad():
        expected = reference_generation(model.transformer, 11, 4, cfg, 2.5, positive, negative, latent)
    assert result["samples"].shape == expected.shape
    assert (result["samples"] - expected).abs().max() <= 1e-5
