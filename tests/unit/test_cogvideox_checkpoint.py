"""CogVideoX files in THUDM's SAT key layout (bare or in a checkpoint, fp8, scaled fp8), in diffusers'
own key names and in ComfyUI's load into diffusers' CogVideoXTransformer3DModel at any width; the
variant is read off the shapes; incomplete, foreign and image-to-video files are named."""

import pytest
import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors.torch import save_file

from xdit_backend.errors import UserError
from xdit_backend.models import cogvideox_checkpoint, registry
from xdit_backend.models.cogvideox import CogVideoXModel, CogVideoXSpec
from xdit_backend.models.lora import LoraSpec
from xdit_backend.models.storage import StoredLinear

# What the converter cannot read off the shapes is THUDM's: the training grid and 226 text slots.
TINY = {"num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 16, "out_channels": 16,
        "time_embed_dim": 32, "text_embed_dim": 64, "num_layers": 2, "sample_width": 90, "sample_height": 60,
        "sample_frames": 49, "patch_size": 2, "patch_size_t": None, "patch_bias": True, "max_text_seq_length": 226,
        "use_rotary_positional_embeddings": True, "ofs_embed_dim": None}
VARIANTS = {
    "2b-like": {**TINY, "use_rotary_positional_embeddings": False},
    "5b-like": TINY,
    "1.5-like": {**TINY, "patch_size_t": 2, "sample_width": 300, "sample_height": 300, "sample_frames": 81},
}
# CogVideoX1.5-5B-I2V: the start image's latent concatenated (32 in), the ofs MLP (its width the time embedding's)
VARIANTS["1.5-i2v-like"] = {**VARIANTS["1.5-like"], "in_channels": 32, "ofs_embed_dim": 32}
FULL = {  # THUDM's sat/configs: hidden_size, num_attention_heads, num_layers (head size 64), time_embed_dim 512
    "CogVideoX-2b": {"num_attention_heads": 30, "num_layers": 30, "use_rotary_positional_embeddings": False},
    "CogVideoX-5b": {"num_attention_heads": 48, "num_layers": 42},
    "CogVideoX1.5-5B": {"num_attention_heads": 48, "num_layers": 42, "patch_size_t": 2, "sample_width": 300,
                        "sample_height": 300, "sample_frames": 81},
}


