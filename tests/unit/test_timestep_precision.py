"""Under bf16 weights the sinusoidal time embedding still gets float32 timesteps, as in ComfyUI:
1000·σ (and Flux's 1000·guidance) are never rounded to the weights' dtype first, neither in the
model's forward nor in the PipeFusion stage path."""

import functools
from types import SimpleNamespace

import pytest
import torch

from xdit_backend.models import registry

# each family's time projection (diffusers' Timesteps module): its input is what gets embedded
TIME_PROJECTION = {
    "flux-tiny": "time_text_embed.time_proj",
    "sd3-tiny": "time_text_embed.time_proj",
    "wan-tiny": "condition_embedder.timesteps_proj",
    "pixart-tiny": "adaln_single.emb.time_proj",
    "flux2-tiny": "time_guidance_embed.time_proj",
    "cogvideox-tiny": "time_proj",
}
LATENT = {"flux-tiny": (1, 16, 4, 4), "sd3-tiny": (1, 16, 4, 4), "wan-tiny": (1, 16, 2, 4, 4),
          "pixart-tiny": (1, 4, 4, 4), "flux2-tiny": (1, 128, 4, 4), "cogvideox-tiny": (1, 16, 2, 4, 4)}
SIGMA = 0.7371  # 1000·σ = 737.1: bf16 holds 736 there (spacing 4), and σ itself rounds to 0.73828
GUIDANCE = 3.5  # 1000·g = 3500: bf16 holds 3504


@functools.cache
def bf16_model(name: str):
    return registry.build(name, torch.device("cpu"), torch.bfloat16)


def embedded_inputs(name: str, path: str) -> tuple[list[torch.Tensor], object]:
    """What the time projection of a bf16 ``name`` receives in one model call at σ = SIGMA."""
    model = bf16_model(name)
    spec = model.spec
    positive, _ = registry.random_conditioning(name, 1, 0, spec)
    sampling = spec.model_sampling(None)
    guidance = GUIDANCE if spec.default_guidance is not None else None
    seen = []
    hook = model.transformer.get_submodule(TIME_PROJECTION[name]).register_forward_pre_hook(
        lambda module, args: seen.append(args[0]))
    sigma = torch.tensor([SIGMA])
    try:
        with torch.no_grad():
            if path == "forward":
                gen = SimpleNamespace(sampling=sampling, guidance=guidance)
                model.predict_x0(torch.randn(LATENT[name]), sigma, positive, gen)
            else:  # PipeFusion's per-step inputs
                model.step_inputs(LATENT[name], sampling.timestep(sigma), positive, guidance)
    finally:
        hook.remove()
    return seen, sampling


@pytest.mark.parametrize("path", ["forward", "stage"])
@pytest.mark.parametrize("name", ["flux-tiny", "sd3-tiny", "wan-tiny", "flux2-tiny"])
def test_flow_families_embed_float32_thousand_sigma(name, path):
    """Flux, SD3, Wan and Flux.2 embed 1000·σ in float32 (Flux-dev and Flux.2-dev also 1000·guidance), as
    ComfyUI does."""
    seen, _ = embedded_inputs(name, path)
    expected = [torch.tensor([SIGMA]) * 1000]
    if name in ("flux-tiny", "flux2-tiny"):  # a guidance-distilled model: its guidance is embedded the same way
        expected.append(torch.tensor([GUIDANCE]) * 1000)
    assert [t.dtype for t in seen] == [torch.float32] * len(expected)
    assert all(torch.equal(t, e) for t, e in zip(seen, expected))


@pytest.mark.parametrize("path", ["forward", "stage"])
@pytest.mark.parametrize("name", ["pixart-tiny", "cogvideox-tiny"])
def test_discrete_families_embed_their_timestep_in_float32(name, path):
    """PixArt's and CogVideoX's nearest discrete timestep reaches the embedding as a float32 whole number."""
    seen, sampling = embedded_inputs(name, path)
    sigmas = sampling.table()
    nearest = (sigmas.log() - torch.tensor(SIGMA).log()).abs().argmin()  # the index of the nearest σ in log
    assert len(seen) == 1 and seen[0].dtype == torch.float32
    assert torch.equal(seen[0], nearest.float().view(1))
