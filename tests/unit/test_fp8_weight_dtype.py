"""weight_dtype fp8 as ComfyUI does it (issue 26 item 7): ComfyUI's UNETLoader with fp8_e4m3fn builds the whole
model in that dtype, so every floating parameter (biases, norm scales, embeddings) is rounded through fp8, not only
the Linear weights. A bf16 SD3-medium-style file small enough for the CPU (ComfyUI's detection fixes Flux's width
at 3072, and reads SD3's off its depth) loaded by ComfyUI's own ``load_diffusion_model`` (what UNETLoader calls)
and by ours: every parameter the same value."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file
from unit.test_sd3_checkpoint import original_state_dict

from xdit_backend.models import registry
from xdit_backend.models.storage import StoredLinear
from xdit_backend.selftest.files import family_table

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with its UNETLoader")
CONFIG = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=64,
              num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=128, pooled_projection_dim=32,
              pos_embed_max_size=32)  # ComfyUI's rule for SD3: width = 64 × depth


def comfy_fp8(path: str, fp8: torch.dtype) -> dict[str, torch.Tensor]:
    """The diffusion model's state dict as ComfyUI's UNETLoader loads ``path`` with that weight_dtype."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.sd

    patcher = comfy.sd.load_diffusion_model(path, model_options={"dtype": fp8})
    return patcher.model.diffusion_model.state_dict()


@needs_comfyui
@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "fp8_e5m2"])
def test_every_parameter_is_rounded_through_fp8_as_comfyuis_unetloader_does(tmp_path, weight_dtype):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**CONFIG)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)  # norm scales and biases away from 1 and 0, where fp8 keeps them exact
    path = tmp_path / "sd3-bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in original_state_dict(model).items()}, str(path))
    fp8 = getattr(torch, weight_dtype.replace("fp8", "float8"))
    theirs = comfy_fp8(str(path), fp8)
    ours = registry.build(str(path), torch.device("cpu"), torch.float32, weight_dtype=weight_dtype).transformer
    table = family_table(str(path), [name for name, _ in ours.named_parameters()])
    compared = 0
    for name, param in ours.named_parameters():
        owner, _, leaf = name.rpartition(".")
        module = ours.get_submodule(owner)
        value = module.upcast(torch.float32) if isinstance(module, StoredLinear) and leaf == "weight" else param
        expected = table[name].select(theirs[table[name].key].float())
        assert torch.equal(value.float(), expected), name
        compared += 1
    assert theirs["x_embedder.proj.bias"].dtype == fp8 and compared == len(table)
