"""Flux.2 files in the original (BFL / Comfy-Org) key layout (bare or in a checkpoint, fp8) load into
diffusers' Flux2Transformer2DModel at any width; dev and klein are told apart by their shapes; a
Flux.2 file is not taken for a Flux.1 one; an incomplete file is named."""

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from safetensors.torch import save_file

from xdit_backend.models import flux2, flux2_checkpoint, registry
from xdit_backend.models.storage import StoredLinear

DEV_LIKE = {"patch_size": 1, "in_channels": 128, "out_channels": 128, "num_layers": 2, "num_single_layers": 2,
            "attention_head_dim": 16, "num_attention_heads": 4, "joint_attention_dim": 48,
            "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": (4, 4, 4, 4), "rope_theta": 2000,
            "guidance_embeds": True}
KLEIN_LIKE = {**DEV_LIKE, "num_single_layers": 3, "joint_attention_dim": 32, "guidance_embeds": False}
# The released sizes (width = heads × 128, double + single blocks, the text features' width); the names
# depend on the guidance embedding and the width alone.
FULL = {
    "Flux.2-dev": {"num_attention_heads": 48, "num_layers": 8, "num_single_layers": 48,
                   "joint_attention_dim": 15360, "guidance_embeds": True},  # Mistral-Small: 3 × 5120
    "Flux.2-klein 4B": {"num_attention_heads": 24, "num_layers": 5, "num_single_layers": 20,
                        "joint_attention_dim": 7680, "guidance_embeds": False},  # Qwen3-4B: 3 × 2560
    "Flux.2-klein 9B": {"num_attention_heads": 32, "num_layers": 8, "num_single_layers": 24,
                        "joint_attention_dim": 12288, "guidance_embeds": False},  # Qwen3-8B: 3 × 4096
}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers Flux.2 → BFL's key layout, written out here from BFL's names, independently of the converter."""
    sd = transformer.state_dict()
    out = {"img_in.weight": sd["x_embedder.weight"], "txt_in.weight": sd["context_embedder.weight"],
           "final_layer.linear.weight": sd["proj_out.weight"]}
    for bfl, ours in (("time_in", "timestep_embedder"), ("guidance_in", "guidance_embedder")):
        if f"time_guidance_embed.{ours}.linear_1.weight" in sd:
            out[f"{bfl}.in_layer.weight"] = sd[f"time_guidance_embed.{ours}.linear_1.weight"]
            out[f"{bfl}.out_layer.weight"] = sd[f"time_guidance_embed.{ours}.linear_2.weight"]
    for name in ("double_stream_modulation_img", "double_stream_modulation_txt", "single_stream_modulation"):
        out[f"{name}.lin.weight"] = sd[f"{name}.linear.weight"]
    scale, shift = sd["norm_out.linear.weight"].chunk(2)  # diffusers (scale, shift); BFL (shift, scale)
    out["final_layer.adaLN_modulation.1.weight"] = torch.cat([shift, scale])
    streams = {"img": ("to_q", "to_k", "to_v", "norm_q", "norm_k", "to_out.0", "ff"),
               "txt": ("add_q_proj", "add_k_proj", "add_v_proj", "norm_added_q", "norm_added_k", "to_add_out",
                       "ff_context")}
    for i in range(len(transformer.transformer_blocks)):
        d = f"transformer_blocks.{i}"
        for stream, (q, k, v, norm_q, norm_k, proj, ff) in streams.items():
            o = f"double_blocks.{i}.{stream}"
            out[f"{o}_attn.qkv.weight"] = torch.cat([sd[f"{d}.attn.{p}.weight"] for p in (q, k, v)])
            out[f"{o}_attn.norm.query_norm.scale"] = sd[f"{d}.attn.{norm_q}.weight"]
            out[f"{o}_attn.norm.key_norm.scale"] = sd[f"{d}.attn.{norm_k}.weight"]
            out[f"{o}_attn.proj.weight"] = sd[f"{d}.attn.{proj}.weight"]
            out[f"{o}_mlp.0.weight"] = sd[f"{d}.{ff}.linear_in.weight"]  # [gate; up] of the SwiGLU, as BFL's
            out[f"{o}_mlp.2.weight"] = sd[f"{d}.{ff}.linear_out.weight"]
    for i in range(len(transformer.single_transformer_blocks)):
        d, o = f"single_transformer_blocks.{i}.attn", f"single_blocks.{i}"
        out[f"{o}.linear1.weight"] = sd[f"{d}.to_qkv_mlp_proj.weight"]  # [q; k; v; gate; up]
        out[f"{o}.linear2.weight"] = sd[f"{d}.to_out.weight"]  # [attention; MLP] in
        out[f"{o}.norm.query_norm.scale"] = sd[f"{d}.norm_q.weight"]
        out[f"{o}.norm.key_norm.scale"] = sd[f"{d}.norm_k.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Flux2Transformer2DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def load(path, dtype=torch.float32):
    source = registry.resolve(str(path))
    assert source.family == "flux2"
    return registry.build(str(path), torch.device("cpu"), dtype).transformer, source.config


def forward(transformer, config, seed=0):
    g = torch.Generator().manual_seed(seed)
    guidance = torch.tensor([3.5]) if config["guidance_embeds"] else None
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 12, 128, generator=g),
                           encoder_hidden_states=torch.randn(1, 8, config["joint_attention_dim"], generator=g),
                           timestep=torch.tensor([0.7]), img_ids=flux2.image_ids(3, 4), txt_ids=flux2.text_ids(8),
                           guidance=guidance, return_dict=False)[0]


@pytest.fixture(scope="module", params=[DEV_LIKE, KLEIN_LIKE], ids=["dev-like", "klein-like"])
def model(request):
    return request.param, build(request.param)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(model, tmp_path, prefix):
    """Every tensor equal, the same forward output, and the config and name read off the shapes."""
    config, built = model
    path = tmp_path / "flux2.safetensors"
    save_file({prefix + k: v for k, v in original_state_dict(built).items()}, str(path))
    loaded, read_config = load(path)
    assert read_config == config
    kind = "dev" if config["guidance_embeds"] else "klein"
    blocks = f"{config['num_layers']}+{config['num_single_layers']} blocks"
    assert flux2_checkpoint.variant(read_config) == f"Flux.2-{kind} architecture, width 64, {blocks}"
    expected = built.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.state_dict()[key], value), key
    out = forward(loaded, config)
    assert out.shape == (1, 12, 128)
    assert (out - forward(built, config)).abs().max() <= 1e-5


def test_conversion_matches_diffusers_own_converter(model, tmp_path):
    """Ground truth for the layout: diffusers' renaming converter gives the same tensors as our table."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    path = tmp_path / "flux2.safetensors"
    save_file(original_state_dict(model[1]), str(path))
    theirs = convert_flux2_transformer_checkpoint_to_diffusers(load_file(str(path)))
    ours = load(path)[0].state_dict()
    assert ours.keys() == theirs.keys()
    assert [key for key in theirs if not torch.equal(ours[key], theirs[key])] == []


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tmp_path):
    """A float8_e4m3fn file: the Linear weights stay float8 (models/storage.py); the norms load to
    float32; every tensor equals the fp8-rounded weight; the forward runs."""
    built = build(DEV_LIKE)
    path = tmp_path / "flux2-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(built).items()}, str(path))
    loaded, _ = load(path)
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert {"transformer_blocks.0.attn.to_q.weight", "single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight",
            "proj_out.weight"} <= stored
    for key, value in built.state_dict().items():
        tensor, rounded = loaded.state_dict()[key], value.to(torch.float8_e4m3fn)
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), rounded.float()), key
    assert torch.isfinite(forward(loaded, DEV_LIKE)).all()


