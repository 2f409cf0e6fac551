"""Flux.1's ControlNets (InstantX's and Shakker-Labs' layout: diffusers' FluxControlNetModel; XLabs' BFL layout,
pixel input) on the backend, beside test_controlnet.py's layouts for every kind: a union type or none, a range
and a chained ControlNet act as ComfyUI's; a file loads as the built-in; XLabs' files take the pixels; float8 files
stay float8; and each equals ComfyUI's own ControlNetFlux with its residuals added as comfy/ldm/flux/model.py adds
them."""

import os
import sys

import pytest
import torch
from parity import bound
from safetensors.torch import save_file

from backend.test_controlnet import KINDS
from xdit_backend.models import model_patch, registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

FLUX, CONTROL = KINDS["flux"]
TINY = CONTROL["path"]


def test_auto_type_a_range_and_a_chained_controlnet_under_ring(backend2):
    """No union type (ComfyUI's "auto": no extra token), active for the first half of the schedule only, chained with
    a second ControlNet with its own latent and type: ring=2 as serial; the type and the range changed the result."""
    g = torch.Generator().manual_seed(4)
    tensors = {"control_1": torch.randn(1, 16, 6, 8, generator=g)}
    controls = [{"path": TINY, "strength": 0.7, "start": 0.0, "end": 0.5}, {**CONTROL, "strength": -0.4, "type": 6}]
    fields = {**FLUX, "batch": 1, "controls": controls}
    expected = serial_latent(fields, tensors)
    result, _ = backend2.sample({**fields, "parallel": {"ring": 2}}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
    whole_range = serial_latent({**fields, "controls": [{**controls[0], "end": 1.0}, controls[1]]}, tensors)
    assert (expected - whole_range).abs().max() > 1e-2
    typed = serial_latent({**fields, "controls": [{**controls[0], "type": 1}, controls[1]]}, tensors)
    assert (expected - typed).abs().max() > 1e-3


def test_requests_a_flux_controlnet_cannot_serve_are_refused_with_the_reason(tmp_path):
    def check(fields, model="flux-tiny", tensors=None):
        SampleRequest.parse(Message("sample", {**FLUX, **fields}, tensors or {})).check_model(registry.spec(model))

    with pytest.raises(RequestError, match="is a qwen_image ControlNet, but flux-tiny is a flux model"):
        check({"controls": [{"path": "qwen-image-controlnet-tiny", "strength": 1.0}]})
    with pytest.raises(RequestError, match="is a flux ControlNet, but qwen-image-tiny is a qwen_image model"):
        check({"model": "qwen-image-tiny", "controls": [CONTROL]}, "qwen-image-tiny")
    with pytest.raises(RequestError, match="flux models take no DiffSynth model patch"):
        check({"controls": [{"path": "qwen-image-diffsynth-tiny", "strength": 1.0}]})
    with pytest.raises(RequestError, match="with pipefusion=2"):
        check({"controls": [CONTROL], "parallel": {"pipefusion": 2}})
    with pytest.raises(RequestError, match=r"with the step cache \(fbcache\)"):
        check({"controls": [CONTROL], "cache": "fbcache"})
    with pytest.raises(RequestError, match="control type -1: a union ControlNet's type number"):
        check({"controls": [{**CONTROL, "type": -1}]})
    with pytest.raises(Exception, match="union type 9, but it has 8 types"):
        serial_latent({**FLUX, "controls": [{**CONTROL, "type": 9}]})


def test_a_controlnet_file_loads_as_the_built_in(tmp_path):
    """A file in diffusers' layout is told from a Qwen-Image one and from a model patch by its keys and read with its
    config off the shapes (union types and all): the same generation as the built-in it was written from."""
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    path = tmp_path / "flux_controlnet.safetensors"
    save_file({k: v for k, v in network.state_dict().items()}, str(path))
    assert model_patch.control_family(model_patch.PatchSpec(str(path), 1.0)) == "flux"
    g = torch.Generator().manual_seed(5)
    tensors = {"control_0": torch.randn(1, 16, 6, 8, generator=g)}
    fields = {**FLUX, "batch": 1}
    from_file = serial_latent({**fields, "controls": [{**CONTROL, "path": str(path)}]}, tensors)
    built_in = serial_latent({**fields, "controls": [CONTROL]}, tensors)
    assert torch.equal(from_file, built_in)


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "ControlNetFlux and its residuals in Flux's forward")