def sat_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers CogVideoX → THUDM's SAT key layout (the names diffusers' conversion script reads),
    written out here independently of the converter."""
    sd = transformer.state_dict()
    out = {}

    def both(original, diffusers):
        for param in ("weight", "bias"):
            out[f"{original}.{param}"] = sd[f"{diffusers}.{param}"]

    both("mixins.patch_embed.proj", "patch_embed.proj")
    both("mixins.patch_embed.text_proj", "patch_embed.text_proj")
    both("time_embed.0", "time_embedding.linear_1")  # Sequential(Linear, SiLU, Linear)
    both("time_embed.2", "time_embedding.linear_2")
    both("transformer.final_layernorm", "norm_final")
    both("mixins.final_layer.norm_final", "norm_out.norm")
    both("mixins.final_layer.linear", "proj_out")
    both("mixins.final_layer.adaLN_modulation.1", "norm_out.linear")  # Sequential(SiLU, Linear): (shift, scale)
    if transformer.ofs_embedding is not None:  # 1.5-I2V: Sequential(Linear, SiLU, Linear), as time_embed
        both("ofs_embed.0", "ofs_embedding.linear_1")
        both("ofs_embed.2", "ofs_embedding.linear_2")
    for i in range(len(transformer.transformer_blocks)):
        layer, block = f"transformer.layers.{i}", f"transformer_blocks.{i}"
        both(f"{layer}.input_layernorm", f"{block}.norm1.norm")
        both(f"{layer}.post_attention_layernorm", f"{block}.norm2.norm")
        both(f"{layer}.attention.dense", f"{block}.attn1.to_out.0")
        both(f"{layer}.mlp.dense_h_to_4h", f"{block}.ff.net.0.proj")
        both(f"{layer}.mlp.dense_4h_to_h", f"{block}.ff.net.2")
        both(f"mixins.adaln_layer.query_layernorm_list.{i}", f"{block}.attn1.norm_q")
        both(f"mixins.adaln_layer.key_layernorm_list.{i}", f"{block}.attn1.norm_k")
        for param in ("weight", "bias"):
            out[f"{layer}.attention.query_key_value.{param}"] = torch.cat(
                [sd[f"{block}.attn1.{p}.{param}"] for p in ("to_q", "to_k", "to_v")])
            # SAT's 12 chunks: (shift, scale, gate) of video attention, video MLP, text attention, text MLP
            attention = sd[f"{block}.norm1.linear.{param}"].chunk(2)  # (video, text), 3 chunks each
            mlp = sd[f"{block}.norm2.linear.{param}"].chunk(2)
            out[f"mixins.adaln_layer.adaLN_modulations.{i}.1.{param}"] = torch.cat(
                [attention[0], mlp[0], attention[1], mlp[1]])
    width = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    if transformer.config.use_rotary_positional_embeddings:  # buffers diffusers recomputes; values irrelevant
        out["mixins.pos_embed.freqs_cos"], out["mixins.pos_embed.freqs_sin"] = torch.zeros(4, 32), torch.zeros(4, 32)
    else:
        out["mixins.pos_embed.pos_embedding"] = torch.zeros(1, 4, width)
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CogVideoXTransformer3DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def forward(model: CogVideoXModel, config, seed=0):
    g = torch.Generator().manual_seed(seed)
    frames = 2 if config["patch_size_t"] else 3
    x = torch.randn(1, 16, frames, 8, 8, generator=g)
    context = torch.randn(1, 226, config["text_embed_dim"], generator=g)
    with torch.no_grad():
        return model.output(x, torch.tensor([500.0]), {"context": context}, None)


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param, build(VARIANTS[request.param])


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["bare", "checkpoint"])
def test_sat_file_loads_as_the_same_model(variant, tmp_path, prefix):
    """Every tensor equal, the same forward output, the config read off the shapes."""
    name, built = variant
    config = VARIANTS[name]
    path = tmp_path / "cogvideox.safetensors"
    save_file({prefix + k: v for k, v in sat_state_dict(built).items()}, str(path))
    source = registry.resolve(str(path))
    assert source.family == "cogvideox" and source.prefix == prefix
    assert source.config == config
    kind = " image to video" if config["in_channels"] == 32 else ""
    assert source.describes.startswith(f"CogVideoX{kind} architecture, width 64, 2 blocks")
    loaded = registry.build(str(path), torch.device("cpu"))
    expected = built.state_dict()
    assert loaded.transformer.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    reference = CogVideoXModel(built, "built", CogVideoXSpec.from_config(config), compute_dtype=torch.float32)
    assert (forward(loaded, config) - forward(reference, config)).abs().max() <= 1e-5


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tmp_path):
    """A float8_e4m3fn file: Linear weights stay float8 (fused q/k/v and the interleaved modulations
    cut in float8), the rest loads to float32; all equal the fp8-rounded weights."""
    built = build(TINY)
    path = tmp_path / "cogvideox-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in sat_state_dict(built).items()}, str(path))
    loaded = registry.build(str(path), torch.device("cpu")).transformer
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert {"transformer_blocks.0.attn1.to_k.weight", "transformer_blocks.1.norm2.linear.weight",
            "proj_out.weight"} <= stored
    for key, value in built.state_dict().items():
        tensor, rounded = loaded.state_dict()[key], value.to(torch.float8_e4m3fn)
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), rounded.float()), key


def test_a_scaled_fp8_file_loads_its_weights_times_their_scale(tmp_path):
    """ComfyUI's scaled fp8: each 2-D weight in float8 beside a scalar ``scale_weight``."""
    built = build(TINY)
    original = sat_state_dict(built)
    scaled = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, value in original.items():
        if key.endswith(".weight") and value.dim() == 2:
            scale = value.abs().max() / 448
            scaled[key] = (value / scale).to(torch.float8_e4m3fn)
            scaled[key.removesuffix("weight") + "scale_weight"] = scale.reshape(1)
        else:
            scaled[key] = value
    path = tmp_path / "cogvideox-scaled.safetensors"
    save_file(scaled, str(path))
    model = registry.build(str(path), torch.device("cpu"))
    reference = CogVideoXModel(built, "built", CogVideoXSpec.from_config(TINY), compute_dtype=torch.float32)
    ours, theirs = forward(model, TINY), forward(reference, TINY)
    assert model.storage_dtype.startswith("float8_e4m3fn")
    assert (ours - theirs).norm() < 0.1 * theirs.norm()  # fp8's rounding, not a wrong tensor


