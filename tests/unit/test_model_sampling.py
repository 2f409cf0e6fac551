"""Model sampling and latent formats per family, against ComfyUI's own classes when a ComfyUI
checkout is given (COMFYUI_DIR); the schedules' shape everywhere."""

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from xdit_backend.models import latent_formats, registry
from xdit_backend.sampling.generate import cut
from xdit_backend.sampling.model_sampling import EpsSampling, FlowSampling

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's own math")


def comfy():
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.latent_formats
    import comfy.model_sampling
    import comfy.samplers

    return comfy


@pytest.mark.parametrize("sampling", [FlowSampling(3.0), FlowSampling(8.0), FlowSampling(1.0), EpsSampling(),
                                      FlowSampling(1.15, flux=True)], ids=repr)
@pytest.mark.parametrize("steps", [1, 4, 30])
def test_schedules_fall_to_zero(sampling, steps):
    sigmas = sampling.sigmas(steps)
    assert sigmas.shape == (steps + 1,) and sigmas[-1] == 0.0 and (sigmas[1:] < sigmas[:-1]).all()


def test_a_step_range_is_cut_as_ksampler_advanced_cuts_it():
    """end: the first sigmas up to end_step, then 0 (or its own σ with leftover noise); start: from there."""
    full = FlowSampling(8.0).sigmas(10)
    assert torch.equal(cut(full, 0, 4, leftover_noise=True), full[:5])
    assert torch.equal(cut(full, 0, 4), torch.cat([full[:4], torch.zeros(1)]))
    assert torch.equal(cut(full, 4), full[4:])
    assert cut(full, 10).numel() == 1  # past the end: no step to run
    assert full[4] != 0  # cut works on a copy


@needs_comfyui
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 8.0])
@pytest.mark.parametrize("steps", [1, 20, 28])
def test_discrete_flow_matches_comfyui(shift, steps):
    """SD3 and Wan: ModelSamplingDiscreteFlow's sigmas, simple schedule and timesteps, exactly."""
    c = comfy()
    theirs = c.model_sampling.ModelSamplingDiscreteFlow()
    theirs.set_parameters(shift=shift, multiplier=1000)
    ours = FlowSampling(shift)
    assert torch.equal(ours.table(), theirs.sigmas)
    assert torch.equal(ours.sigmas(steps), c.samplers.simple_scheduler(theirs, steps))
    sigma = ours.sigmas(steps)[:-1]
    assert torch.equal(ours.timestep(sigma), theirs.timestep(sigma))


@needs_comfyui
@pytest.mark.parametrize("steps", [1, 20, 50])
def test_pixart_eps_sampling_matches_comfyui(steps):
    """PixArt: ModelSamplingDiscrete over its sqrt_linear betas with EPS, step by step."""
    c = comfy()

    class Config:
        sampling_settings = {"beta_schedule": "sqrt_linear", "linear_start": 0.0001, "linear_end": 0.02,
                             "timesteps": 1000}

    class Theirs(c.model_sampling.ModelSamplingDiscrete, c.model_sampling.EPS):
        pass

    theirs, ours = Theirs(Config()), EpsSampling()
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, steps))
    x, noise, latent = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for sigma in sigmas[:-1]:
        assert torch.equal(ours.timestep(sigma.view(1)), theirs.timestep(sigma.view(1)).float())
        assert torch.equal(ours.calculate_input(sigma.view(1), x), theirs.calculate_input(sigma.view(1), x))
        assert torch.equal(ours.calculate_denoised(sigma.view(1), noise, x),
                           theirs.calculate_denoised(sigma.view(1), noise, x))
    at_max = sigmas[0]  # a full generation starts at σ_max: ComfyUI's max_denoise scaling
    assert torch.equal(ours.noise_scaling(at_max, noise, latent),
                       theirs.noise_scaling(at_max, noise.clone(), latent, max_denoise=True))
    assert torch.equal(ours.noise_scaling(sigmas[1], noise, latent),
                       theirs.noise_scaling(sigmas[1], noise.clone(), latent, max_denoise=False))


