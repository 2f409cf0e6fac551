"""Weights stay in their storage precision (models/storage.py): an fp8 file's Linear weights are
float8 on the device (1 byte a value) and upcast one layer at a time; weight_dtype fp8_* stores a
16/32-bit file so; the output equals the model computed with the dequantised weights."""

import os
import sys

import pytest
import torch
from safetensors.torch import save_file
from backend.test_model_files import bfl_state_dict, forward

from xdit_backend.client import BackendError
from xdit_backend.errors import UserError
from xdit_backend.memory import fit as memory_fit
from xdit_backend.models import registry
from xdit_backend.models.registry import ModelError
from xdit_backend.models.resolved import resolve_model
from xdit_backend.models.storage import StoredLinear
from xdit_backend.service.reference import serial_latent

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return registry.build("flux-tiny", CPU)


def linear_weights(transformer) -> dict[str, torch.Tensor]:
    return {name: module.weight for name, module in transformer.named_modules()
            if isinstance(module, torch.nn.Linear)}


def parameter_bytes(transformer) -> int:
    return sum(p.numel() * p.element_size() for p in transformer.parameters())


def rounded(tiny, fp8: torch.dtype):
    """The reference: flux-tiny with every tensor rounded through ``fp8`` (as a file stored all in fp8, or a
    16-bit file loaded with weight_dtype fp8, as ComfyUI's UNETLoader does), computed in float32."""
    model = registry.build("flux-tiny", CPU)
    state = {k: v.to(fp8).float() for k, v in tiny.transformer.state_dict().items()}
    model.transformer.load_state_dict(state)
    return model


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_an_fp8_file_stays_fp8_at_one_byte_a_value(tiny, tmp_path, fp8):
    path = tmp_path / "flux-fp8.safetensors"
    save_file({k: v.to(fp8) for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    loaded = registry.build(str(path), CPU)
    weights = linear_weights(loaded.transformer)
    assert {w.dtype for w in weights.values()} == {fp8}
    assert all(isinstance(m, StoredLinear) for m in loaded.transformer.modules() if isinstance(m, torch.nn.Linear))
    matrix_values = sum(w.numel() for w in weights.values())
    others = sum(p.numel() for p in loaded.transformer.parameters()) - matrix_values
    # 1 byte per matrix value; biases, norms and the rest in the float32 compute dtype
    assert parameter_bytes(loaded.transformer) == matrix_values * 1 + others * 4
    assert parameter_bytes(loaded.transformer) < parameter_bytes(tiny.transformer) / 3
    assert loaded.dtype == torch.float32 and loaded.storage_dtype == str(fp8).removeprefix("torch.")
    difference = (forward(loaded.transformer) - forward(rounded(tiny, fp8).transformer)).abs().max()
    assert difference <= 1e-5


@pytest.mark.parametrize("name, fp8", [("fp8_e4m3fn", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_weight_dtype_fp8_stores_a_16_bit_file_in_fp8(tiny, tmp_path, name, fp8):
    path = tmp_path / "flux-bf16.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    loaded = registry.build(str(path), CPU, weight_dtype=name)
    assert {w.dtype for w in linear_weights(loaded.transformer).values()} == {fp8}
    assert loaded.storage_dtype == str(fp8).removeprefix("torch.")
    bf16 = registry.build("flux-tiny", CPU)
    bf16.transformer.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in tiny.transformer.state_dict().items()})
    reference = rounded(bf16, fp8)  # every parameter, not only the Linear weights: as ComfyUI
    assert (forward(loaded.transformer) - forward(reference.transformer)).abs().max() <= 1e-5
    default = registry.build(str(path), CPU)  # default: the file's precision, here the compute dtype's
    assert {w.dtype for w in linear_weights(default.transformer).values()} == {torch.float32}
    assert default.storage_dtype == "float32"


def test_weight_dtype_fp8_saturates_instead_of_overflowing(tiny, tmp_path):
    """A value beyond e4m3fn's ±448 becomes ±448 (a plain cast gives NaN)."""
    state = bfl_state_dict(tiny.transformer)
    state["img_in.weight"] = state["img_in.weight"].clone()
    state["img_in.weight"][0, :2] = torch.tensor([1000.0, -1000.0])
    path = tmp_path / "flux-big.safetensors"
    save_file(state, str(path))
    weight = registry.build(str(path), CPU, weight_dtype="fp8_e4m3fn").transformer.x_embedder.weight
    assert weight[0, :2].float().tolist() == [448.0, -448.0]


def test_a_builtin_stored_in_fp8_and_an_unknown_weight_dtype():
    model = registry.build("flux-tiny", CPU, weight_dtype="fp8_e4m3fn")
    assert model.storage_dtype == "float8_e4m3fn" and model.dtype == torch.float32
    with pytest.raises(ModelError, match="weight_dtype 'int4' is not supported"):
        registry.build("flux-tiny", CPU, weight_dtype="int4")


def test_a_pipefusion_stage_of_an_fp8_file_reads_only_its_blocks(tiny, tmp_path):
    from xdit_backend.parallel.pipefusion import keep_stage

    path = tmp_path / "flux-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    stage = registry.build(str(path), CPU, blocks=(1, 4))
    unread = {k.split(".")[0] + "." + k.split(".")[1] for k, p in stage.transformer.named_parameters() if p.is_meta}
    assert unread == {"transformer_blocks.0", "single_transformer_blocks.2", "single_transformer_blocks.3",
                      "single_transformer_blocks.4"}
    kept = keep_stage(stage.transformer, stage.spec.stage_plan, 1, 4)
    assert {m.weight.dtype for block in kept for m in block.modules() if isinstance(m, torch.nn.Linear)} == {
        torch.float8_e4m3fn}
    assert stage.storage_dtype == "float8_e4m3fn"


def serial(fields: dict, model) -> torch.Tensor:
    return serial_latent(fields, model=model)


def test_a_request_weight_dtype_reaches_every_rank(backend2):
    """weight_dtype travels with the request to both ranks: ulysses=2 in fp8 storage equals the
    serial fp8-stored model, and differs from the float32 one; a name outside the choices is refused."""
    fields = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 4}
    stored, _ = backend2.sample({**fields, "weight_dtype": "fp8_e4m3fn", "parallel": {"ulysses": 2}})
    fp8 = serial({**fields, "weight_dtype": "fp8_e4m3fn"}, registry.build("flux-tiny", CPU, weight_dtype="fp8_e4m3fn"))
    full = serial(fields, registry.build("flux-tiny", CPU))
    assert (stored["samples"] - fp8).abs().max() <= 1e-4
    assert (stored["samples"] - full).abs().max() > 1e-3
    with pytest.raises(BackendError, match="weight_dtype 'int8' is not supported"):
        backend2.sample({**fields, "weight_dtype": "int8"})


# ---------------------------------------------------------------- ComfyUI's scaled fp8 and mixed precision

FP8 = torch.float8_e4m3fn


def scaled(weight: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 values, float32 scale): absmax scaling, one scale per tensor or per output row [out, 1]."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_row else weight.abs().max()
    scale = (amax / 448).float()
    return (weight / scale).to(FP8), scale


def comfy_scaled_file(state: dict, path, per_row=False, mixed=False) -> dict[str, torch.Tensor]:
    """Write a ComfyUI scaled-fp8 file (``scaled_fp8`` marker, ``scale_weight`` / ``scale_input`` per
    Linear) or, ``mixed``, a mixed-precision one (``comfy_quant`` + ``weight_scale`` on every other
    Linear, the rest bf16); everything else bf16. Returns the same model in plain float32 BFL layout,
    dequantised as ComfyUI does (weight.to(float32) * scale): the reference."""
    out, reference = {}, {}
    linears = [key for key, value in state.items() if key.endswith(".weight") and value.dim() == 2]
    quantized = linears[::2] if mixed else linears
    for key, value in state.items():
        layer = key.removesuffix(".weight")
        if key in quantized:
            out[key], scale = scaled(value, per_row)
            if mixed:
                out[f"{layer}.weight_scale"] = scale
                out[f"{layer}.comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
            else:
                out[f"{layer}.scale_weight"] = scale
                out[f"{layer}.scale_input"] = torch.ones(())
            reference[key] = out[key].float() * scale
        else:
            out[key] = value.to(torch.bfloat16)
            reference[key] = out[key].float()
    if not mixed:
        out["scaled_fp8"] = torch.empty(0, dtype=FP8)
    save_file(out, str(path))
    return reference


@pytest.mark.parametrize("per_row, mixed", [(False, False), (True, False), (False, True)],
                         ids=["scaled-fp8", "per-row-scales", "mixed-precision"])
def test_a_comfyui_scaled_fp8_file_keeps_its_scales_and_matches_the_dequantised_model(tiny, tmp_path, per_row, mixed):
    path = tmp_path / "flux-scaled.safetensors"
    reference = comfy_scaled_file(bfl_state_dict(tiny.transformer), path, per_row, mixed)
    save_file(reference, str(tmp_path / "reference.safetensors"))
    expected = registry.build(str(tmp_path / "reference.safetensors"), CPU)
    loaded = registry.build(str(path), CPU)
    stored = [m for m in loaded.transformer.modules() if isinstance(m, StoredLinear)]
    linears = [m for m in loaded.transformer.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.weight.dtype == FP8 and "weight_scale" in m._buffers for m in stored)
    if mixed:
        assert 0 < len(stored) < len(linears)
        assert set(loaded.storage_dtype.split("+")) == {"float8_e4m3fn scaled", "float32"}
    else:
        assert len(stored) == len(linears) and loaded.storage_dtype == "float8_e4m3fn scaled"
    # the fused qkv's per-row scales went with their rows: each part is the dequantised reference's rows
    for name, module in loaded.transformer.named_modules():
        if isinstance(module, StoredLinear):
            assert torch.equal(module.upcast(torch.float32), expected.transformer.get_submodule(name).weight), name
    assert (forward(loaded.transformer) - forward(expected.transformer)).abs().max() <= 1e-5


def test_a_wan_scaled_fp8_file_loads_its_float32_modules_dequantised(tmp_path):
    """Wan's scaled-fp8 files were refused: now its Linear weights keep their scales, and the scaled
    weights of its float32 modules (the time embedder) are dequantised at load."""
    from unit.test_wan_checkpoint import TINY, build, original_state_dict
    from unit.test_wan_checkpoint import forward as wan_forward

    path = tmp_path / "wan-scaled.safetensors"
    save_file(comfy_scaled_file(original_state_dict(build(TINY)), path), str(tmp_path / "reference.safetensors"))
    loaded = registry.build(str(path), CPU).transformer
    expected = registry.build(str(tmp_path / "reference.safetensors"), CPU).transformer
    assert isinstance(loaded.blocks[0].attn1.to_q, StoredLinear)
    assert loaded.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    difference = wan_forward(loaded, 16, TINY["text_dim"]) - wan_forward(expected, 16, TINY["text_dim"])
    assert difference.abs().max() <= 1e-5


def test_a_scale_without_its_weight_and_an_unknown_format_are_named(tiny, tmp_path):
    state = {k: v.to(torch.bfloat16) for k, v in bfl_state_dict(tiny.transformer).items()}
    path = tmp_path / "orphan.safetensors"
    save_file({**state, "double_blocks.0.img_attn.qkx.scale_weight": torch.ones(())}, str(path))
    with pytest.raises(ModelError, match=r"orphan.safetensors: scales without their weight: "
                                         r"double_blocks.0.img_attn.qkx.scale_weight") as info:
        registry.resolve(str(path))
    assert "re-download" in info.value.hint
    path = tmp_path / "nvfp4.safetensors"
    save_file(state, str(path), metadata={"_quantization_metadata": '{"format_version": "1.0", "layers": '
                                          '{"double_blocks.0.img_mlp.0": {"format": "nvfp4"}}}'})
    with pytest.raises(ModelError, match=r"nvfp4.safetensors: layer double_blocks.0.img_mlp.0 is quantized as "
                                         r"'nvfp4'") as info:
        registry.resolve(str(path))
    assert "GGUF" in info.value.hint


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to read the file with ComfyUI")


@needs_comfyui
def test_comfyuis_scaled_fp8_linear_reads_our_test_file_as_we_do(tiny, tmp_path):
    """The layout check: ComfyUI's own scaled-fp8 Linear (comfy/ops.py), given the file's fused qkv
    weight and scale, computes what our to_q, to_k, to_v weights compute together. (Without the
    bias: ComfyUI's layer would hold it in float8 too, a rounding of its own.)"""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ops
    from safetensors.torch import load_file

    path = tmp_path / "flux-scaled.safetensors"
    comfy_scaled_file(bfl_state_dict(tiny.transformer), path)
    file = load_file(str(path))
    theirs = comfy.ops.scaled_fp8_ops(override_dtype=file["scaled_fp8"].dtype).Linear(64, 192, bias=False)
    layer = "double_blocks.0.img_attn.qkv"
    theirs.load_state_dict({"weight": file[f"{layer}.weight"], "scale_weight": file[f"{layer}.scale_weight"]})
    attn = registry.build(str(path), CPU).transformer.transformer_blocks[0].attn
    weight = torch.cat([attn.to_q.upcast(torch.float32), attn.to_k.upcast(torch.float32),
                        attn.to_v.upcast(torch.float32)])  # [3·64, 64], the fused rows in order
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (x @ weight.T - theirs(x)).abs().max() <= 1e-5


def test_a_lora_on_a_scaled_fp8_file_adds_its_term_and_leaves_the_fp8_weight(tiny, tmp_path):
    """The LoRA is a patch (models/lora.py): the layer gives its dequantised W·x + s·(α/r)·(x·Aᵀ)·Bᵀ,
    and the float8 weight and its scale are untouched (no re-rounding)."""
    from xdit_backend.models.lora import LoraSpec

    path = tmp_path / "flux-scaled.safetensors"
    comfy_scaled_file(bfl_state_dict(tiny.transformer), path, per_row=True)
    g = torch.Generator().manual_seed(5)
    up, down = torch.randn(192, 2, generator=g) * 0.1, torch.randn(2, 64, generator=g) * 0.1
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": down,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": up,
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(2.0)}, str(tmp_path / "lora.safetensors"))
    base = registry.build(str(path), CPU).transformer.transformer_blocks[0].attn.to_k
    model = registry.build(str(path), CPU, loras=[LoraSpec(str(tmp_path / "lora.safetensors"), 0.5)])
    to_k = model.transformer.transformer_blocks[0].attn.to_k
    assert model.lora_reports[0]["merged_modules"] == 1 and to_k.weight.dtype == FP8
    assert torch.equal(to_k.weight, base.weight)
    x = torch.randn(3, 64, generator=g)
    wanted = x @ (base.upcast(torch.float32) + 0.5 * (up @ down)[64:128] * (2.0 / 2)).T + base.bias
    with torch.no_grad():
        assert (to_k(x) - wanted).abs().max() <= 1e-5


def test_a_lora_on_weights_kept_as_gguf_blocks_adds_its_term(tmp_path, tiny):
    gguf = pytest.importorskip("gguf")
    from ranks.test_gguf import gguf_file

    from xdit_backend.models.lora import LoraSpec

    path = tmp_path / "flux-q8.gguf"
    gguf_file(bfl_state_dict(tiny.transformer), path, gguf.GGMLQuantizationType.Q8_0)
    g = torch.Generator().manual_seed(6)
    up, down = torch.randn(64, 2, generator=g), torch.randn(2, 64, generator=g)
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": down,
               "transformer_blocks.0.attn.to_q.lora_B.weight": up}, str(tmp_path / "lora.safetensors"))
    base = registry.build(str(path), CPU).transformer.transformer_blocks[0].attn.to_q
    model = registry.build(str(path), CPU, loras=[LoraSpec(str(tmp_path / "lora.safetensors"), 1.0)])
    x = torch.randn(3, 64, generator=g)
    with torch.no_grad():
        got = model.transformer.transformer_blocks[0].attn.to_q(x)
        assert (got - (base(x) + x @ (up @ down).T)).abs().max() <= 1e-4
    assert model.lora_reports[0]["merged_modules"] == 1