def comfy_state(state: dict) -> dict:
    """A diffusers-layout Flux (or Flux ControlNet) state dict in ComfyUI's names, as its loaders convert it (the
    ControlNet's own tensors kept: load_controlnet_flux_instantx)."""
    import comfy.model_detection

    left = {key: value.clone() for key, value in state.items()}  # it writes some conversions into the tensors given
    converted = comfy.model_detection.convert_diffusers_mmdit(left, "")  # and takes those it converts out of left
    return {**left, **converted}


# flux-tiny's config as ComfyUI's Flux takes it (its params)
FLUX_PARAMS = dict(in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64, hidden_size=64, mlp_ratio=4.0,
                   num_heads=4, axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True)


def _comfy():
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.latent_formats
    import comfy.ldm.flux.controlnet
    import comfy.ldm.flux.model
    import comfy.ops

    return comfy


def _flux_pair(comfy):
    """flux-tiny, ours and ComfyUI's Flux with the same weights."""
    model = registry.build("flux-tiny", torch.device("cpu"))
    theirs = comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, **FLUX_PARAMS, depth=2,
                                       depth_single_blocks=5)
    theirs.load_state_dict(comfy_state(model.transformer.state_dict()), strict=True)
    return model, theirs


def _cond() -> dict:
    g = torch.Generator().manual_seed(8)
    return {"context": torch.randn(2, 8, 64, generator=g), "pooled": torch.randn(2, 32, generator=g)}


@needs_comfyui
@pytest.mark.parametrize("mode", [3, None], ids=["union-type", "auto"])
def test_the_controlnet_equals_comfyuis_own(mode):
    """ComfyUI's ControlNetFlux (latent input, 8 union types) with the same tensors, given what ControlNet.get_control
    gives it (the latent, σ, the prompt, pooled and guidance, the hint in model space, the union type), its residuals
    times the strength into ComfyUI's Flux forward as ``control``: our velocity with the ControlNet within 1e-5."""
    comfy = _comfy()
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    theirs_control = comfy.ldm.flux.controlnet.ControlNetFlux(
        latent_input=True, num_union_modes=8, control_latent_channels=16, operations=comfy.ops.disable_weight_init,
        **FLUX_PARAMS, depth=1, depth_single_blocks=1)
    theirs_control.load_state_dict(comfy_state(network.state_dict()), strict=True)
    model, theirs = _flux_pair(comfy)
    g = torch.Generator().manual_seed(6)
    x, control = torch.randn(2, 16, 6, 8, generator=g), torch.randn(1, 16, 6, 8, generator=g)
    sigma, guidance, cond = torch.tensor([0.7, 0.7]), torch.tensor([3.5, 3.5]), _cond()
    flux = comfy.latent_formats.Flux()
    with torch.no_grad():
        residuals = theirs_control(x, sigma, cond["context"], y=cond["pooled"], guidance=guidance,
                                   hint=flux.process_in(control).expand(2, -1, -1, -1),
                                   control_type=[] if mode is None else [mode])
        scaled = {key: [r * 0.7 for r in value] for key, value in residuals.items()}
        expected = theirs(x, sigma, cond["context"], y=cond["pooled"], guidance=guidance, control=scaled)
        plain = theirs(x, sigma, cond["context"], y=cond["pooled"], guidance=guidance)
        spec = model_patch.PatchSpec(TINY, 0.7, mode=mode)
        model.model_patches = [model_patch.applied(spec, network, control, 0, (6, 8), model,
                                                   model.spec.model_sampling(None))]
        ours = model.output(x, sigma, cond, guidance)
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-2


