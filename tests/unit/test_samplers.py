"""Schedulers and samplers: sensible on toy denoisers everywhere, and equal to ComfyUI's own functions
when a ComfyUI checkout is given (COMFYUI_DIR)."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from xdit_backend.sampling.generate import GenerationStopped
from xdit_backend.sampling.model_sampling import EpsSampling, FlowSampling
from xdit_backend.sampling.samplers import SAMPLERS, StepNoise, final_sigma, sample
from xdit_backend.sampling.schedulers import SCHEDULERS, sigmas

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's own math")

pytestmark = pytest.mark.filterwarnings("ignore:Should have:UserWarning")  # ComfyUI's torchsde calls

MODELS = {"flow": FlowSampling(3.0), "flux": FlowSampling(1.15, flux=True), "eps": EpsSampling()}
SHAPE = (2, 4, 3, 5)


def randn(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def toy_denoiser(target):
    """A row-wise x0 that depends on x and σ, pulled towards ``target`` [1, C, ...] (the same for every row)."""
    def denoise(x, sigma):
        s = sigma.view(-1, *(1,) * (x.dim() - 1))
        return target + 0.2 * torch.tanh(x) * s / (1 + s)
    return denoise


def start(ms, sig, shape=SHAPE, seed=0):
    """The noised latent a sampler starts from (an empty latent)."""
    return ms.noise_scaling(sig[0], randn(shape, seed), torch.zeros(shape))


# -- without ComfyUI ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("model", MODELS)
def test_a_constant_x0_is_reached(name, model):
    """With x0 fixed every sampler ends on it (uni_pc within its final VP time 0.001)."""
    ms, target = MODELS[model], randn(SHAPE, 1)
    sig = sigmas("karras", ms, 8, sampler=name)
    out = sample(name, lambda x, s: target.clone(), start(ms, sig), sig, ms, StepNoise(SHAPE, 3))
    assert torch.allclose(out, target, atol=1e-2 if name == "uni_pc" else 1e-5)


@pytest.mark.parametrize("name", SAMPLERS)
def test_five_dim_latents_and_a_rank_s_rows(name):
    """A video latent [B, C, T, h, w]: row 1 alone equals row 1 of the whole batch."""
    shape, ms = (2, 4, 2, 3, 3), MODELS["flow"]
    sig, denoise = sigmas("simple", ms, 5, sampler=name), toy_denoiser(randn((1, *shape[1:]), 1))
    x = start(ms, sig, shape)
    whole = sample(name, denoise, x, sig, ms, StepNoise(shape, 9))
    row = sample(name, denoise, x[1:], sig, ms, StepNoise(shape, 9, rows=slice(1, 2)))
    assert torch.isfinite(whole).all() and torch.allclose(row, whole[1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", SAMPLERS)
def test_after_step_false_stops(name):
    """after_step sees (done, total) once per step; False raises GenerationStopped there."""
    ms, seen = MODELS["eps"], []
    sig = sigmas("normal", ms, 6)

    def after_step(done, total):
        seen.append((done, total))
        return done < 3

    with pytest.raises(GenerationStopped):
        sample(name, toy_denoiser(torch.zeros(SHAPE)), start(ms, sig), sig, ms, StepNoise(SHAPE, 0), after_step)
    assert seen == [(1, 6), (2, 6), (3, 6)]


def test_no_step_to_take_returns_the_latent():
    """An empty or one-σ schedule runs no step and never calls the denoiser."""
    x = randn(SHAPE, 0)
    for name in SAMPLERS:
        for sig in (torch.FloatTensor([]), torch.FloatTensor([0.5])):
            assert sample(name, None, x, sig, MODELS["flow"], StepNoise(SHAPE, 0)) is x


def test_step_noise_rows_are_the_slice_of_the_whole_draw():
    """Default and Brownian noise for rows 1..3 are those rows of the whole batch's draws, call by call."""
    shape, sig = (4, 2, 3, 3), sigmas("simple", MODELS["eps"], 4)
    whole, part = StepNoise(shape, 5), StepNoise(shape, 5, rows=slice(1, 3))
    for make in (lambda n: n.default(), lambda n: n.brownian(sig[sig > 0].min(), sig.max())):
        draw_whole, draw_part = make(whole), make(part)
        for i in range(3):
            a, b = draw_whole(sig[i], sig[i + 1]), draw_part(sig[i], sig[i + 1])
            assert a.shape == shape and torch.equal(b, a[1:3])