def test_a_device_without_float8_is_refused_before_loading(tiny, tmp_path, monkeypatch):
    from xdit_backend.models import storage

    def no_float8(device):
        raise RuntimeError(f'"copy_" not implemented for \'Float8_e4m3fn\' on {device}')

    monkeypatch.setattr(storage, "float8_round_trip", no_float8)
    path = tmp_path / "flux-fp8.safetensors"
    save_file({k: v.to(FP8) for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    with pytest.raises(UserError, match=r"flux-fp8.safetensors: its weights are float8, which this torch cannot "
                                         r"keep on cpu") as info:
        registry.build(str(path), CPU)
    assert "bf16" in info.value.hint
    with pytest.raises(UserError, match="flux-tiny: its weights are float8"):
        registry.build("flux-tiny", CPU, weight_dtype="fp8_e5m2")
    assert registry.build("flux-tiny", CPU).storage_dtype == "float32"  # nothing float8: not asked


def test_the_fit_check_counts_an_fp8_files_matrices_at_their_stored_byte(tiny, tmp_path):
    """Before loading, the memory model sizes an fp8 file's weights as it will be held (1 byte a matrix
    value), not at the compute dtype: counted against the loaded model's parameters."""
    path = tmp_path / "flux-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    estimate = memory_fit.needed(resolve_model(str(path)), torch.float32, "default", 1, None, tokens_per_rank=16,
                                 rows=1)
    held = parameter_bytes(registry.build(str(path), CPU).transformer)
    assert abs(estimate.weights_resident - held) <= 0.05 * held, (estimate.weights_resident, held)
