"""The nodes' translation of ComfyUI values (CONDITIONING lists, LATENT dicts) into a request:
what is honoured, and what is refused by name rather than dropped (no ComfyUI needed)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from xdit_backend.models import registry


def load_translate():
    """The pack's nodes/translate.py by its path: `nodes` is ComfyUI's name, never imported as such."""
    path = Path(__file__).resolve().parent.parent / "nodes" / "translate.py"
    spec = importlib.util.spec_from_file_location("comfyui_xdit_translate", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


translate = load_translate()

FLUX, SD3, PIXART, WAN = (registry.spec(name) for name in ("flux-tiny", "sd3-tiny", "pixart-tiny", "wan-tiny"))


def entry(dim=64, tokens=8, **options):
    return [torch.randn(1, tokens, dim), options]


def test_flux_takes_context_pooled_and_guidance_repeated_to_the_batch():
    side = translate.conditioning([entry(pooled_output=torch.randn(1, 32), guidance=2.5)], FLUX, 3, "positive")
    assert side.tensors["context"].shape == (3, 8, 64) and side.tensors["pooled"].shape == (3, 32)
    assert torch.equal(side.tensors["context"][0], side.tensors["context"][2]) and side.guidance == 2.5


def test_wan_takes_the_context_alone_and_ignores_a_missing_pooled_output():
    side = translate.conditioning([entry(pooled_output=None)], WAN, 1, "positive")
    assert set(side.tensors) == {"context"} and side.guidance is None


def test_guidance_is_dropped_for_a_model_without_a_guidance_embedding():
    side = translate.conditioning([entry(pooled_output=torch.randn(1, 32), guidance=3.5)], SD3, 1, "positive")
    assert side.guidance is None and set(side.tensors) == {"context", "pooled"}


@pytest.mark.parametrize(("options", "named"), [
    ({"area": (8, 8, 0, 0)}, "an area"),
    ({"mask": torch.ones(1, 8, 8)}, "a mask"),
    ({"control": object()}, "a ControlNet"),
    ({"start_percent": 0.2}, "a timestep range"),
    ({"end_percent": 0.5}, "a timestep range"),
    ({"something_new": 1}, "the option 'something_new'"),
])
def test_conditioning_the_backend_cannot_honour_is_refused_by_name(options, named):
    with pytest.raises(translate.TranslationError, match=f"negative conditioning carries {named}"):
        translate.conditioning([entry(pooled_output=torch.randn(1, 32), **options)], FLUX, 1, "negative")


def test_a_full_timestep_range_is_the_default_and_accepted():
    translate.conditioning([entry(pooled_output=torch.randn(1, 32), start_percent=0.0, end_percent=1.0)],
                           FLUX, 1, "positive")


def test_several_entries_are_refused():
    with pytest.raises(translate.TranslationError, match="has 2 entries"):
        translate.conditioning([entry(), entry()], WAN, 1, "positive")


def test_a_missing_pooled_output_and_a_wrong_width_say_what_to_use():
    with pytest.raises(translate.TranslationError, match="no pooled output, which a sd3 model needs"):
        translate.conditioning([entry()], SD3, 1, "positive")
    with pytest.raises(translate.TranslationError, match=r"context has shape \[1, 8, 4096\]"):
        translate.conditioning([entry(dim=4096, pooled_output=torch.randn(1, 32))], SD3, 1, "positive")


def test_latent_geometry_for_images_and_video():
    geometry, samples = translate.latent({"samples": torch.zeros(2, 16, 8, 16)}, SD3)
    assert (geometry.width, geometry.height, geometry.frames, geometry.batch) == (128, 64, 1, 2) and samples is None
    video = torch.randn(1, 16, 3, 8, 8)
    geometry, samples = translate.latent({"samples": video}, WAN)
    assert (geometry.width, geometry.height, geometry.frames) == (64, 64, 9) and torch.equal(samples, video)


@pytest.mark.parametrize(("value", "spec", "message"), [
    ({"samples": torch.zeros(1, 4, 8, 8)}, FLUX, "EmptySD3LatentImage"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, PIXART, "EmptyLatentImage"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, WAN, "video latent"),
    ({"samples": torch.zeros(1, 16, 8, 8), "noise_mask": torch.ones(1, 8, 8)}, SD3, "a noise mask"),
])
def test_latents_a_model_cannot_take_are_refused_with_the_node_to_use(value, spec, message):
    with pytest.raises(translate.TranslationError) as info:
        translate.latent(value, spec)
    assert message in info.value.message + info.value.hint
