"""Qwen-Image's DiffSynth block-wise ControlNet (a ComfyUI model patch) on the backend: under every layout it
equals the serial generation with the same patch, it moves the result well beyond that, strength 0 is no patch
exactly, only the noisy image tokens are controlled (not an edit model's references), and it equals ComfyUI's own
QwenImageBlockWiseControlNet applied as QwenImageDiffsynthControlnet applies it."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from parity import bound
from safetensors.torch import save_file

from xdit_backend.models import model_patch, registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

TINY = "qwen-image-diffsynth-tiny"
QWEN = {"model": "qwen-image-tiny", "width": 64, "height": 64, "steps": 3, "seed": 11, "cfg": 2.5, "batch": 2,
        "dtype": "float32"}
CONTROL = {"path": TINY, "strength": 0.8}
FULL_WARMUP = QWEN["steps"]  # PipeFusion exact: every step on the whole latent
LAYOUTS = [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (2, {"dp": 2}),
           (2, {"ulysses": 2, "shard_weights": True}), (4, {"ulysses": 2, "ring": 2}),
           (2, {"pipefusion": 2, "warmup_steps": FULL_WARMUP}),
           (4, {"pipefusion": 2, "ulysses": 2, "warmup_steps": FULL_WARMUP}),
           (4, {"pipefusion": 2, "ulysses": 2, "shard_weights": True, "warmup_steps": FULL_WARMUP})]


@pytest.fixture(scope="module")
def serial_with_control():
    return serial_latent({**QWEN, "controls": [CONTROL]})


@pytest.mark.parametrize("world, degrees", LAYOUTS, ids=lambda v: str(v))
def test_every_layout_equals_serial_with_the_patch(shared_backends, serial_with_control, world, degrees):
    result, _ = shared_backends.get(world).sample({**QWEN, "controls": [CONTROL], "parallel": degrees})
    assert (result["samples"] - serial_with_control).abs().max() <= bound(serial_with_control)


def test_with_sharded_weights_the_patch_blocks_are_sharded_too(backend2):
    """ulysses=2 with shard_weights: each rank holds half of every control block (and the hint's img_in whole), as it
    holds half of the model's blocks; the bytes held beside the models are the patch's share."""
    backend2.sample({**QWEN, "controls": [CONTROL], "parallel": {"ulysses": 2, "shard_weights": True}})
    status = backend2.status()
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    blocks = sum(p.numel() * 4 for p in network.controlnet_blocks.parameters())
    whole = sum(p.numel() * 4 for p in network.parameters())
    for rank, entry in enumerate(status["ranks"]):
        models = sum(model["bytes_per_rank"][rank] for model in status["models"])
        held = entry["memory"]["parameters"] - models  # the LoRA tensors: none here
        assert whole - blocks + blocks // 2 <= held < whole - blocks // 3, (held, whole)


def test_pipefusion_patches_are_controlled_at_their_tokens(backend2, serial_with_control):
    """PipeFusion past its warm-up (patches attending to stale K/V): each patch's tokens get their own hint, so the
    result is within a tenth of two seeds' distance of serial with the control (with a hint at the wrong tokens it
    would be as far as the control moves it), as tests/backend/test_pipefusion.py holds PipeFusion without one."""
    fields = {**QWEN, "controls": [CONTROL], "steps": 6}
    expected = serial_latent(fields)
    other = serial_latent({**fields, "seed": QWEN["seed"] + 1})
    result, _ = backend2.sample({**fields, "parallel": {"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 1}})
    scale = (other - expected).norm()
    assert 0 < (result["samples"] - expected).norm() < 0.1 * scale


def test_the_patch_moves_the_result_and_strength_0_is_no_patch_exactly(backend2, serial_with_control):
    plain, _ = backend2.sample({**QWEN, "parallel": {"ulysses": 2}})
    off, _ = backend2.sample({**QWEN, "controls": [{**CONTROL, "strength": 0.0}], "parallel": {"ulysses": 2}})
    assert torch.equal(off["samples"], plain["samples"])
    assert (serial_with_control - plain["samples"]).abs().max() > 100 * bound(serial_with_control)


def test_a_sent_control_latent_is_the_one_used_and_two_patches_chain(backend2, tmp_path):
    """A control latent sent as control_0 (what the node and --control-image send) replaces the built-in's drawn
    one; two patches apply in order, each with its own latent, under ring=2 as in serial."""
    g = torch.Generator().manual_seed(3)
    tensors = {"control_0": torch.randn(1, 16, 8, 8, generator=g), "control_1": torch.randn(1, 16, 8, 8, generator=g)}
    fields = {**QWEN, "batch": 1, "controls": [CONTROL, {"path": TINY, "strength": -0.5}]}
    expected = serial_latent(fields, tensors)
    result, _ = backend2.sample({**fields, "parallel": {"ring": 2}}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
    drawn = serial_latent({**fields, "controls": fields["controls"][:1]})
    assert (expected - drawn).abs().max() > 1e-2


def test_an_edit_models_references_are_not_controlled(backend2):
    """Qwen-Image-Edit-2511: the reference tokens follow the noisy ones in the image sequence; the patch adds to the
    noisy tokens only (ComfyUI's img[:, :N]), and a sequence-parallel rank holding references and noisy tokens
    controls only its noisy ones."""
    fields = {**QWEN, "model": "qwen-image-edit-2511-tiny", "batch": 1, "controls": [CONTROL]}
    expected = serial_latent(fields)
    result, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}})
    assert (result["samples"] - expected).abs().max() <= bound(expected)


def _request(fields: dict, tensors: dict | None = None) -> SampleRequest:
    return SampleRequest.parse(Message("sample", fields, tensors or {}))


def test_requests_the_patch_cannot_serve_are_refused_with_the_reason(tmp_path):
    spec = registry.spec("qwen-image-tiny")
    with pytest.raises(RequestError, match="flux models take no DiffSynth model patch"):
        _request({**QWEN, "model": "flux-tiny", "controls": [CONTROL]}).check_model(registry.spec("flux-tiny"))
    with pytest.raises(RequestError, match=r"control_0 has shape \[1, 16, 4, 4\]; it must be one latent "
                                           r"\[1, C, h, w\] of 8 × 8"):
        _request({**QWEN, "controls": [CONTROL]}, {"control_0": torch.zeros(1, 16, 4, 4)}).check_model(spec)
    with pytest.raises(RequestError, match=r"unknown tensors \['control_1'\]"):
        _request({**QWEN, "controls": [CONTROL]}, {"control_1": torch.zeros(1, 16, 8, 8)})
    with pytest.raises(RequestError, match="no control file at .*missing.safetensors"):
        _request({**QWEN, "controls": [{"path": str(tmp_path / "missing.safetensors")}]})
    lora_like = tmp_path / "lora.safetensors"
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(2, 2)}, str(lora_like))
    with pytest.raises(Exception, match="is no model patch ComfyUI knows"):
        model_patch.read(str(lora_like))
    z_image_fun = tmp_path / "Z-Image-Turbo-Fun-Controlnet-Union.safetensors"
    save_file({"control_all_x_embedder.2-1.weight": torch.zeros(2, 2)}, str(z_image_fun))
    with pytest.raises(Exception, match="its tensors do not fit Z-Image's Fun ControlNet"):
        model_patch.read(str(z_image_fun))  # told by its keys, refused for what is missing
    with pytest.raises(RequestError, match="z_image models take no DiffSynth model patch"):
        _request({**QWEN, "model": "z-image-tiny", "controls": [CONTROL]}).check_model(registry.spec("z-image-tiny"))
    path = tmp_path / "patch.safetensors"
    save_file(model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32).state_dict(),
              str(path))
    # the fit check counts a patch before loading it: its file's tensors at the compute dtype's size
    state_values = sum(t.numel() for t in model_patch.read(str(path)).state_dict().values())
    assert model_patch.nbytes(model_patch.PatchSpec(str(path), 1.0), torch.bfloat16) == 2 * state_values
    assert model_patch.nbytes(model_patch.PatchSpec(TINY, 1.0), torch.float32) == 4 * state_values
    file_request = _request({**QWEN, "controls": [{"path": str(path)}]})
    with pytest.raises(RequestError, match="came without its latent control_0"):
        file_request.check_model(spec)


# ------------------------------------------------------------------------------ against ComfyUI's own code

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "QwenImageBlockWiseControlNet and its double_block patch")


@needs_comfyui
@pytest.mark.parametrize("mask_channels", [0, 1], ids=["control", "inpainting-patch"])
def test_the_patch_equals_comfyuis_own(tmp_path, mask_channels):
    """The same patch file in ComfyUI's QwenImageBlockWiseControlNet (as ModelPatchLoader loads it) and in ours, the
    same control latent through its process_input_latent_image, and ComfyUI's QwenImage forward given the patch as
    QwenImageDiffsynthControlnet sets it (a double_block patch, strength 0.7) with a reference latent beside the
    noisy one: the same velocity within 1e-5, and the patch moved it."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ranks"))
    from test_qwen_image import TINY as QWEN_TINY, comfy_and_ours, comfyui, inputs, velocity

    comfy = comfyui()
    import comfy_extras.nodes_model_patch as nodes_model_patch

    width = QWEN_TINY["num_attention_heads"] * QWEN_TINY["attention_head_dim"]
    ours_network = model_patch.BlockwiseControlNet(QWEN_TINY["num_layers"], width, 64, 4 * mask_channels)
    with torch.no_grad():
        for parameter in ours_network.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel())))
    path = tmp_path / "patch.safetensors"
    save_file(ours_network.state_dict(), str(path))
    read = model_patch.read(str(path))  # the file as the backend reads it

    theirs_network = nodes_model_patch.QwenImageBlockWiseControlNet(
        num_layers=QWEN_TINY["num_layers"], dim=width, additional_in_dim=4 * mask_channels,
        operations=comfy.ops.manual_cast)
    from safetensors.torch import load_file

    theirs_network.load_state_dict(load_file(str(path)))
    theirs, model = comfy_and_ours(comfy)

    x, sigma, cond = inputs(4, 8, 12)
    g = torch.Generator().manual_seed(6)
    control = torch.randn(1, 16 + mask_channels, 8, 12, generator=g)
    reference = torch.randn(1, 16, 1, 6, 8, generator=g)
    patch = nodes_model_patch.DiffSynthCnetPatch.__new__(nodes_model_patch.DiffSynthCnetPatch)
    patch.model_patch, patch.strength = SimpleNamespace(model=theirs_network), 0.7
    patch.vae = SimpleNamespace(spacial_compression_encode=lambda: 8)
    with torch.no_grad():
        # ComfyUI's Qwen VAE latents are [B, C, 1, h, w]; the request squeezes the frame (control_latent)
        patch.encoded_image = theirs_network.process_input_latent_image(control[:, :, None].clone())
    patch.encoded_image_size = (8 * 8, 12 * 8)  # the image's pixels: no re-encoding at this latent size
    wan21 = comfy.latent_formats.Wan21()
    with torch.no_grad():
        expected = theirs(x[:, :, None], sigma, cond["context"], ref_latents=[wan21.process_in(reference)],
                          transformer_options={"patches": {"double_block": [patch]}})[:, :, 0]
        unpatched = theirs(x[:, :, None], sigma, cond["context"], ref_latents=[wan21.process_in(reference)])[:, :, 0]
    spec = model_patch.PatchSpec(str(path), 0.7)
    model.model_patches = [model_patch.applied(spec, read, control, 0, (8, 12), model,
                                               model.spec.model_sampling(None))]
    ours = velocity(model, x, sigma, {**cond, "reference_0": reference})
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - unpatched).abs().max() > 1e-2
