"""SD3.5's ControlNets (Stability's layout: blur, canny, depth) on the backend, beside test_controlnet.py's layouts for
every kind: a file in Stability's layout loads as the built-in, and the network and the model with its residuals
equal ComfyUI's own ControlNetEmbedder and MMDiT."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from backend.test_controlnet import KINDS
from xdit_backend.models import model_patch
from xdit_backend.models.resolved import resolve_model
from xdit_backend.service.reference import serial_latent

SD3, CONTROL = KINDS["sd3"]
TINY = CONTROL["path"]


def stability_layout(network) -> dict[str, torch.Tensor]:
    """The built-in's tensors in Stability's file layout (its blocks under ComfyUI's DismantledBlock names, q, k and
    v as one ``qkv``), written out here independently of the reader, with a patch embedding the reader drops and a
    ``control_type`` (canny)."""
    state = network.state_dict()
    out = {"control_type": torch.tensor(1.0), "pos_embed.proj.weight": torch.zeros(128, 16, 2, 2),
           "pos_embed.proj.bias": torch.zeros(128)}
    names = {"norm1.linear": "adaLN_modulation.1", "attn.to_out.0": "attn.proj", "ff.net.0.proj": "mlp.fc1",
             "ff.net.2": "mlp.fc2"}
    for key, value in state.items():
        prefix, _, rest = key.partition(".")
        if prefix != "transformer_blocks":
            out[key] = value
            continue
        index, _, name = rest.partition(".")
        module, _, kind = name.rpartition(".")
        if module in ("attn.to_k", "attn.to_v"):
            continue
        if module == "attn.to_q":
            out[f"transformer_blocks.{index}.attn.qkv.{kind}"] = torch.cat(
                [state[f"transformer_blocks.{index}.attn.to_{x}.{kind}"] for x in "qkv"])
        else:
            out[f"transformer_blocks.{index}.{names[module]}.{kind}"] = value
    return out


def test_a_stability_file_loads_as_the_built_in(tmp_path):
    """A file in Stability's layout is told from the other kinds by its keys, renamed to diffusers' blocks on
    reading, its control type kept: the same generation as the built-in it was written from."""
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    path = tmp_path / "sd3.5_large_controlnet_canny.safetensors"
    save_file(stability_layout(network), str(path))
    assert model_patch.control_family(model_patch.PatchSpec(str(path), 1.0)) == "sd3"
    assert model_patch.network(model_patch.PatchSpec(str(path), 1.0), torch.device("cpu"),
                               torch.float32).control_type == 1
    tensors = {"control_0": torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(5))}
    fields = {**SD3, "batch": 1}
    from_file = serial_latent({**fields, "controls": [{**CONTROL, "path": str(path)}]}, tensors)
    built_in = serial_latent({**fields, "controls": [CONTROL]}, tensors)
    assert torch.equal(from_file, built_in)


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "ControlNetEmbedder and its residuals in the MMDiT's forward")


@needs_comfyui
def test_the_controlnet_and_its_residuals_equal_comfyuis_own(tmp_path):
    """ComfyUI's ControlNetEmbedder (SD3.5 Large's kind: 2 blocks, width 128 = 2 heads of 64, so 2 model blocks
    controlled) with the same tensors under its own names, its x_embedder the model's (ControlNetSD35.pre_run), given
    what get_control gives it (x, 1000·σ, the pooled prompt, the hint in model space); its residuals times the
    strength into ComfyUI's own MMDiT of a tiny SD3 file as ``control``: our velocity with the ControlNet within
    1e-5 of theirs."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.cldm.dit_embedder
    import comfy.latent_formats
    import comfy.ops
    import comfy.sd
    import comfy.utils
    from host.conftest import tiny_sd3_file

    path = tmp_path / "tiny-sd3.safetensors"
    tiny_sd3_file(path)
    theirs_model = comfy.sd.load_diffusion_model(str(path)).model.diffusion_model
    model = resolve_model(str(path)).build(torch.device("cpu"), torch.float32)

    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    state = stability_layout(network)
    state.pop("control_type")
    for theirs_name, diffusers_name, *_ in comfy.utils.MMDIT_MAP_BASIC:  # as load_controlnet_sd35 renames
        if diffusers_name in state:
            state[theirs_name] = state.pop(diffusers_name)
    theirs = comfy.cldm.dit_embedder.ControlNetEmbedder(
        img_size=None, patch_size=2, in_chans=16, attention_head_dim=64, num_attention_heads=2, adm_in_channels=32,
        num_layers=2, main_model_double=2, double_y_emb=False, device=None, dtype=torch.float32,
        operations=comfy.ops.disable_weight_init)
    theirs.load_state_dict(state, strict=True)
    theirs.x_embedder.load_state_dict(theirs_model.x_embedder.state_dict())  # ControlNetSD35.pre_run

    g = torch.Generator().manual_seed(6)
    x, control = torch.randn(2, 16, 6, 8, generator=g), torch.randn(1, 16, 6, 8, generator=g)
    timestep = torch.tensor([700.0, 700.0])
    cond = {"context": torch.randn(2, 8, 64, generator=g), "pooled": torch.randn(2, 32, generator=g)}
    sd3 = comfy.latent_formats.SD3()
    with torch.no_grad():
        residuals = theirs(x, timestep, y=cond["pooled"], hint=sd3.process_in(control).expand(2, -1, -1, -1))
        scaled = {"output": [r * 0.7 for r in residuals["output"]]}
        expected = theirs_model(x, timestep, cond["context"], y=cond["pooled"], control=scaled)
        plain = theirs_model(x, timestep, cond["context"], y=cond["pooled"])
        spec = model_patch.PatchSpec(TINY, 0.7)
        model.model_patches = [model_patch.applied(spec, network, control, 0, (6, 8), model,
                                                   model.spec.model_sampling(None))]
        ours = model.output(x, timestep, cond, None)
    assert (ours - expected).abs().max() <= 1e-5
    assert (expected - plain).abs().max() > 1e-2
