"""Wan 2.1 VACE (diffusers' WanVACETransformer3DModel) on the backend: WanVaceToVideo's inputs (the control video's
latents, its mask, the strength) under the sequence-parallel, CFG and data-parallel layouts, sharded or not, equal
the serial generation (the control tokens cut as the image's, the hints never gathered), and so do two control
videos (WanVaceToVideo chained); a file in the original layout loads as the built-in it was written from; and the
model equals ComfyUI's own VaceWanModel, with one control video and with two."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from parity import bound
from safetensors.torch import save_file

from xdit_backend.errors import UserError
from xdit_backend.models import registry
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire.protocol import Message

VACE = {"model": "wan-vace-tiny", "width": 64, "height": 48, "frames": 5, "steps": 3, "seed": 13, "cfg": 2.5,
        "batch": 2, "dtype": "float32"}
LAYOUTS = [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (2, {"dp": 2}),
           (2, {"ulysses": 2, "shard_weights": True}), (4, {"ulysses": 2, "ring": 2})]


def vace_inputs(seed: int, batch: int = 2, strengths: tuple[float, ...] = (0.8,)) -> dict:
    """WanVaceToVideo's conditioning for a 5-frame 48 × 64 video, on both sides: a control video per strength (several:
    WanVaceToVideo chained, side by side in the channels)."""
    g = torch.Generator().manual_seed(seed)
    entries = len(strengths)
    frames = torch.randn(batch, 32 * entries, 2, 6, 8, generator=g)
    mask = torch.rand(batch, 64 * entries, 2, 6, 8, generator=g)
    context = torch.randn(batch, 8, 64, generator=g)
    side = {"vace_frames": frames, "vace_mask": mask, "vace_strength": torch.tensor([strengths]).repeat(batch, 1)}
    return {"context": context, "negative_context": torch.randn(batch, 8, 64, generator=g), **side,
            **{f"negative_{k}": v for k, v in side.items()}}


@pytest.fixture(scope="module")
def serial_vace():
    return serial_latent(VACE, vace_inputs(3))


@pytest.mark.parametrize("world, degrees", LAYOUTS, ids=lambda v: str(v))
def test_every_layout_equals_serial_with_the_control_video(shared_backends, serial_vace, world, degrees):
    result, _ = shared_backends.get(world).sample({**VACE, "parallel": degrees}, vace_inputs(3))
    assert (result["samples"] - serial_vace).abs().max() <= bound(serial_vace)


def test_the_control_video_and_its_strength_move_the_result(serial_vace):
    """Without VACE inputs the model takes ComfyUI's defaults (zero frames, a mask of ones); a strength of 0 leaves
    the model blocks' stream unhinted, which is neither."""
    tensors = vace_inputs(3)
    plain = {k: v for k, v in tensors.items() if "vace" not in k}
    assert (serial_latent(VACE, plain) - serial_vace).abs().max() > 1e-2
    zero = {**tensors, "vace_strength": torch.zeros(2, 1), "negative_vace_strength": torch.zeros(2, 1)}
    assert (serial_latent(VACE, zero) - serial_vace).abs().max() > 1e-2


@pytest.mark.parametrize("world, degrees", [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2})],
                         ids=lambda v: str(v))