def test_a_comfyui_scaled_fp8_file_matches_the_dequantised_model(tmp_path):
    """ComfyUI's scaled fp8 with a scale per output row: the fused qkv's scales go with their thirds,
    every Linear stays fp8 with its scale, and the forward is the dequantised model's."""
    from backend.test_storage import comfy_scaled_file

    path = tmp_path / "flux2-scaled.safetensors"
    reference = comfy_scaled_file(original_state_dict(build(DEV_LIKE)), path, per_row=True)
    save_file(reference, str(tmp_path / "dequantised.safetensors"))
    expected, _ = load(tmp_path / "dequantised.safetensors")
    loaded, _ = load(path)
    stored = {name: module for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert "transformer_blocks.0.attn.to_k" in stored and "single_transformer_blocks.0.attn.to_out" in stored
    for name, module in stored.items():
        assert torch.equal(module.upcast(torch.float32), expected.get_submodule(name).weight), name
    assert (forward(loaded, DEV_LIKE) - forward(expected, DEV_LIKE)).abs().max() <= 1e-5


@pytest.mark.parametrize("name", list(FULL))
def test_full_size_configs_and_names_are_read_off_the_shapes(name):
    """For each released size (built on meta): the shapes give its config back, and its name."""
    config = {**DEV_LIKE, "attention_head_dim": 128, "axes_dims_rope": (32, 32, 32, 32), **FULL[name]}
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(Flux2Transformer2DModel(**config)).items()}
    assert flux2_checkpoint.config_from_shapes(shapes, "", "full.safetensors") == config
    assert flux2_checkpoint.variant(config) == name


def test_a_flux2_file_is_not_taken_for_flux1():
    """Flux.2's keys include every key that marks Flux.1; detection finds Flux.2 first, and Flux.1 keys are not Flux.2."""
    with torch.device("meta"):
        keys = set(original_state_dict(Flux2Transformer2DModel(**DEV_LIKE)))
    assert flux2_checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."
    assert list(registry.FAMILIES).index("flux2") < list(registry.FAMILIES).index("flux")
    flux1 = {"img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"}
    assert flux2_checkpoint.detect_prefix(flux1) is None


@pytest.mark.parametrize("missing", ["txt_in.weight", "double_blocks.1.img_mlp.2.weight"])
def test_an_incomplete_file_is_named(tmp_path, missing):
    """A tensor missing from the file: a ModelError naming the file, not a crash in diffusers."""
    tensors = original_state_dict(build(DEV_LIKE))
    del tensors[missing]
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(registry.ModelError, match="cut.safetensors"):
        registry.build(str(path), torch.device("cpu"))
