"""ControlNets on the backend, every kind (models/controlnet.py's table: Qwen-Image's InstantX layout, Flux.1's with
a union type, SD3.5's Stability layout, HunyuanDiT 1.2's, Z-Image's Fun ControlNet): under the sequence-parallel,
CFG and data-parallel layouts, sharded or not, each equals the serial generation with the same ControlNet, running
split as the model (its residuals never gathered); strength 0 is no ControlNet exactly. Then Qwen-Image's: its
percent range and a second ControlNet act as ComfyUI's, and it equals ComfyUI's own QwenImageControlNetModel with its
residuals added as comfy/ldm/qwen_image/model.py adds them (the other kinds' own checks: test_flux_controlnet.py,
test_sd3_controlnet.py, test_hunyuan_dit_controlnet.py, test_z_image_controlnet.py)."""

import functools
import os
import sys

import pytest
import torch
from parity import bound
from safetensors.torch import save_file

from xdit_backend.models import model_patch, registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

REQUEST = {"steps": 3, "seed": 13, "cfg": 2.5, "batch": 2, "dtype": "float32"}
# each kind's built-in ControlNet on its built-in model: the request and the control (Flux's with a union type: one
# more text token, cut with the text)
KINDS = {
    "qwen-image": ({**REQUEST, "model": "qwen-image-tiny", "width": 64, "height": 64},
                   {"path": "qwen-image-controlnet-tiny", "strength": 0.7}),
    "flux": ({**REQUEST, "model": "flux-tiny", "width": 64, "height": 48},
             {"path": "flux-controlnet-tiny", "strength": 0.7, "type": 3}),
    "sd3": ({**REQUEST, "model": "sd3-tiny", "width": 64, "height": 48},
            {"path": "sd3-controlnet-tiny", "strength": 0.7}),
    "hunyuan-dit": ({**REQUEST, "model": "hunyuan-dit-tiny", "width": 64, "height": 48},
                    {"path": "hunyuan-dit-controlnet-tiny", "strength": 0.7}),
    # Z-Image's Fun ControlNet (2.x layout): 80 × 48 px is 5 × 3 = 15 image tokens, so 2 and 4 ranks hold padded
    # shares of the image, of the rest (17 image pads and the caption) and of the control tokens
    "z-image": ({**REQUEST, "model": "z-image-tiny", "width": 80, "height": 48},
                {"path": "z-image-fun-controlnet-tiny", "strength": 0.7}),
}
QWEN, CONTROL = KINDS["qwen-image"]
TINY = CONTROL["path"]
LAYOUTS = [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (2, {"dp": 2}),
           (2, {"ulysses": 2, "shard_weights": True}), (4, {"ulysses": 2, "ring": 2})]


@functools.cache
def serial_with_control(kind: str) -> torch.Tensor:
    fields, control = KINDS[kind]
    return serial_latent({**fields, "controls": [control]})


@pytest.mark.parametrize("world, degrees", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_equals_serial_with_the_controlnet(shared_backends, kind, world, degrees):
    fields, control = KINDS[kind]
    result, _ = shared_backends.get(world).sample({**fields, "controls": [control], "parallel": degrees})
    expected = serial_with_control(kind)
    assert (result["samples"] - expected).abs().max() <= bound(expected)


@pytest.mark.parametrize("kind", KINDS)
def test_it_moves_the_result_and_strength_0_is_no_controlnet_exactly(backend2, kind):
    fields, control = KINDS[kind]
    plain, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}})
    off, _ = backend2.sample({**fields, "controls": [{**control, "strength": 0.0}], "parallel": {"ulysses": 2}})
    assert torch.equal(off["samples"], plain["samples"])
    expected = serial_with_control(kind)
    assert (expected - plain["samples"]).abs().max() > 100 * bound(expected)