@needs_comfyui
@pytest.mark.parametrize("size_conditioning", [False, True], ids=["HunyuanDiT-1.2", "HunyuanDiT1-1.0-1.1"])
@pytest.mark.parametrize("steps", [1, 20, 50])
def test_hunyuan_dit_v_sampling_matches_comfyui(size_conditioning, steps):
    """HunyuanDiT (1.2) and HunyuanDiT1 (1.0 / 1.1): ModelSamplingDiscrete over ComfyUI's default
    "linear" betas, V-prediction, each with its own linear_end, through the family's spec; SDXL latents."""
    c = comfy()
    models = importlib.import_module("comfy.supported_models")
    supported = models.HunyuanDiT1 if size_conditioning else models.HunyuanDiT

    class Config:
        sampling_settings = supported.sampling_settings

    class Theirs(c.model_sampling.ModelSamplingDiscrete, c.model_sampling.V_PREDICTION):
        pass

    spec = registry.FAMILIES["hunyuan_dit"].spec({"use_style_cond_and_image_meta_size": size_conditioning})
    theirs, ours = Theirs(Config()), spec.model_sampling(None)
    assert supported.latent_format is c.latent_formats.SDXL and spec.latent_format == latent_formats.SDXL
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, steps))
    x, output, latent = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    for sigma in sigmas[:-1]:
        assert torch.equal(ours.timestep(sigma.view(1)), theirs.timestep(sigma.view(1)).float())
        assert torch.equal(ours.calculate_input(sigma.view(1), x), theirs.calculate_input(sigma.view(1), x))
        assert torch.equal(ours.calculate_denoised(sigma.view(1), output, x),
                           theirs.calculate_denoised(sigma.view(1), output, x))
    assert torch.equal(ours.noise_scaling(sigmas[0], output, latent),
                       theirs.noise_scaling(sigmas[0], output.clone(), latent, max_denoise=True))


@needs_comfyui
@pytest.mark.parametrize(("ours", "name", "shape"), [
    (latent_formats.FLUX, "Flux", (1, 16, 4, 4)), (latent_formats.SD3, "SD3", (1, 16, 4, 4)),
    (latent_formats.SD15, "SD15", (1, 4, 4, 4)), (latent_formats.SDXL, "SDXL", (1, 4, 4, 4)),
    (latent_formats.WAN21, "Wan21", (1, 16, 2, 4, 4)), (latent_formats.WAN22, "Wan22", (1, 48, 2, 4, 4))],
    ids=lambda v: v if isinstance(v, str) else None)
def test_latent_formats_match_comfyui(ours, name, shape):
    theirs = getattr(comfy().latent_formats, name)()
    latent = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(ours.process_in(latent), theirs.process_in(latent), rtol=1e-6, atol=1e-6)
    assert torch.allclose(ours.process_out(latent), theirs.process_out(latent), rtol=1e-6, atol=1e-6)


@needs_comfyui
def test_hunyuan_video15_sampling_and_latent_format_match_comfyui():
    """HunyuanVideo 1.5 (newer than the snapshot): Comfy-Org/ComfyUI's supported_models.HunyuanVideo15 samples
    with ModelType.FLOW at shift 7.0, and latent_formats.HunyuanVideo15 is a plain LatentFormat with
    scale_factor 1.03682 (32 channels, no shift); the snapshot's classes with those settings give our numbers."""
    from xdit_backend.models.hunyuan_video15 import HunyuanVideo15Spec

    c = comfy()
    spec = HunyuanVideo15Spec(context_dim=3584, byt5_dim=1472, heads=16, blocks=54)
    theirs = c.model_sampling.ModelSamplingDiscreteFlow()
    theirs.set_parameters(shift=7.0, multiplier=1000)
    ours = spec.model_sampling(None)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigma = ours.sigmas(20)[:-1]
    assert torch.equal(ours.timestep(sigma), theirs.timestep(sigma))
    latent_format = type("HunyuanVideo15", (c.latent_formats.LatentFormat,),
                         {"latent_channels": 32, "latent_dimensions": 3, "scale_factor": 1.03682})()
    latent = torch.randn(1, 32, 2, 4, 4, generator=torch.Generator().manual_seed(4))
    assert spec.latent_format.channels == 32 and spec.vae_factor == 16
    assert torch.allclose(spec.latent_format.process_in(latent), latent_format.process_in(latent), rtol=1e-6, atol=1e-6)
    assert torch.allclose(spec.latent_format.process_out(latent), latent_format.process_out(latent), rtol=1e-6,
                          atol=1e-6)


@needs_comfyui
@pytest.mark.parametrize("steps", [1, 8, 30])
def test_z_image_sampling_matches_comfyui(steps):
    """Z-Image: ModelSamplingDiscreteFlow at ComfyUI's ZImage sampling_settings (shift 3, multiplier 1:
    the model sees σ itself; comfy/supported_models.py, newer than the snapshot, which has the class),
    and Flux's latent format (Lumina2's, which ZImage inherits)."""
    from xdit_backend.models.z_image import ZImageSpec

    c = comfy()

    class Config:
        sampling_settings = {"shift": 3.0, "multiplier": 1.0}

    class Theirs(c.model_sampling.ModelSamplingDiscreteFlow, c.model_sampling.CONST):  # model_base: ModelType.FLOW
        pass

    theirs = Theirs(Config())
    spec = ZImageSpec(context_dim=2560, heads=30, blocks=34, layers=30)
    ours = spec.model_sampling(None)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, steps))
    x, output = (torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2))
    for sigma in sigmas[:-1]:
        assert torch.equal(ours.timestep(sigma.view(1)), theirs.timestep(sigma.view(1)))
        assert torch.equal(ours.calculate_denoised(sigma.view(1), output, x),
                           theirs.calculate_denoised(sigma.view(1), output, x))
    assert spec.latent_format is latent_formats.FLUX
    supported_models = importlib.import_module("comfy.supported_models")
    assert supported_models.Lumina2.latent_format is c.latent_formats.Flux