@pytest.mark.parametrize("name", list(FULL))
def test_released_configs_and_names_are_read_off_the_shapes(name):
    """For each released size (built on meta): the shapes give its config back, and its name."""
    config = {**TINY, "attention_head_dim": 64, "text_embed_dim": 4096, "time_embed_dim": 512, **FULL[name]}
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in sat_state_dict(CogVideoXTransformer3DModel(**config)).items()}
    assert cogvideox_checkpoint.config_from_shapes(shapes, "", "full.safetensors") == config
    assert cogvideox_checkpoint.variant(config) == name


def test_2b_without_position_buffers_is_told_by_its_width():
    config = {**TINY, "attention_head_dim": 64, "text_embed_dim": 4096, "time_embed_dim": 512, **FULL["CogVideoX-2b"]}
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in sat_state_dict(CogVideoXTransformer3DModel(**config)).items()
                  if not k.startswith("mixins.pos_embed.")}
    assert not cogvideox_checkpoint.config_from_shapes(shapes, "", "2b.safetensors")["use_rotary_positional_embeddings"]


def tiny_shapes(**changes):
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in sat_state_dict(CogVideoXTransformer3DModel(**TINY)).items()}
    return {**shapes, **changes}


def test_detects_sat_keys_only():
    keys = set(tiny_shapes())
    assert cogvideox_checkpoint.detect_prefix(keys) == ""
    assert cogvideox_checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."
    assert cogvideox_checkpoint.detect_prefix({"img_in.weight", "double_blocks.0.img_attn.qkv.weight"}) is None
    assert cogvideox_checkpoint.detect_prefix({"patch_embed.proj.weight", "proj_out.weight"}) is None  # too few


@pytest.mark.parametrize("changes, words", [
    # CogVideoX-5b-I2V: its learned table beside RoPE's buffers
    ({"mixins.patch_embed.proj.weight": [64, 32, 2, 2], "mixins.pos_embed.pos_embedding": [1, 17776, 64]},
     "learned position embeddings (CogVideoX-5b-I2V)"),
    ({"mixins.patch_embed.proj.weight": [64, 48, 2, 2]}, "input channels 48"),
], ids=["5b-i2v", "48-channels"])
def test_other_image_inputs_are_refused_by_name(changes, words):
    with pytest.raises(UserError, match="i2v.safetensors: .*CogVideoX.* not supported") as info:
        cogvideox_checkpoint.config_from_shapes(tiny_shapes(**changes), "", "i2v.safetensors")
    assert words in info.value.message


def test_inconsistent_shapes_name_the_file_and_the_tensor():
    changes = {"transformer.layers.0.attention.query_key_value.weight": [190, 64]}
    with pytest.raises(UserError, match="odd.safetensors.*query_key_value"):
        cogvideox_checkpoint.config_from_shapes(tiny_shapes(**changes), "", "odd.safetensors")


def test_an_incomplete_file_is_named(tmp_path):
    """A file that lost a block's tensor: the registry says which, and to re-download it."""
    original = sat_state_dict(build(TINY))
    del original["mixins.adaln_layer.query_layernorm_list.0.weight"]
    path = tmp_path / "cut.safetensors"
    save_file(original, str(path))
    with pytest.raises(registry.ModelError, match="cogvideox tensor .*query_layernorm_list.0.weight.* is missing"):
        registry.resolve(str(path))
    original = sat_state_dict(build(TINY))
    del original["transformer.layers.1.mlp.dense_4h_to_h.bias"]
    save_file(original, str(path))
    with pytest.raises(registry.ModelError, match="could not read its weights"):
        registry.build(str(path), torch.device("cpu"))


# --- files in diffusers' key names and in ComfyUI's -------------------------------------------------

# ComfyUI's names for diffusers' modules (comfy/ldm/cogvideo/model.py in Comfy-Org/ComfyUI: CogVideoXBlock's
# q, k, v, norm_q, norm_k, attn_out, ff_proj, ff_out under blocks.N; the time MLP as two top-level Linears)
COMFYUI_NAMES = [("transformer_blocks.", "blocks."), (".attn1.to_q.", ".q."), (".attn1.to_k.", ".k."),
                 (".attn1.to_v.", ".v."), (".attn1.norm_q.", ".norm_q."), (".attn1.norm_k.", ".norm_k."),
                 (".attn1.to_out.0.", ".attn_out."), (".ff.net.0.proj.", ".ff_proj."), (".ff.net.2.", ".ff_out."),
                 ("time_embedding.linear_", "time_embedding_linear_"),
                 ("ofs_embedding.linear_", "ofs_embedding_linear_")]


