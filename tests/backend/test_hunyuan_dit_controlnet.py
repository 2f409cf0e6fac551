"""HunyuanDiT 1.2's ControlNets (Tencent's layout, as ComfyUI loads them) beside test_controlnet.py's layouts for every
kind: a file ComfyUI's own HunYuanControlNet writes loads here, and with it our velocity equals ComfyUI's HunYuanDiT
forward given that ControlNet's residuals; a ControlNet with other than one block per long skip is refused."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file

from backend.test_controlnet import KINDS
from unit.test_hunyuan_dit_checkpoint import V12, comfy_hydit, conditioning, filled_randomly
from xdit_backend.errors import UserError
from xdit_backend.models import model_patch, registry
from xdit_backend.service.reference import serial_latent

HUNYUAN, CONTROL = KINDS["hunyuan-dit"]

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's "
                                          "HunYuanControlNet")


def comfy_controlnet(config, seed=1):
    """ComfyUI's HunYuanControlNet (19 blocks: a model of 40) at the config's size, every parameter random."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    import comfy.ldm.hydit.controlnet
    import comfy.ops

    network = comfy.ldm.hydit.controlnet.HunYuanControlNet(
        patch_size=config["patch_size"], in_channels=config["in_channels"], hidden_size=config["hidden_size"],
        depth=config["num_layers"], num_heads=config["num_attention_heads"], mlp_ratio=config["mlp_ratio"],
        text_states_dim=config["cross_attention_dim"], text_states_dim_t5=config["cross_attention_dim_t5"],
        text_len=config["text_len"], text_len_t5=config["text_len_t5"], operations=comfy.ops.disable_weight_init)
    return filled_randomly(network, seed)


@needs_comfyui
def test_comfyuis_controlnet_file_loads_and_the_model_with_it_equals_comfyuis(tmp_path):
    """ComfyUI's HunYuanDiT and HunYuanControlNet at a tiny width and the released depth (40 blocks, 19 control
    blocks), their state dicts written as files: the ControlNet is read as a HunyuanDiT ControlNet, and our velocity
    with it (strength 0.7, CONSTANT) is ComfyUI's forward given its residuals times the strength, within 1e-5."""
    config = {**V12, "num_layers": 40}
    theirs = comfy_hydit(config)
    theirs_control = comfy_controlnet(config)
    model_path, control_path = tmp_path / "hydit.safetensors", tmp_path / "hydit-controlnet.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in theirs.state_dict().items()}, str(model_path))
    save_file({k: v.contiguous() for k, v in theirs_control.state_dict().items()}, str(control_path))
    spec = model_patch.PatchSpec(str(control_path), 0.7)
    assert model_patch.control_family(spec) == "hunyuan_dit"

    cond = conditioning(config)
    g = torch.Generator().manual_seed(3)
    x, hint = torch.randn(2, 4, 8, 12, generator=g), torch.randn(1, 4, 8, 12, generator=g)
    t = torch.tensor([999.0, 41.0])
    import comfy.latent_formats

    in_model_space = comfy.latent_formats.SDXL().process_in(hint)  # as get_control puts the hint
    with torch.no_grad():
        residuals = theirs_control(x, in_model_space.expand(2, -1, -1, -1), t, cond["context"].clone(),
                                   cond["context_mask"], cond["context_mt5"].clone(), cond["context_mt5_mask"])
        expected = theirs(x, t, cond["context"].clone(), cond["context_mask"], cond["context_mt5"].clone(),
                          cond["context_mt5_mask"], control={"output": [r * 0.7 for r in residuals["output"]]})
        plain = theirs(x, t, cond["context"].clone(), cond["context_mask"], cond["context_mt5"].clone(),
                       cond["context_mt5_mask"])
        model = registry.build(str(model_path), torch.device("cpu"))
        network = model_patch.network(spec, torch.device("cpu"), torch.float32)
        model.model_patches = [model_patch.applied(spec, network, hint, 0, (8, 12), model,
                                                   model.spec.model_sampling(None))]
        ours = model.output(x, t, cond, None)
    assert (ours - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert (expected - plain).abs().max() > 1e-2


def test_a_controlnet_of_the_wrong_depth_is_refused():
    """The built-in ControlNet has a block per skip of hunyuan-dit-tiny (4 blocks: 1); a ControlNet of 19 blocks
    (HunyuanDiT 1.2's) on it is refused, as ComfyUI's model refuses it."""
    from xdit_backend.models import hunyuan_dit_controlnet

    model = registry.build("hunyuan-dit-tiny", torch.device("cpu"))
    config = hunyuan_dit_controlnet.built_in("hunyuan-dit-controlnet-tiny").config
    deeper = hunyuan_dit_controlnet.HunyuanDiTControlNet(**{**config, "transformer_num_layers": 40})
    spec = model_patch.PatchSpec("hunyuan-dit-controlnet-tiny", 1.0)
    model.model_patches = [model_patch.applied(spec, deeper, None, 0, (6, 8), model,
                                               model.spec.model_sampling(None))]
    fields = {**HUNYUAN, "batch": 1}
    with pytest.raises(UserError, match="ControlNet of 19 blocks for a model with 1 long skips"):
        serial_latent(fields, model=model)