def test_a_range_and_a_chained_controlnet_under_ring(backend2):
    """Active for the first half of the schedule only, chained with a DiffSynth patch and a second ControlNet with
    its own latent: ring=2 as serial, and the range changed the result."""
    g = torch.Generator().manual_seed(4)
    tensors = {"control_2": torch.randn(1, 16, 8, 8, generator=g)}
    controls = [{**CONTROL, "start": 0.0, "end": 0.5}, {"path": "qwen-image-diffsynth-tiny", "strength": 0.5},
                {"path": TINY, "strength": -0.4}]
    fields = {**QWEN, "batch": 1, "controls": controls}
    expected = serial_latent(fields, tensors)
    result, _ = backend2.sample({**fields, "parallel": {"ring": 2}}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
    whole_range = serial_latent({**fields, "controls": [CONTROL, *controls[1:]]}, tensors)
    assert (expected - whole_range).abs().max() > 1e-2


def test_requests_a_controlnet_cannot_serve_are_refused_with_the_reason():
    spec = registry.spec("qwen-image-tiny")
    request = SampleRequest.parse(Message("sample", {**QWEN, "controls": [CONTROL], "parallel": {"pipefusion": 2}}))
    with pytest.raises(RequestError, match="with pipefusion=2: a ControlNet runs a transformer of its own"):
        request.check_model(spec)
    with pytest.raises(RequestError, match="start 0.6, end 0.2: two numbers 0 ≤ start ≤ end ≤ 1"):
        SampleRequest.parse(Message("sample", {**QWEN, "controls": [{**CONTROL, "start": 0.6, "end": 0.2}]}))
    edit = SampleRequest.parse(Message("sample", {**QWEN, "model": "qwen-image-edit-2511-tiny", "controls": [CONTROL]},
                                       {"reference_0": torch.zeros(2, 16, 8, 8)}))
    with pytest.raises(RequestError, match="with reference latents"):
        edit.check_model(registry.spec("qwen-image-edit-2511-tiny"))


def test_a_controlnet_file_loads_as_the_built_in(tmp_path):
    """A file in InstantX's layout (diffusers' names) is told from a model patch by its keys and read with its config
    off the shapes: the same generation as the built-in it was written from."""
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    path = tmp_path / "controlnet.safetensors"
    save_file({k: v for k, v in network.state_dict().items()}, str(path))
    assert model_patch.control_family(model_patch.PatchSpec(str(path), 1.0)) is not None  # a ControlNet
    g = torch.Generator().manual_seed(5)
    tensors = {"control_0": torch.randn(1, 16, 8, 8, generator=g)}
    fields = {**QWEN, "batch": 1}
    from_file = serial_latent({**fields, "controls": [{"path": str(path), "strength": 0.7}]}, tensors)
    built_in = serial_latent({**fields, "controls": [CONTROL]}, tensors)
    assert torch.equal(from_file, built_in)


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "QwenImageControlNetModel and its residuals in the model's forward")


@needs_comfyui
def test_the_controlnet_equals_comfyuis_own():
    """ComfyUI's QwenImageControlNetModel with the same tensors, given what ControlNet.get_control gives it (the
    latent, σ as its timestep in the model's dtype, the prompt, the hint in model space), its residuals times the
    strength into ComfyUI's QwenImage forward as ``control``: our velocity with the ControlNet within 1e-5."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ranks"))
    from test_qwen_image import TINY as QWEN_TINY, comfy_and_ours, comfyui, inputs, velocity

    comfy = comfyui()
    import comfy.ldm.qwen_image.controlnet as comfy_controlnet

    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    theirs_control = comfy_controlnet.QwenImageControlNetModel(operations=comfy.ops.disable_weight_init,
                                                                **{**QWEN_TINY, "num_layers": 1})
    theirs_control.load_state_dict(network.state_dict(), strict=False)
    missing = set(theirs_control.state_dict()) - set(network.state_dict())
    assert not missing, missing
    theirs, model = comfy_and_ours(comfy)

    x, sigma, cond = inputs(4, 8, 12)
    control = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(6))
    wan21 = comfy.latent_formats.Wan21()
    with torch.no_grad():
        residuals = theirs_control(x=x[:, :, None], hint=wan21.process_in(control[:, :, None]), timesteps=sigma,
                                   context=cond["context"])["input"]
        expected = theirs(x[:, :, None], sigma, cond["context"],
                          control={"input": [r * 0.7 for r in residuals]})[:, :, 0]
        plain = theirs(x[:, :, None], sigma, cond["context"])[:, :, 0]
    spec = model_patch.PatchSpec(TINY, 0.7)
    model.model_patches = [model_patch.applied(spec, network, control, 0, (8, 12), model,
                                               model.spec.model_sampling(None))]
    ours = velocity(model, x, sigma, cond)
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-2