def comfyui_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers CogVideoX → ComfyUI's names, written out here from ComfyUI's module, not the converter."""
    out = {}
    for key, value in transformer.state_dict().items():
        for old, new in COMFYUI_NAMES:
            key = key.replace(old, new)
        out[key] = value.contiguous()
    return out


def diffusers_state_dict(transformer) -> dict[str, torch.Tensor]:
    """What ``save_file(transformer.state_dict())`` writes: diffusers' own names."""
    return {key: value.contiguous() for key, value in transformer.state_dict().items()}


WRITERS = {"diffusers": diffusers_state_dict, "comfyui": comfyui_state_dict}
RENAMED_VARIANTS = ["5b-like", "1.5-like", "1.5-i2v-like"]  # 2B's sin-cos positions: told by its full width (below)


@pytest.mark.parametrize("layout", list(WRITERS))
@pytest.mark.parametrize("name", RENAMED_VARIANTS)
@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["bare", "checkpoint"])
def test_renamed_file_loads_as_the_same_model(layout, name, prefix, tmp_path):
    """A diffusers transformer saved in diffusers' or ComfyUI's names: every tensor equal, the same
    forward, the config read off the shapes."""
    config = VARIANTS[name]
    built = build(config)
    path = tmp_path / "cogvideox.safetensors"
    save_file({prefix + k: v for k, v in WRITERS[layout](built).items()}, str(path))
    source = registry.resolve(str(path))
    assert source.family == "cogvideox" and source.prefix == prefix
    assert source.config == {**config, "_key_layout": layout}
    kind = " image to video" if config["in_channels"] == 32 else ""
    assert source.describes.startswith(f"CogVideoX{kind} architecture, width 64, 2 blocks, RoPE")
    loaded = registry.build(str(path), torch.device("cpu"))
    assert loaded.transformer.state_dict().keys() == built.state_dict().keys()
    for key, value in built.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    reference = CogVideoXModel(built, "built", CogVideoXSpec.from_config(config), compute_dtype=torch.float32)
    assert (forward(loaded, config) - forward(reference, config)).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", list(WRITERS))
def test_an_fp8_renamed_file_keeps_its_linear_weights_in_fp8(layout, tmp_path):
    built = build(TINY)
    path = tmp_path / "cogvideox-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in WRITERS[layout](built).items()}, str(path))
    loaded = registry.build(str(path), torch.device("cpu")).transformer
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert {"transformer_blocks.0.attn1.to_k.weight", "transformer_blocks.1.ff.net.2.weight",
            "proj_out.weight"} <= stored
    for key, value in built.state_dict().items():
        tensor = loaded.state_dict()[key]
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), value.to(torch.float8_e4m3fn).float()), key


@pytest.mark.parametrize("layout", list(WRITERS))
def test_a_scaled_fp8_renamed_file_loads_its_weights_times_their_scale(layout, tmp_path):
    """ComfyUI's scaled fp8 (what ComfyUI saves): each 2-D weight in float8 beside a scalar ``scale_weight``."""
    built = build(TINY)
    scaled = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for key, value in WRITERS[layout](built).items():
        if key.endswith(".weight") and value.dim() == 2:
            scale = value.abs().max() / 448
            scaled[key] = (value / scale).to(torch.float8_e4m3fn)
            scaled[key.removesuffix("weight") + "scale_weight"] = scale.reshape(1)
        else:
            scaled[key] = value
    path = tmp_path / "cogvideox-scaled.safetensors"
    save_file(scaled, str(path))
    model = registry.build(str(path), torch.device("cpu"))
    reference = CogVideoXModel(built, "built", CogVideoXSpec.from_config(TINY), compute_dtype=torch.float32)
    ours, theirs = forward(model, TINY), forward(reference, TINY)
    assert model.storage_dtype.startswith("float8_e4m3fn")
    assert (ours - theirs).norm() < 0.1 * theirs.norm()  # fp8's rounding, not a wrong tensor