def test_two_control_videos_run_split_as_serial(shared_backends, world, degrees):
    """WanVaceToVideo chained: two control videos (strengths 0.8 and −0.5) folded into the VACE blocks' rows, split
    as serial; the second moved the result."""
    tensors = vace_inputs(9, strengths=(0.8, -0.5))
    expected = serial_latent(VACE, tensors)
    result, _ = shared_backends.get(world).sample({**VACE, "parallel": degrees}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
    first = {k: v[:, :32] if k.endswith("frames") else v[:, :64] if k.endswith("mask") else v[:, :1] if "vace" in k
             else v for k, v in tensors.items()}
    assert (serial_latent(VACE, first) - expected).abs().max() > 1e-2


def test_what_vace_cannot_run_with_is_refused_with_the_reason():
    spec = registry.spec("wan-vace-tiny")
    with pytest.raises(RequestError, match="the step cache .* on a wan_vace model: VACE adds its hints"):
        SampleRequest.parse(Message("sample", {**VACE, "cache": "fbcache"})).check_model(spec)
    assert "pipefusion" not in spec.parallel_methods
    tensors = vace_inputs(3)
    tensors["vace_mask"] = tensors["vace_mask"][:, :48]  # not a whole entry's 64 channels
    request = SampleRequest.parse(Message("sample", VACE, tensors))
    with pytest.raises(UserError, match=r"VACE inputs of disagreeing control videos: vace_frames \[2, 32, 2, 6, 8\], "
                                        r"vace_mask \[2, 48, 2, 6, 8\]"):
        request.generation(spec, *request.sides(spec))


def original_vace_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers' Wan VACE → the original layout: the Wan model as test_wan_checkpoint writes it, the VACE blocks
    under the same block names as vace_blocks.N with before_proj / after_proj, and vace_patch_embedding."""
    from unit.test_wan_checkpoint import original_state_dict

    sd = transformer.state_dict()
    out = original_state_dict(transformer)
    as_blocks = {**sd, **{k.replace("vace_blocks.", "blocks.", 1): v for k, v in sd.items()
                          if k.startswith("vace_blocks.")}}
    written = original_state_dict(SimpleNamespace(state_dict=lambda: as_blocks, blocks=transformer.vace_blocks))
    out.update({f"vace_{k}": v for k, v in written.items() if k.startswith("blocks.")})
    for key, value in sd.items():
        for ours, theirs in (("proj_in", "before_proj"), ("proj_out", "after_proj")):
            if key.startswith("vace_blocks.") and f".{ours}." in key:
                out[key.replace(f".{ours}.", f".{theirs}.")] = value
        if key.startswith("vace_patch_embedding."):
            out[key] = value
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def vace_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vace") / "wan2.1_vace_tiny.safetensors"
    save_file(original_vace_state_dict(registry.build("wan-vace-tiny", torch.device("cpu")).transformer), str(path))
    return str(path)


def test_a_vace_file_loads_as_the_built_in(vace_file):
    """Told from a plain Wan file by its VACE keys; its VACE blocks' places read off their count (every
    num_layers / n-th block from 0, as ComfyUI places them)."""
    source = registry.resolve(vace_file)
    assert (source.family, source.config["vace_layers"], source.config["vace_in_channels"]) == ("wan_vace", [0, 1],
                                                                                               96)
    fields = {**VACE, "batch": 1}
    tensors = {k: v[:1] for k, v in vace_inputs(4, 1).items()}
    assert torch.equal(serial_latent({**fields, "model": vace_file}, tensors), serial_latent(fields, tensors))


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "VaceWanModel")


@needs_comfyui
def test_the_model_equals_comfyuis_vace_wan_model(vace_file):
    """ComfyUI's own VaceWanModel of the same file (its detection, the tiny sizes set), given vace_context and
    vace_strength as WAN21_Vace.extra_conds makes them from WanVaceToVideo's frames, mask and strength: our velocity
    within 1e-5, and the control video moved it."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.latent_formats
    import comfy.model_detection
    from safetensors.torch import load_file

    state = load_file(vace_file)
    config = comfy.model_detection.model_config_from_unet(state, "")
    config.unet_config.update(num_heads=2, text_dim=64, freq_dim=32)
    config.set_inference_dtype(torch.float32, None)
    theirs = config.get_model(state, "").diffusion_model
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model = registry.build(vace_file, torch.device("cpu"))

    tensors = vace_inputs(5)
    x = torch.randn(2, 16, 2, 6, 8, generator=torch.Generator().manual_seed(6))
    timestep = torch.tensor([700.0, 700.0])
    wan21 = comfy.latent_formats.Wan21()
    frames = tensors["vace_frames"].clone()
    for start in (0, 16):
        frames[:, start:start + 16] = wan21.process_in(frames[:, start:start + 16])
    context = torch.cat([frames, tensors["vace_mask"]], dim=1)[:, None]  # [B, 1 entry, 96, T, h, w]
    cond = {"context": tensors["context"], **{k: tensors[k] for k in ("vace_frames", "vace_mask", "vace_strength")}}
    with torch.no_grad():
        expected = theirs(x, timestep, tensors["context"], vace_context=context, vace_strength=[0.8])
        plain = theirs(x, timestep, tensors["context"], vace_context=torch.zeros_like(context), vace_strength=[0.8])
        ours = model.output(x, timestep, cond, None)
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-2

    # two control videos (WanVaceToVideo chained): ComfyUI stacks their contexts [B, 2, 96, …], a strength each
    two = vace_inputs(7, strengths=(0.8, -0.5))
    frames = two["vace_frames"].clone()
    for start in range(0, 64, 16):
        frames[:, start:start + 16] = wan21.process_in(frames[:, start:start + 16])
    contexts = torch.stack([torch.cat([frames[:, 32 * e:32 * e + 32], two["vace_mask"][:, 64 * e:64 * e + 64]], dim=1)
                            for e in range(2)], dim=1)  # [B, 2, 96, T, h, w]
    cond = {"context": two["context"], **{k: two[k] for k in ("vace_frames", "vace_mask", "vace_strength")}}
    with torch.no_grad():
        expected = theirs(x, timestep, two["context"], vace_context=contexts, vace_strength=[0.8, -0.5])
        first = theirs(x, timestep, two["context"], vace_context=contexts[:, :1], vace_strength=[0.8])
        ours = model.output(x, timestep, cond, None)
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - first).abs().max() > 1e-2


def test_weight_sharding_shards_the_vace_blocks_as_the_models(backend2):
    """With shard_weights each rank keeps ⌈rows/2⌉ of every block's parameters, the VACE blocks' too (the control
    blocks of a 14B VACE model are 2.6 B parameters), two control videos beside: serial's latent."""
    import math

    tensors = vace_inputs(9, strengths=(0.8, -0.5))
    result, info = backend2.sample({**VACE, "parallel": {"ulysses": 2, "shard_weights": True}, "profile": True},
                                   tensors)
    transformer = registry.build("wan-vace-tiny", torch.device("cpu")).transformer
    blocks = [p for name in ("blocks", "vace_blocks") for block in getattr(transformer, name)
              for p in block.parameters()]
    inside = {id(p) for p in blocks}
    rest = sum(p.numel() * p.element_size() for p in transformer.parameters() if id(p) not in inside)
    share = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * p.element_size() for p in blocks)
    for record in info["profile"]:
        assert record["resident_parameter_bytes"] <= share + rest, record
    expected = serial_latent(VACE, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)