def test_default_noise_restarts_from_the_seed():
    """Each default() is a fresh generator seeded with the seed: its first draw is randn(seed)."""
    noise, s = StepNoise(SHAPE, 11), torch.tensor(1.0)
    assert torch.equal(noise.default()(s, s), randn(SHAPE, 11))
    assert torch.equal(noise.default()(s, s), randn(SHAPE, 11))


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("model", MODELS)
def test_schedules_fall_to_zero_and_denoise_takes_the_tail(scheduler, model):
    """[steps + 1] decreasing σ ending at 0; denoise 0.5 is the tail of the doubled schedule; ≤ 0 is empty."""
    ms = MODELS[model]
    full = sigmas(scheduler, ms, 10)
    assert full.dtype == torch.float32 and full[-1] == 0 and (full[1:] < full[:-1]).all()
    assert full.shape == (11,) or scheduler == "beta"  # beta drops repeated table entries
    assert torch.equal(sigmas(scheduler, ms, 5, denoise=0.5), full[-6:])
    assert sigmas(scheduler, ms, 5, denoise=0.0).numel() == 0


def test_uni_pc_schedules_one_step_more_and_drops_the_next_to_last():
    """As KSampler does for uni_pc: steps + 1 σ, then the penultimate one removed."""
    ms = MODELS["flow"]
    longer = sigmas("normal", ms, 9)
    assert torch.equal(sigmas("normal", ms, 8, sampler="uni_pc"), torch.cat([longer[:-2], longer[-1:]]))
    assert final_sigma("uni_pc", longer) == torch.tensor(0.001) and final_sigma("euler", longer) == 0


def test_unknown_names_list_the_valid_ones():
    """A misspelt scheduler or sampler names every valid choice."""
    with pytest.raises(ValueError, match="simple, normal, karras, exponential, sgm_uniform, beta"):
        sigmas("karas", MODELS["flow"], 4)
    with pytest.raises(ValueError, match="euler, euler_ancestral, heun, dpmpp_2m, dpmpp_2m_sde, uni_pc"):
        sample("eulr", None, torch.zeros(SHAPE), torch.ones(2), MODELS["flow"], None)


# -- against ComfyUI ---------------------------------------------------------------------------


def comfy():
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.extra_samplers.uni_pc
    import comfy.k_diffusion.sampling
    import comfy.model_sampling
    import comfy.samplers

    return comfy


def their_sampling(c, model):
    """ComfyUI's model sampling object for one of MODELS, built as comfy.model_base builds it."""
    if model == "eps":
        config = SimpleNamespace(sampling_settings={"beta_schedule": "sqrt_linear", "linear_start": 0.0001,
                                                    "linear_end": 0.02, "timesteps": 1000})

        class Eps(c.model_sampling.ModelSamplingDiscrete, c.model_sampling.EPS):
            pass

        return Eps(config)
    base = c.model_sampling.ModelSamplingFlux if model == "flux" else c.model_sampling.ModelSamplingDiscreteFlow

    class Const(base, c.model_sampling.CONST):
        pass

    theirs = Const()
    theirs.set_parameters(shift=MODELS[model].shift)
    return theirs


class TheirModel:
    """Stands in for ComfyUI's KSamplerX0Inpaint: ``model(x, σ·s_in, **extra_args)`` gives x0, and the
    model sampling sits where their samplers look (inner_model.inner_model / inner_model.model_patcher)."""

    def __init__(self, denoise, model_sampling):
        self.denoise = denoise
        self.inner_model = SimpleNamespace(inner_model=SimpleNamespace(model_sampling=model_sampling),
                                           model_patcher=SimpleNamespace(get_model_object=lambda name: model_sampling))

    def __call__(self, x, sigma, **extra_args):
        return self.denoise(x, sigma)


def their_sample(c, name, model, x, sig, seed):
    fn = (c.extra_samplers.uni_pc.sample_unipc if name == "uni_pc"
          else getattr(c.k_diffusion.sampling, f"sample_{name}"))
    return fn(model, x.clone(), sig, extra_args={"seed": seed}, callback=None, disable=True)


@needs_comfyui
@pytest.mark.parametrize("denoise", [1.0, 0.6])
@pytest.mark.parametrize("steps", [1, 4, 20])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_sigmas_match_ksampler(scheduler, model, steps, denoise):
    """KSampler's sigmas (its denoise slicing, uni_pc's dropped σ) equal ours bit for bit."""
    c = comfy()
    ms = their_sampling(c, model)
    patcher = SimpleNamespace(get_model_object=lambda name: ms)
    for sampler in ("euler", "uni_pc"):
        theirs = c.samplers.KSampler(patcher, steps, "cpu", sampler, scheduler, denoise).sigmas
        assert torch.equal(sigmas(scheduler, MODELS[model], steps, denoise, sampler=sampler), theirs)