def test_a_lora_in_comfyui_names_lands_on_a_comfyui_file_as_peft_names_do(tmp_path):
    """The table of a file in ComfyUI's names is ComfyUI's names: a LoRA on ``blocks.0.q`` there changes
    the output exactly as the same LoRA on diffusers' ``transformer_blocks.0.attn1.to_q``."""
    save_file({"model.diffusion_model." + k: v for k, v in comfyui_state_dict(build(TINY)).items()},
              str(tmp_path / "comfyui.safetensors"))
    g = torch.Generator().manual_seed(1)
    down, up = torch.randn(4, 64, generator=g), torch.randn(64, 4, generator=g)
    names = {"peft": "transformer.transformer_blocks.0.attn1.to_q", "comfyui": "diffusion_model.blocks.0.q"}
    outputs = {}
    for name, module in names.items():
        lora = tmp_path / f"lora-{name}.safetensors"
        save_file({f"{module}.lora_A.weight": down, f"{module}.lora_B.weight": up}, str(lora))
        model = registry.build(str(tmp_path / "comfyui.safetensors"), torch.device("cpu"),
                               loras=[LoraSpec(str(lora), 1.0)])
        assert (model.lora_reports[0]["merged_modules"], model.lora_reports[0]["unmatched_keys"]) == (1, 0)
        outputs[name] = forward(model, TINY)
    base = forward(registry.build(str(tmp_path / "comfyui.safetensors"), torch.device("cpu")), TINY)
    assert (outputs["peft"] - base).abs().max() > 1e-3
    assert torch.equal(outputs["comfyui"], outputs["peft"])


def full_config(name):
    return {**TINY, "attention_head_dim": 64, "text_embed_dim": 4096, "time_embed_dim": 512, **FULL[name]}


@pytest.mark.parametrize("layout", list(WRITERS))
@pytest.mark.parametrize("name", list(FULL))
def test_released_configs_are_read_off_renamed_shapes(layout, name):
    """Each released size (on meta), in diffusers' and ComfyUI's names: its config back, and its name."""
    config = full_config(name)
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in WRITERS[layout](CogVideoXTransformer3DModel(**config)).items()}
    assert cogvideox_checkpoint.config_from_shapes(shapes, "", "full.safetensors") == {**config, "_key_layout": layout}
    assert cogvideox_checkpoint.variant(config) == name


def renamed_shapes(layout="diffusers", **changes):
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in WRITERS[layout](CogVideoXTransformer3DModel(**TINY)).items()}
    return {**shapes, **changes}


@pytest.mark.parametrize("layout", list(WRITERS))
def test_detects_renamed_keys_bare_and_prefixed(layout):
    keys = set(renamed_shapes(layout))
    assert cogvideox_checkpoint.detect_prefix(keys) == ""
    assert cogvideox_checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."


@pytest.mark.parametrize("changes, words", [
    ({"patch_embed.proj.weight": [64, 48, 2, 2]}, "input channels 48"),
    ({"patch_embed.pos_embedding": [1, 17776, 64]}, "learned position embeddings"),  # 5b-I2V's table
], ids=["48-channels", "learned-positions"])
def test_renamed_image_to_video_is_refused_by_name(changes, words):
    with pytest.raises(UserError, match="i2v.safetensors: .*CogVideoX.* not supported") as info:
        cogvideox_checkpoint.config_from_shapes(renamed_shapes(**changes), "", "i2v.safetensors")
    assert words in info.value.message


def test_inconsistent_renamed_shapes_name_the_file_and_the_tensor():
    changes = {"blocks.0.attn_out.weight": [64, 32]}
    with pytest.raises(UserError, match="odd.safetensors.*blocks.0.attn_out.weight"):
        cogvideox_checkpoint.config_from_shapes(renamed_shapes("comfyui", **changes), "", "odd.safetensors")


def test_an_incomplete_renamed_file_is_named(tmp_path):
    original = diffusers_state_dict(build(TINY))
    del original["transformer_blocks.0.attn1.norm_q.weight"]
    path = tmp_path / "cut.safetensors"
    save_file(original, str(path))
    missing = "cogvideox tensor .*transformer_blocks.0.attn1.norm_q.weight.* is missing"
    with pytest.raises(registry.ModelError, match=missing):
        registry.resolve(str(path))
    original = diffusers_state_dict(build(TINY))
    del original["transformer_blocks.1.ff.net.2.bias"]
    save_file(original, str(path))
    with pytest.raises(registry.ModelError, match="could not read its weights"):
        registry.build(str(path), torch.device("cpu"))
