"""The step loop never makes the host wait for the device: counted with sync_audit on the CPU, where
the model runs on the ``meta`` device in place of an accelerator. Conditioning, σ tables and the
per-step noise reach the device without a per-call copy; the samplers branch on host σ; the
ancestral noise is the device generator's, as ComfyUI's, or the CPU's when the ranks' GPUs differ."""

import functools
from dataclasses import replace

import pytest
import torch

from xdit_backend.bench.sync_audit import count_syncs
from xdit_backend.models import registry
from xdit_backend.models.pixart import PixArtModel, PixArtSpec
from xdit_backend.parallel.denoiser import Denoiser
from xdit_backend.sampling import noise as noise_module
from xdit_backend.sampling.generate import generate
from xdit_backend.sampling.samplers import SAMPLERS, StepNoise
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

SIZES = {"flux-tiny": {"width": 64, "height": 64}, "sd3-tiny": {"width": 64, "height": 64},
         "pixart-tiny": {"width": 64, "height": 32}, "wan-tiny": {"width": 32, "height": 32, "frames": 5}}
STEPS = 3


def pixart_alpha(device: str):
    """pixart-tiny as PixArt-α: with the size conditioning (resolution and aspect ratio)."""
    import diffusers

    config = dict(registry.BUILTINS["pixart-tiny"].config, interpolation_scale=None, use_additional_conditions=True)
    spec = PixArtSpec.from_config(config)
    assert spec.size_conditioning
    with torch.device(device):
        return PixArtModel(diffusers.PixArtTransformer2DModel(**config), "pixart-alpha", spec)


@functools.cache
def on_meta(name: str):
    """A built-in model (or ``pixart-alpha``) on the meta device, in place of an accelerator."""
    return pixart_alpha("meta") if name == "pixart-alpha" else registry.build(name, torch.device("meta"))


def generation(name: str, model, sampler: str):
    """A request's generation, cfg 3.5 with the seeded negative (both sides batched in each call)."""
    builtin = "pixart-tiny" if name == "pixart-alpha" else name
    request = SampleRequest.parse(Message("sample", {"model": builtin, **SIZES[builtin], "steps": STEPS, "seed": 7,
                                                     "cfg": 3.5, "sampler": sampler}, {}))
    positive, negative = registry.random_conditioning(builtin, request.batch, request.seed, model.spec)
    # meta has no random generator: its ancestral noise is the CPU's, copied over (the path ranks on
    # different GPU models take); a GPU's own draw has no copy at all
    return replace(request.generation(model.spec, positive, negative), cpu_noise=True)


def syncs_per_step(name: str, sampler: str) -> list[int]:
    model = on_meta(name)
    gen = generation(name, model, sampler)
    with torch.no_grad(), count_syncs(model.device) as syncs:
        generate(Denoiser(model), gen, syncs.after_step)
    return syncs.per_step


@pytest.mark.parametrize("name", [*SIZES, "pixart-alpha"])
def test_each_family_s_step_loop_has_no_host_sync(name):
    """After the first step (which holds the once-per-generation copies), no step of any family
    reads a device value on the host or copies host data to the device blocking."""
    per_step = syncs_per_step(name, "euler")
    assert len(per_step) == STEPS and per_step[1:] == [0] * (STEPS - 1), per_step


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("name", ["flux-tiny", "pixart-tiny"])
def test_each_sampler_branches_on_host_sigmas(name, sampler):
    """Every sampler, on a flow and an EPS model: coefficients and branches from host σ, noise
    copied asynchronously, so no step after the first has a sync (heun: two calls a step)."""
    per_step = syncs_per_step(name, sampler)
    assert per_step[1:] == [0] * (STEPS - 1), per_step