def xlabs_network():
    """An XLabs-kind ControlNet for flux-tiny (2 double blocks, no single ones, the pixel convolutions), random."""
    from xdit_backend.models import flux_controlnet
    from xdit_backend.models.builtins import FLUX_TINY

    keep = ("in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
            "guidance_embeds", "axes_dims_rope")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(21)
        network = flux_controlnet.FluxControlNet(**{k: FLUX_TINY[k] for k in keep}, num_layers=2, num_single_layers=0)
        network.input_hint_block = flux_controlnet.xlabs_hint()
        for block in network.controlnet_blocks:
            torch.nn.init.normal_(block.weight, std=0.05)
        torch.nn.init.normal_(network.controlnet_x_embedder.weight, std=0.05)
    return network


def xlabs_layout(network) -> dict[str, torch.Tensor]:
    """The network in XLabs' file layout: BFL's names for its Flux parts (test_model_files' writer, given stand-in
    output layers it then drops), its own ``controlnet_blocks``, ``input_hint_block`` and ``pos_embed_input``."""
    from types import SimpleNamespace

    from backend.test_model_files import bfl_state_dict

    state = network.state_dict()
    width = network.config.num_attention_heads * network.config.attention_head_dim
    stand_in = {**state, "proj_out.weight": torch.zeros(64, width), "proj_out.bias": torch.zeros(64),
                "norm_out.linear.weight": torch.zeros(2 * width, width), "norm_out.linear.bias": torch.zeros(2 * width)}
    stub = SimpleNamespace(state_dict=lambda: stand_in, transformer_blocks=network.transformer_blocks,
                           single_transformer_blocks=network.single_transformer_blocks)
    out = {k: v for k, v in bfl_state_dict(stub).items() if not k.startswith("final_layer.")}
    out.update({k: v for k, v in state.items() if k.startswith(("controlnet_blocks.", "input_hint_block."))})
    out.update({f"pos_embed_input.{p}": state[f"controlnet_x_embedder.{p}"] for p in ("weight", "bias")})
    return out


@pytest.fixture(scope="module")
def xlabs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("xlabs") / "flux-canny-controlnet-v3.safetensors"
    save_file(xlabs_layout(xlabs_network()), str(path))
    return str(path)


def test_an_xlabs_controlnet_takes_the_pixels_and_runs_split_as_serial(backend2, xlabs_file):
    """An XLabs file (BFL's layout) is read as a pixel-input Flux ControlNet: the control image at the generation's
    size (48 × 64 for a 6 × 8 latent), its residuals tiled over the model's blocks; ulysses=2 equals serial, and it
    moves the result. A latent-sized control is refused, saying what it takes."""
    control = {"path": xlabs_file, "strength": 0.8}
    assert model_patch.takes_pixels(model_patch.PatchSpec(xlabs_file, 1.0))
    tensors = {"control_0": torch.rand(1, 3, 48, 64, generator=torch.Generator().manual_seed(7))}
    fields = {**FLUX, "batch": 1, "controls": [control]}
    expected = serial_latent(fields, tensors)
    result, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
    assert (expected - serial_latent({**FLUX, "batch": 1})).abs().max() > 1e-2
    with pytest.raises(RequestError, match=r"it must be one image \[1, 3, H, W\] of 48 × 64"):
        SampleRequest.parse(Message("sample", fields, {"control_0": torch.zeros(1, 16, 6, 8)})).check_model(
            registry.spec("flux-tiny"))