@needs_comfyui
@pytest.mark.parametrize("model", ["flow", "eps"])
def test_model_sampling_extras_match_comfyui(model):
    """σ_min/σ_max, σ(timestep) and percent_to_sigma, which the schedulers and dpmpp_2m_sde read."""
    c, ours = comfy(), MODELS[model]
    theirs = their_sampling(c, model)
    assert torch.equal(ours.sigma_min, theirs.sigma_min) and torch.equal(ours.sigma_max, theirs.sigma_max)
    t = torch.linspace(ours.timestep(ours.sigma_max), ours.timestep(ours.sigma_min), 13)
    assert torch.equal(ours.sigma(t), theirs.sigma(t))
    for percent in (0.0, 1e-4, 0.3, 1.0):
        assert ours.percent_to_sigma(percent) == theirs.percent_to_sigma(percent)


SCHEDULES = [("normal", 7), ("karras", 2), ("beta", 3), ("simple", 1)]  # uni_pc's orders 3, 1, 2 and none


@needs_comfyui
@pytest.mark.parametrize("denoise", [1.0, 0.6])
@pytest.mark.parametrize(("scheduler", "steps"), SCHEDULES)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", SAMPLERS)
def test_samplers_match_comfyui(name, model, scheduler, steps, denoise):
    """ComfyUI's sampler function and ours from the same latent, denoiser and seed: the same latent
    bit for bit for the batch of 2, and rank-style row 1 alone their row 1 (bit-equal here too)."""
    c, ms, seed = comfy(), MODELS[model], 42
    sig = sigmas(scheduler, ms, steps, denoise, sampler=name)
    denoise_fn, x = toy_denoiser(randn((1, *SHAPE[1:]), 1)), start(ms, sig)
    theirs = their_sample(c, name, TheirModel(denoise_fn, their_sampling(c, model)), x, sig.clone(), seed)
    ours = sample(name, denoise_fn, x, sig, ms, StepNoise(SHAPE, seed))
    row = sample(name, denoise_fn, x[1:], sig, ms, StepNoise(SHAPE, seed, rows=slice(1, 2)))
    assert torch.equal(ours, theirs)
    assert torch.allclose(row, theirs[1:], rtol=0, atol=1e-5)


class TheirWrap:
    """Stands in for the CFGGuider that ComfyUI's KSAMPLER.sample is given."""

    def __init__(self, denoise, model_sampling):
        self.denoise = denoise
        self.inner_model = SimpleNamespace(model_sampling=model_sampling)
        self.model_patcher = SimpleNamespace(get_model_object=lambda name: model_sampling)

    def __call__(self, x, sigma, **model_options_and_seed):
        return self.denoise(x, sigma)


@needs_comfyui
@pytest.mark.parametrize("denoise", [1.0, 0.6])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", SAMPLERS)
def test_ksampler_path_matches_comfyui(name, model, denoise):
    """KSAMPLER.sample end to end (noise scaling, sampler, inverse scaling) from a non-empty latent
    equals noise_scaling → sample → inverse_noise_scaling(final_sigma)."""
    c, ms, seed = comfy(), MODELS[model], 7
    sig = sigmas("karras", ms, 6, denoise, sampler=name)
    denoise_fn, noise, latent = toy_denoiser(randn((1, *SHAPE[1:]), 1)), randn(SHAPE, 2), randn(SHAPE, 3)
    theirs = c.samplers.sampler_object(name).sample(
        TheirWrap(denoise_fn, their_sampling(c, model)), sig.clone(), {"seed": seed, "model_options": {}}, None,
        noise.clone(), latent_image=latent, disable_pbar=True)
    x = sample(name, denoise_fn, ms.noise_scaling(sig[0], noise, latent), sig, ms, StepNoise(SHAPE, seed))
    assert torch.equal(ms.inverse_noise_scaling(final_sigma(name, sig), x), theirs)


@needs_comfyui
def test_uni_pc_leaves_its_final_sigma_in_the_schedule():
    """ComfyUI's uni_pc writes 0.001 over a final σ = 0 in the caller's sigmas: final_sigma says so."""
    c, ms = comfy(), MODELS["flow"]
    sig = sigmas("simple", ms, 5, sampler="uni_pc")
    theirs = sig.clone()
    their_sample(c, "uni_pc", TheirModel(toy_denoiser(torch.zeros(SHAPE)), their_sampling(c, "flow")),
                 start(ms, sig), theirs, 0)
    assert torch.equal(theirs[-1], final_sigma("uni_pc", sig))
