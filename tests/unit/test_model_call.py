"""The xDiT MODEL's model call (nodes/model_call.py): ComfyUI's diffusion-model inputs become an evaluate
request's tensors, and what would act inside the forward is refused by name, never dropped (no ComfyUI needed)."""

import pytest
import torch
from conftest import load_node_module

from xdit_backend.models import registry

model_call = load_node_module("model_call")
FLUX, SD3, PIXART = (registry.spec(name) for name in ("flux-tiny", "sd3-tiny", "pixart-tiny"))
X, T, CONTEXT = torch.randn(2, 16, 8, 8), torch.tensor([0.5, 0.5]), torch.randn(2, 8, 64)
PLAIN = {"cond_or_uncond": [0, 1], "uuids": ["a", "b"], "sigmas": torch.tensor([0.5]), "wrappers": {},
         "patches": {}, "patches_replace": {}, "sample_sigmas": torch.linspace(1, 0, 5)}


def patch_function(*args):
    return args


def test_flux_sends_x_the_timestep_per_row_its_guidance_and_its_conditioning():
    tensors, inputs = model_call.call_tensors(FLUX, X, torch.tensor([0.5]), CONTEXT, None, PLAIN,
                                              {"y": torch.randn(2, 32), "guidance": torch.tensor([3.5, 3.5])})
    assert sorted(tensors) == ["guidance", "timestep", "x"] and tensors["timestep"].shape == (2,)
    assert sorted(inputs) == ["context", "pooled"] and inputs["pooled"].dtype == torch.float32


@pytest.mark.parametrize("options, named", [
    ({"patches": {"attn1_patch": [patch_function]}}, "patches on the model's blocks or attention (attn1_patch, from "),
    ({"patches_replace": {"dit": {("double_block", 0): patch_function}}}, "a replaced attention or block (dit"),
    ({"optimized_attention_override": patch_function}, "an attention override"),
    ({"wrappers": {"diffusion_model": {"SomeNode": [patch_function]}}}, "'diffusion_model' wrapper (from SomeNode)"),
    ({"a_new_option": 1}, "the transformer option 'a_new_option'"),
])
def test_what_acts_inside_the_forward_is_refused_by_name(options, named):
    with pytest.raises(model_call.ModelCallError) as refused:
        model_call.call_tensors(SD3, X, T, CONTEXT, None, {**PLAIN, **options}, {"y": torch.randn(2, 32)})
    assert named in refused.value.message
    if "patch" in named:
        assert "test_model_call.patch_function" in refused.value.message  # where it came from


def test_sampler_side_wrappers_pass():
    model_call.call_tensors(SD3, X, T, CONTEXT, None, {**PLAIN, "wrappers": {"outer_sample": {"n": [patch_function]},
                                                                             "apply_model": {"m": [patch_function]}}},
                            {"y": torch.randn(2, 32)})


@pytest.mark.parametrize("spec, extra, named", [
    (SD3, {"ref_latents": [torch.randn(1, 16, 8, 8)]}, "reference latents (ReferenceLatent)"),
    (FLUX, {"ref_latents_method": "index"}, "places its references by 'offset'"),  # FluxKontextMultiReferenceLatentMethod
    (FLUX, {"attention_mask": torch.ones(2, 8)}, "an attention mask"),
    (SD3, {"guidance": torch.tensor([3.5, 3.5])}, "the input 'guidance'"),
])
def test_an_input_the_family_does_not_take_yet_is_refused_by_name(spec, extra, named):
    with pytest.raises(model_call.ModelCallError) as refused:
        model_call.call_tensors(spec, X, T, CONTEXT, None, PLAIN, {"y": torch.randn(2, 32), **extra})
    assert named in refused.value.message


def test_a_controlnet_and_a_family_not_yet_on_the_xdit_model_are_refused():
    with pytest.raises(model_call.ModelCallError, match="(?s)ControlNet.*sample with the xDiT Sampler instead"):
        model_call.call_tensors(SD3, X, T, CONTEXT, object(), PLAIN, {"y": torch.randn(2, 32)})
    with pytest.raises(model_call.ModelCallError, match="does not run pixart models yet"):
        model_call.call_tensors(PIXART, X, T, CONTEXT, None, PLAIN, {})