@needs_comfyui
def test_an_xlabs_controlnet_equals_comfyuis_own(xlabs_file):
    """ComfyUI's ControlNetFlux as load_controlnet_flux_xlabs_mistoline builds it (pixel input, its state dict the
    file's, strict), given the image at 8× the latent ([0, 1], as get_control hands it without a VAE): our velocity
    with the XLabs ControlNet within 1e-5 of Flux's forward with its residuals."""
    from safetensors.torch import load_file

    comfy = _comfy()
    params = dict(FLUX_PARAMS, depth=2, depth_single_blocks=0)
    theirs_control = comfy.ldm.flux.controlnet.ControlNetFlux(operations=comfy.ops.disable_weight_init, **params)
    theirs_control.load_state_dict(load_file(xlabs_file), strict=True)
    model, theirs = _flux_pair(comfy)
    x, image = torch.randn(2, 16, 6, 8, generator=torch.Generator().manual_seed(6)), torch.rand(1, 3, 48, 64)
    sigma, guidance, cond = torch.tensor([0.7, 0.7]), torch.tensor([3.5, 3.5]), _cond()
    network = model_patch.network(model_patch.PatchSpec(xlabs_file, 1.0), torch.device("cpu"), torch.float32)
    with torch.no_grad():
        residuals = theirs_control(x, sigma, cond["context"], y=cond["pooled"], guidance=guidance,
                                   hint=image.expand(2, -1, -1, -1))
        # as control_merge hands them on: every key there, "output" empty (no single blocks)
        scaled = {"input": [], "middle": [], "output": [], **{k: [r * 0.8 for r in v] for k, v in residuals.items()}}
        expected = theirs(x, sigma, cond["context"], y=cond["pooled"], guidance=guidance, control=scaled)
        model.model_patches = [model_patch.applied(model_patch.PatchSpec(xlabs_file, 0.8), network, image, 0,
                                                   (6, 8), model, model.spec.model_sampling(None))]
        ours = model.output(x, sigma, cond, guidance)
    assert (ours - expected).abs().max() <= 1e-5


def test_a_float8_controlnet_stays_float8_and_runs_sharded(backend2, tmp_path):
    """A ControlNet file with float8 Linear weights keeps them so on the device (StoredLinear, upcast a layer at a
    time), and the fit check counts them so: the same generation as its weights upcast in a float32 file, and under
    ulysses=2 with sharded weights as serial."""
    from xdit_backend.models.storage import StoredLinear

    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    linear = {f"{name}.weight" for name, module in network.named_modules() if isinstance(module, torch.nn.Linear)}
    stored = {k: v.to(torch.float8_e4m3fn) if k in linear else v.to(torch.bfloat16)
              for k, v in network.state_dict().items()}
    save_file(stored, str(tmp_path / "union-fp8.safetensors"))
    save_file({k: v.float() for k, v in stored.items()}, str(tmp_path / "union-upcast.safetensors"))
    fp8 = model_patch.network(model_patch.PatchSpec(str(tmp_path / "union-fp8.safetensors"), 1.0),
                              torch.device("cpu"), torch.float32)
    assert all(isinstance(module, StoredLinear) and module.weight.dtype == torch.float8_e4m3fn
               for module in fp8.modules() if isinstance(module, torch.nn.Linear))
    from xdit_backend.parallel.shard import resident_bytes  # the fit check counts what the network will hold

    assert model_patch.nbytes(model_patch.PatchSpec(str(tmp_path / "union-fp8.safetensors"), 1.0),
                              torch.float32) == resident_bytes(fp8)
    tensors = {"control_0": torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(3))}
    fields = {**FLUX, "batch": 1}
    controls = [{**CONTROL, "path": str(tmp_path / "union-fp8.safetensors")}]
    expected = serial_latent({**fields, "controls": controls}, tensors)
    upcast = serial_latent({**fields, "controls": [{**CONTROL, "path": str(tmp_path / "union-upcast.safetensors")}]},
                           tensors)
    assert (expected - upcast).abs().max() <= bound(expected)
    result, _ = backend2.sample({**fields, "controls": controls, "parallel": {"ulysses": 2, "shard_weights": True}},
                                tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