def test_the_audit_counts_what_it_says():
    """Reads of device values and blocking host→device copies count; asynchronous copies and
    host-only work do not; the count splits at each after_step."""
    host = torch.ones(3)
    patched = ("item", "tolist", "cpu", "__bool__", "__float__", "to", "copy_", "new_tensor")
    before = [getattr(torch.Tensor, name) for name in patched] + [torch.tensor, torch.as_tensor]
    with count_syncs("meta") as syncs:
        device = host.to("meta")  # 1: blocking copy
        host.to("meta", non_blocking=True)  # asynchronous: not counted
        float(host.sum()), bool(host[0] == 1)  # host values: not counted
        syncs.after_step(1, 3)
        bool(device[0] == 0), device.sum().item(), device.cpu(), device.tolist()  # 4 reads
        syncs.after_step(2, 3)
        torch.tensor([1.0], device="meta"), device.new_tensor([2.0])  # 2: host data onto the device
        device.copy_(host)  # 1: blocking copy into a device tensor
        syncs.after_step(3, 3)
    assert syncs.per_step == [1, 4, 3]
    assert [getattr(torch.Tensor, name) for name in patched] + [torch.tensor, torch.as_tensor] == before


def test_ancestral_noise_is_the_cpu_generator_s_when_the_ranks_gpus_differ(monkeypatch):
    """With ``cpu_generator`` (ranks on different GPU models), a rank on any device adds its rows of
    the CPU generator's draws, copied to its device without a sync, not its own device's generator,
    whose numbers differ between GPU models."""
    shape, seed, rows = (3, 2, 4, 4), 5, slice(1, 3)
    copied = []

    def record(tensor, device):
        copied.append(tensor)
        return tensor.to(device)

    monkeypatch.setattr(noise_module, "to_device", record)
    draw = StepNoise(shape, seed, rows, device="meta", cpu_generator=True).default()
    sigma, sigma_next = torch.tensor(0.8), torch.tensor(0.5)
    landed = [draw(sigma, sigma_next) for _ in range(2)]
    generator = torch.Generator().manual_seed(seed)
    expected = [torch.randn(shape, generator=generator)[rows] for _ in range(2)]
    assert all(t.device.type == "meta" and t.shape == (2, 2, 4, 4) for t in landed)
    assert len(copied) == 2 and all(torch.equal(c, e) for c, e in zip(copied, expected))


def test_by_default_ancestral_noise_is_drawn_on_the_latent_s_device_as_comfyui_draws_it(monkeypatch):
    """ComfyUI's default_noise_sampler seeds a generator on the latent's device and draws there: so
    does StepNoise unless told otherwise (no GPU here: the generator and the draw are recorded)."""
    asked = []

    class Generator:
        def __init__(self, device="cpu"):
            asked.append(("generator", torch.device(device)))

        def manual_seed(self, seed):
            return self

    def randn(shape, dtype=None, generator=None, device=None):
        asked.append(("randn", torch.device(device)))
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(torch, "Generator", Generator)
    monkeypatch.setattr(torch, "randn", randn)
    monkeypatch.setattr(noise_module, "to_device", lambda tensor, device: tensor)
    StepNoise((1, 2, 4, 4), 5, device="cuda:1").default()(torch.tensor(0.8), torch.tensor(0.5))
    assert asked == [("generator", torch.device("cuda:1")), ("randn", torch.device("cuda:1"))]


def test_brownian_noise_lands_on_the_latent_s_device():
    """dpmpp_2m_sde's Brownian-tree draws, made on the CPU from host σ, go to the latent's device."""
    draw = StepNoise((1, 2, 4, 4), 5, device="meta").brownian(torch.tensor(0.1), torch.tensor(1.0))
    assert draw(torch.tensor(0.8), torch.tensor(0.5)).device.type == "meta"


def test_pixart_alpha_size_conditioning_is_the_image_size_in_pixels():
    """PixArt-α's resolution [B, 2] is (height, width) in pixels and its aspect ratio [B, 1] height/width."""
    size = pixart_alpha("cpu")._size_conditioning(2, 8, 12)
    assert torch.equal(size["resolution"], torch.tensor([[64.0, 96.0], [64.0, 96.0]]))
    assert torch.equal(size["aspect_ratio"], torch.tensor([[8 / 12], [8 / 12]]))