@needs_comfyui
@pytest.mark.parametrize("steps", [1, 4, 50])
def test_flux2_sampling_is_comfyui_model_sampling_flux_at_shift_2_02(steps):
    """Flux.2 is newer than the snapshot; current ComfyUI's Flux2 config (Comfy-Org/ComfyUI
    comfy/supported_models.py: a Flux subclass, sampling_settings shift 2.02) runs ModelSamplingFlux,
    which the snapshot has: the same sigmas, simple schedule and timesteps (σ itself)."""
    from xdit_backend.models import registry

    c = comfy()
    theirs = c.model_sampling.ModelSamplingFlux()
    theirs.set_parameters(shift=2.02)
    ours = registry.spec("flux2-tiny").model_sampling(None)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, steps))
    assert torch.equal(ours.timestep(sigmas[:-1]), theirs.timestep(sigmas[:-1]))


def test_flux2_latent_format_is_the_identity_on_128_channels():
    """Current ComfyUI's latent_formats.Flux2 (newer than the snapshot): 128 channels (32 × a 2×2 patch)
    at 1/16 of the pixels, process_in and process_out the identity."""
    from xdit_backend.models import registry

    spec = registry.spec("flux2-tiny")
    latent = torch.randn(1, 128, 4, 4, generator=torch.Generator().manual_seed(4))
    assert torch.equal(spec.latent_format.process_in(latent), latent)
    assert torch.equal(spec.latent_format.process_out(latent), latent)
    assert spec.latent_shape(1, width=1024, height=768) == (1, 128, 48, 64)


@needs_comfyui
@pytest.mark.parametrize("steps", [1, 20, 50])
def test_qwen_image_sampling_and_latent_format_match_comfyuis_model_config(steps):
    """Qwen-Image as ComfyUI sets it up (supported_models.QwenImage: ModelType.FLUX, shift 1.15, Wan21
    latents, which ComfyUI carries as [B, 16, 1, h, w]): the same sigmas, timesteps and scaled latent."""
    c = comfy()
    model_base, supported_models = (importlib.import_module(f"comfy.{name}") for name in ("model_base", "supported_models"))
    config = supported_models.QwenImage({"image_model": "qwen_image"})
    theirs = model_base.model_sampling(config, model_base.ModelType.FLUX)
    spec = registry.spec("qwen-image-tiny")
    ours = spec.model_sampling(None)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(steps)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, steps))
    assert torch.equal(ours.timestep(sigmas[:-1]), theirs.timestep(sigmas[:-1]))
    latent = torch.randn(2, 16, 6, 10, generator=torch.Generator().manual_seed(4))
    comfy_format = config.latent_format  # an instance once the config is built
    assert torch.allclose(spec.latent_format.process_in(latent), comfy_format.process_in(latent[:, :, None])[:, :, 0],
                          rtol=1e-6, atol=1e-6)
    assert torch.allclose(spec.latent_format.process_out(latent),
                          comfy_format.process_out(latent[:, :, None])[:, :, 0], rtol=1e-6, atol=1e-6)


@needs_comfyui
@pytest.mark.parametrize("shift", [3.1, 1.73])
def test_a_qwen_image_shift_is_comfyuis_model_sampling_aura_flow(shift):
    """Qwen-Image's workflows set the shift with ModelSamplingAuraFlow (ComfyUI's template: 3.1): the
    loader's shift gives that node's discrete flow at multiplier 1 (sigmas, schedule, timesteps)."""
    c = comfy()
    nodes = importlib.import_module("comfy_extras.nodes_model_advanced")

    class Model:  # what the node reads and writes of a ModelPatcher
        model = SimpleNamespace(model_config=SimpleNamespace(sampling_settings={}))
        patches = {}

        def clone(self):
            return self

        def add_object_patch(self, name, value):
            self.patches[name] = value

    theirs = nodes.ModelSamplingAuraFlow().patch_aura(Model(), shift)[0].patches["model_sampling"]
    ours = registry.spec("qwen-image-tiny").model_sampling(shift)
    assert torch.equal(ours.table(), theirs.sigmas)
    sigmas = ours.sigmas(20)
    assert torch.equal(sigmas, c.samplers.simple_scheduler(theirs, 20))
    assert torch.equal(ours.timestep(sigmas[:-1]), theirs.timestep(sigmas[:-1]))