def test_the_stand_in_holds_no_weights_and_returns_what_the_backend_sends_on_xs_device():
    sent = []
    stand_in = model_call.RemoteDiffusionModel(SD3, lambda tensors, inputs, _: sent.append(inputs) or tensors["x"] * 2)
    assert not list(stand_in.parameters()) and stand_in.dtype == torch.float32
    out = stand_in(X, T, context=CONTEXT, control=None, transformer_options=PLAIN, y=torch.randn(2, 32))
    assert torch.equal(out, X * 2) and sorted(sent[0]) == ["context", "pooled"]


def test_a_timestep_per_token_is_refused_and_wan_ti2vs_per_frame_timesteps_pass():
    """ComfyUI's WAN22 under a noise mask calls its model with one timestep per row and latent frame (from the mask
    it also passes, as denoise_mask): those go to the backend as they are; any other shape is refused."""
    with pytest.raises(model_call.ModelCallError, match=r"timesteps of shape \[2, 16\] for 2 rows"):
        model_call.call_tensors(SD3, X, torch.rand(2, 16), CONTEXT, None, PLAIN, {"y": torch.randn(2, 32)})
    from xdit_backend.models.wan import WanSpec

    ti2v = WanSpec(64, 2, 2, 48, 48)
    x, per_frame = torch.randn(2, 48, 3, 4, 4), torch.rand(2, 3)
    tensors, inputs = model_call.call_tensors(ti2v, x, per_frame, torch.randn(2, 8, 64), None, PLAIN,
                                              {"denoise_mask": torch.ones(2, 48, 3, 4, 4)})
    assert torch.equal(tensors["timestep"], per_frame) and set(inputs) == {"context"}


def test_the_run_position_numbers_steps_slots_and_runs_as_the_backends_step_cache_needs_them():
    position = model_call.RunPosition()
    schedule = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])

    def call(sigma, chunks=(0, 1), rows=2, sigmas=schedule):
        return position.fields({"sample_sigmas": sigmas, "sigmas": torch.tensor([sigma] * rows),
                                "cond_or_uncond": list(chunks)}, rows)

    first = call(1.0)
    assert (first["step"], first["steps"], first["slot"], first["cond_start"], first["cond_rows"]) == (0, 4, 0, 0, 1)
    assert (call(1.0, chunks=(1, 0))["cond_start"], call(1.0, chunks=(1, 0))["cond_rows"]) == (1, 1)  # uncond first
    assert call(1.0, chunks=(1,), rows=1)["slot"] == 3 and call(1.0, chunks=(1,), rows=1)["cond_rows"] == 0
    assert (call(0.75)["step"], call(0.6)["step"], call(0.6)["slot"]) == (1, 1, 2)  # heun's second call: step 1
    again = call(1.0)  # the step went back: a new run
    assert again["generation"] != first["generation"] and again["slot"] == 0
    other = call(1.0, sigmas=torch.tensor([1.0, 0.5, 0.0]))
    assert other["generation"] != again["generation"] and other["steps"] == 2
    with pytest.raises(model_call.ModelCallError, match="sample_sigmas"):
        position.fields({"sigmas": torch.tensor([1.0])}, 1)


def test_reference_latents_go_back_to_raw_latent_space_padded_and_another_method_is_refused():
    qwen = registry.spec("qwen-image-tiny")
    x = torch.randn(1, 16, 8, 8)
    reference = torch.randn(1, 16, 1, 5, 7)
    _, inputs = model_call.call_tensors(qwen, x, torch.tensor([0.5]), torch.randn(1, 8, 64), None, PLAIN,
                                        {"ref_latents": [reference], "ref_latents_method": "index"},
                                        latent_out=lambda latent: latent * 2)
    assert inputs["reference_0"].shape == (1, 16, 6, 8)  # the frame axis dropped, padded to the 2×2 patch
    assert torch.equal(inputs["reference_0"][:, :, :5, :7], reference[:, :, 0] * 2)
    with pytest.raises(model_call.ModelCallError, match="reference latents method 'offset'"):
        model_call.call_tensors(qwen, x, torch.tensor([0.5]), torch.randn(1, 8, 64), None, PLAIN,
                                {"ref_latents": [reference], "ref_latents_method": "offset"}, latent_out=lambda t: t)
