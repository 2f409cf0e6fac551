"""LoRA patches: strength 0 is the base model, strength s acts as W + s·(B·A)·(alpha/rank), in every key
layout ComfyUI users have; keys that match nothing are reported.

The LoRAs are unmerged (forward hooks: models/lora.py), so the weight a patched Linear acts with is
read off its forward: W + (its output on the identity − the unpatched output)ᵀ (``effective``).
"""

import pytest
import torch
from safetensors.torch import save_file

from xdit_backend.models import registry
from xdit_backend.models.lora import LoraSpec

RANK, ALPHA = 2, 1.0
WIDTH = 64


def low_rank(out_features, in_features, seed):
    """(up [out, rank], down [rank, in])."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, RANK, generator=g), torch.randn(RANK, in_features, generator=g)


@pytest.fixture(scope="module")
def base():
    return registry.build("flux-tiny", torch.device("cpu")).transformer.state_dict()


def effective(model) -> dict:
    """The transformer's state dict, each patched Linear's weight as the LoRA makes it act."""
    weights = model.transformer.state_dict()
    for name, module in model.transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and module._forward_hooks:
            eye = torch.eye(module.in_features, dtype=module.weight.dtype, device=module.weight.device)
            with torch.no_grad():  # [in, out]: row i is the output for the i-th unit input
                delta = module(eye) - torch.nn.functional.linear(eye, module.weight, module.bias)
            weights[f"{name}.weight"] = module.weight + delta.T
    return weights


def merged(tmp_path, tensors, strength):
    path = tmp_path / "lora.safetensors"
    save_file(tensors, str(path))
    model = registry.build("flux-tiny", torch.device("cpu"), loras=[LoraSpec(str(path), strength)])
    return effective(model), model.lora_reports[0]


def test_peft_layout_strength_zero_and_s(tmp_path, base):
    up, down = low_rank(WIDTH, WIDTH, 1)
    tensors = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": down,
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": up,
               "transformer.transformer_blocks.0.attn.to_q.alpha": torch.tensor(ALPHA)}
    zero, _ = merged(tmp_path, tensors, 0.0)
    assert all(torch.equal(zero[k], base[k]) for k in base)
    weights, report = merged(tmp_path, tensors, 0.7)
    key = "transformer_blocks.0.attn.to_q.weight"
    assert torch.allclose(weights[key], base[key] + 0.7 * (up @ down) * (ALPHA / RANK), atol=1e-6)
    assert report["merged_modules"] == 1 and report["unmatched_keys"] == 0
    assert all(torch.equal(weights[k], base[k]) for k in base if k != key)


def test_kohya_layout_on_a_fused_qkv_lands_on_q_k_and_v(tmp_path, base):
    up, down = low_rank(3 * WIDTH, WIDTH, 2)
    tensors = {"lora_unet_double_blocks_1_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight": up,
               "lora_unet_double_blocks_1_img_attn_qkv.alpha": torch.tensor(ALPHA)}
    weights, report = merged(tmp_path, tensors, 1.5)
    delta = 1.5 * (up @ down) * (ALPHA / RANK)  # [3·D, D]: q, k, v rows
    for i, name in enumerate(("to_q", "to_k", "to_v")):
        key = f"transformer_blocks.1.attn.{name}.weight"
        assert torch.allclose(weights[key], base[key] + delta[i * WIDTH:(i + 1) * WIDTH], atol=1e-6), name
    assert report["merged_modules"] == 1


def test_comfyui_layout_on_single_block_linear1_without_alpha(tmp_path, base):
    up, down = low_rank(7 * WIDTH, WIDTH, 3)
    tensors = {"diffusion_model.single_blocks.0.linear1.lora_A.weight": down,
               "diffusion_model.single_blocks.0.linear1.lora_B.weight": up}
    weights, report = merged(tmp_path, tensors, 1.0)
    delta = up @ down  # no alpha: scale 1
    key = "single_transformer_blocks.0.proj_mlp.weight"
    assert torch.allclose(weights[key], base[key] + delta[3 * WIDTH:], atol=1e-6)
    assert report["merged_modules"] == 1


def test_foreign_keys_are_reported_with_count_and_example(tmp_path):
    up, down = low_rank(WIDTH, WIDTH, 4)
    tensors = {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down,
               "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": up,
               "transformer.transformer_blocks.0.attn.to_k.lora_A.weight": down.clone(),
               "transformer.transformer_blocks.0.attn.to_k.lora_B.weight": up.clone()}
    _, report = merged(tmp_path, tensors, 1.0)
    assert report["merged_modules"] == 1 and report["unmatched_keys"] == 1
    assert report["unmatched_examples"] == ["lora_te1_text_model_encoder_layers_0_mlp_fc1"]


def test_lora_through_the_backend_is_reported_and_cached_apart(backend1, tmp_path):
    up, down = low_rank(WIDTH, WIDTH, 5)
    path = tmp_path / "style.safetensors"
    save_file({"transformer_blocks.0.attn.to_v.lora_A.weight": down,
               "transformer_blocks.0.attn.to_v.lora_B.weight": up * 3}, str(path))
    fields = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 1}
    plain, _ = backend1.sample(fields)
    zero, _ = backend1.sample({**fields, "loras": [{"path": str(path), "strength": 0.0}]})
    styled, info = backend1.sample({**fields, "loras": [{"path": str(path), "strength": 1.0}]})
    assert torch.equal(zero["samples"], plain["samples"])
    assert (styled["samples"] - plain["samples"]).abs().max() > 1e-3
    assert info["loras"][0]["merged_modules"] == 1 and info["loras"][0]["file"] == str(path.resolve())
    with pytest.raises(Exception, match="no LoRA file"):
        backend1.sample({**fields, "loras": [{"path": "/nowhere/lora.safetensors"}]})


# A second family: SD3 LoRAs in ComfyUI's original names and kohya's, on the fused x-block qkv.
SD3_WIDTH = 128  # sd3-tiny: 4 heads × 32


@pytest.fixture(scope="module")
def sd3_base():
    return registry.build("sd3-tiny", torch.device("cpu")).transformer.state_dict()


@pytest.mark.parametrize("layout", ["comfyui", "kohya"])
def test_sd3_lora_on_the_fused_qkv_equals_a_manual_merge(tmp_path, sd3_base, layout):
    up, down = low_rank(3 * SD3_WIDTH, SD3_WIDTH, 6)
    name = {"comfyui": "diffusion_model.joint_blocks.1.x_block.attn.qkv",
            "kohya": "lora_unet_joint_blocks_1_x_block_attn_qkv"}[layout]
    suffixes = {"comfyui": ("lora_A.weight", "lora_B.weight"), "kohya": ("lora_down.weight", "lora_up.weight")}[layout]
    path = tmp_path / "sd3.safetensors"
    save_file({f"{name}.{suffixes[0]}": down, f"{name}.{suffixes[1]}": up, f"{name}.alpha": torch.tensor(ALPHA)},
              str(path))
    zero = effective(registry.build("sd3-tiny", torch.device("cpu"), loras=[LoraSpec(str(path), 0.0)]))
    assert all(torch.equal(zero[k], sd3_base[k]) for k in sd3_base)
    model = registry.build("sd3-tiny", torch.device("cpu"), loras=[LoraSpec(str(path), 0.6)])
    weights = effective(model)
    delta = 0.6 * (up @ down) * (ALPHA / RANK)  # [3·D, D]: q, k, v rows
    for i, proj in enumerate(("to_q", "to_k", "to_v")):
        key = f"transformer_blocks.1.attn.{proj}.weight"
        assert torch.allclose(weights[key], sd3_base[key] + delta[i * SD3_WIDTH:(i + 1) * SD3_WIDTH], atol=1e-6)
    assert model.lora_reports[0]["merged_modules"] == 1 and model.lora_reports[0]["unmatched_keys"] == 0


def test_a_flux_lora_on_an_sd3_model_is_reported_not_merged(tmp_path, sd3_base):
    up, down = low_rank(3 * SD3_WIDTH, SD3_WIDTH, 7)
    path = tmp_path / "flux-style.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up}, str(path))
    model = registry.build("sd3-tiny", torch.device("cpu"), loras=[LoraSpec(str(path), 1.0)])
    report = model.lora_reports[0]
    assert report["merged_modules"] == 0 and report["unmatched_keys"] == 1
    assert report["unmatched_examples"] == ["lora_unet_double_blocks_0_img_attn_qkv"]
    assert all(torch.equal(effective(model)[k], sd3_base[k]) for k in sd3_base)


def test_a_lora_patches_a_model_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU the LoRA file is read on the CPU and the weights sit on cuda:0: the LoRA's tensors
    must move to the weight's device, and its patch be computed there. FakeTensorMode gives the weights a CUDA device with
    no GPU, and raises the same "found at least two devices, cuda:0 and cpu" error CUDA raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from xdit_backend.models import lora

    q_up, q_down = low_rank(WIDTH, WIDTH, 8)
    k_up, k_down = low_rank(WIDTH, WIDTH, 9)
    tensors = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": q_down,
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": q_up,
               "transformer_blocks.1.attn.to_k.lora_A.weight": k_down,
               "transformer_blocks.1.attn.to_k.lora_B.weight": k_up}
    path = tmp_path / "gpu.safetensors"
    save_file(tensors, str(path))
    files = {str(path): lora.read_pairs(str(path))}  # read and checked here, as real CPU tensors (the fake mode
    monkeypatch.setattr(lora, "read_pairs", files.__getitem__)  # can neither read files nor look at values)
    cuda = torch.device("cuda", 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = registry.build("flux-tiny", cuda, torch.bfloat16, loras=[LoraSpec(str(path), 0.8)])
        weights = effective(model)  # the patched forwards run on cuda:0
    assert model.lora_reports[0]["merged_modules"] == 2 and model.lora_reports[0]["unmatched_keys"] == 0
    merged = [weights[f"transformer_blocks.{key}.weight"] for key in ("0.attn.to_q", "1.attn.to_k")]
    assert all(w.device == cuda and w.dtype == torch.bfloat16 for w in merged)


PEFT_Q = "transformer.transformer_blocks.0.attn.to_q"


@pytest.mark.parametrize("tensors, says", [
    ({f"{PEFT_Q}.lora_A.weight": torch.randn(2, WIDTH), f"{PEFT_Q}.lora_B.weight": torch.randn(WIDTH, 3)},
     f"{PEFT_Q}: A is [2, {WIDTH}] and B [{WIDTH}, 3]; a LoRA's A is [rank, inputs] and B [outputs, rank], of the "
     "same rank of at least 1"),
    ({f"{PEFT_Q}.lora_A.weight": torch.randn(0, WIDTH), f"{PEFT_Q}.lora_B.weight": torch.randn(WIDTH, 0)},
     f"{PEFT_Q}: A is [0, {WIDTH}] and B [{WIDTH}, 0]; a LoRA's A is [rank, inputs] and B [outputs, rank], of the "
     "same rank of at least 1"),
    ({f"{PEFT_Q}.lora_A.weight": torch.randn(2, WIDTH), f"{PEFT_Q}.lora_B.weight": torch.randn(WIDTH, 2),
      f"{PEFT_Q}.alpha": torch.ones(3)}, f"{PEFT_Q}: alpha has 3 values (shape [3]); it is one number"),
    ({f"{PEFT_Q}.lora_A.weight": torch.randn(2, WIDTH + 8), f"{PEFT_Q}.lora_B.weight": torch.randn(WIDTH, 2)},
     f"{PEFT_Q} does not fit the layer it names: A is [2, {WIDTH + 8}] and B [{WIDTH}, 2], and "
     f"transformer_blocks.0.attn.to_q is a Linear of {WIDTH} inputs and {WIDTH} outputs"),
    ({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(2, WIDTH),
      "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(2 * WIDTH, 2)},
     "lora_unet_double_blocks_0_img_attn_qkv does not fit the layer it names: A is [2, 64] and B [128, 2], and "
     "transformer_blocks.0.attn.to_v is a Linear of 64 inputs and 64 outputs (rows 128–192 of the fused "
     "double_blocks.0.img_attn.qkv.weight)"),
    ({f"{PEFT_Q}.lora_A.weight": torch.full((2, WIDTH), float("nan")), f"{PEFT_Q}.lora_B.weight": torch.randn(WIDTH, 2)},
     f"{PEFT_Q}: A holds {2 * WIDTH} NaN or infinite values of {2 * WIDTH}"),
], ids=["ranks-differ", "rank-zero", "alpha-not-a-number", "wrong-width", "fused-too-short", "not-finite"])
def test_a_malformed_lora_is_refused_at_load_naming_the_file_the_key_and_the_shapes(tmp_path, tensors, says):
    """Issue 25 (10): these failed mid-run with raw errors (mat1 and mat2 shapes cannot be multiplied, only one
    element tensors…, float division by zero) or were reported only as matching nothing."""
    from xdit_backend.errors import UserError

    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(UserError) as error:
        registry.build("flux-tiny", torch.device("cpu"), loras=[LoraSpec(str(path), 1.0)])
    assert error.value.message == f"LoRA {path}: {says}"
