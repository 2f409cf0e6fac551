"""Z-Image files in the original key layout (Tongyi-MAI's / Comfy-Org's: ComfyUI's Lumina2 names,
bare or in a checkpoint, fp8) load into diffusers' ZImageTransformer2DModel at any width; the
config and the variant come from the shapes; incomplete and Omni files are named."""

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from safetensors.torch import save_file

from xdit_backend.models import registry, z_image_checkpoint
from xdit_backend.models.storage import StoredLinear

TINY = {"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 96, "n_layers": 2,
        "n_refiner_layers": 1, "n_heads": 6, "n_kv_heads": 6, "norm_eps": 1e-5, "qk_norm": True, "cap_feat_dim": 64,
        "rope_theta": 256.0, "t_scale": 1000.0, "axes_dims": [4, 6, 6], "axes_lens": [1536, 512, 512]}
# Z-Image-Turbo's transformer (Tongyi-MAI/Z-Image-Turbo; comfy/model_detection.py's Z-Image branch)
FULL = {**TINY, "dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30,
        "cap_feat_dim": 2560, "axes_dims": [32, 48, 48]}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers Z-Image → the original (ComfyUI NextDiT) key layout, written here from the original
    names (comfy/ldm/lumina/model.py), independently of the converter."""
    sd = transformer.state_dict()
    out = {name: sd[name] for name in ("x_pad_token", "cap_pad_token", "cap_embedder.0.weight", "cap_embedder.1.weight",
                                       "cap_embedder.1.bias", "t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias",
                                       "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias")}
    for param in ("weight", "bias"):
        out[f"x_embedder.{param}"] = sd[f"all_x_embedder.2-1.{param}"]
        out[f"final_layer.linear.{param}"] = sd[f"all_final_layer.2-1.linear.{param}"]
        out[f"final_layer.adaLN_modulation.1.{param}"] = sd[f"all_final_layer.2-1.adaLN_modulation.1.{param}"]
    for name in ("noise_refiner", "context_refiner", "layers"):
        for i in range(len(getattr(transformer, name))):
            block = f"{name}.{i}"
            out[f"{block}.attention.qkv.weight"] = torch.cat([sd[f"{block}.attention.to_{p}.weight"] for p in "qkv"])
            out[f"{block}.attention.out.weight"] = sd[f"{block}.attention.to_out.0.weight"]
            out[f"{block}.attention.q_norm.weight"] = sd[f"{block}.attention.norm_q.weight"]
            out[f"{block}.attention.k_norm.weight"] = sd[f"{block}.attention.norm_k.weight"]
            for part in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3", "attention_norm1", "attention_norm2",
                         "ffn_norm1", "ffn_norm2"):
                out[f"{block}.{part}.weight"] = sd[f"{block}.{part}.weight"]
            if name != "context_refiner":  # the caption refiner has no time modulation
                out[f"{block}.adaLN_modulation.0.weight"] = sd[f"{block}.adaLN_modulation.0.weight"]
                out[f"{block}.adaLN_modulation.0.bias"] = sd[f"{block}.adaLN_modulation.0.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ZImageTransformer2DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def save(tmp_path, tensors, name="z_image.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path))
    return str(path)


def velocity(model, seed=0):
    """The model wrapper's output (ComfyUI's call: σ, Qwen3 context) for a fixed latent and caption of 10 tokens."""
    g = torch.Generator().manual_seed(seed)
    x, context = torch.randn(1, 16, 8, 12, generator=g), torch.randn(1, 10, 64, generator=g)
    with torch.no_grad():
        return model.output(x, torch.tensor([0.6]), {"context": context}, None)


def wrapped(transformer):
    return registry.FAMILIES["z_image"].model(transformer, "built", registry.FAMILIES["z_image"].spec(TINY))


@pytest.fixture(scope="module")
def built():
    return build(TINY)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(built, tmp_path, prefix):
    """Every tensor equal, the same output, and the config and name read off the shapes."""
    path = save(tmp_path, {prefix + k: v for k, v in original_state_dict(built).items()})
    source = registry.resolve(path)
    assert (source.family, source.prefix, source.config) == ("z_image", prefix, TINY)
    assert source.describes == "Z-Image architecture, width 96, 2 blocks"
    loaded = registry.build(path, torch.device("cpu"))
    expected = built.state_dict()
    assert loaded.transformer.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    assert (velocity(loaded) - velocity(wrapped(built))).abs().max() <= 1e-5


def test_conversion_matches_diffusers_own_converter(built, tmp_path):
    """Ground truth for the layout: diffusers' single-file converter gives the same tensors as ours."""
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    original = {"model.diffusion_model." + k: v.clone() for k, v in original_state_dict(built).items()}
    path = save(tmp_path, original)
    theirs = convert_z_image_transformer_checkpoint_to_diffusers(original)
    ours = registry.build(path, torch.device("cpu")).transformer.state_dict()
    assert ours.keys() == theirs.keys()
    assert [key for key in theirs if not torch.equal(ours[key], theirs[key])] == []


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(built, tmp_path):
    """A float8_e4m3fn file: the Linear weights stay float8 (models/storage.py), the rest loads to
    float32, all equal to the fp8-rounded weights; and the model computes what diffusers' model
    with those rounded weights computes (the time embedding fed in the compute dtype, not in fp8)."""
    path = save(tmp_path, {k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(built).items()}, "fp8.safetensors")
    loaded = registry.build(path, torch.device("cpu"))
    assert loaded.storage_dtype == "float8_e4m3fn"
    transformer = loaded.transformer
    stored = {f"{name}.weight" for name, module in transformer.named_modules() if isinstance(module, StoredLinear)}
    assert {"layers.0.attention.to_q.weight", "t_embedder.mlp.0.weight", "all_final_layer.2-1.linear.weight"} <= stored
    rounded = build(TINY)
    rounded.load_state_dict({k: v.to(torch.float8_e4m3fn).float() for k, v in built.state_dict().items()})
    for key, value in rounded.state_dict().items():
        tensor = transformer.state_dict()[key]
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), value), key
    assert (velocity(loaded) - velocity(wrapped(rounded))).abs().max() <= 1e-5


def test_turbo_config_and_name_are_read_off_the_shapes():
    """Z-Image-Turbo's size (built on meta): the shapes give its config back, and its name."""
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(ZImageTransformer2DModel(**FULL)).items()}
    config = z_image_checkpoint.config_from_shapes(shapes, "", "z_image_turbo_bf16.safetensors")
    assert config == FULL
    assert z_image_checkpoint.variant(config) == "Z-Image (Turbo or Base: the same shapes)"
    assert registry.FAMILIES["z_image"].spec(config).heads == 30  # 4 does not divide it: Ulysses pads heads


def test_an_incomplete_file_is_named(built, tmp_path):
    tensors = original_state_dict(built)
    del tensors["layers.1.feed_forward.w2.weight"]
    with pytest.raises(registry.ModelError, match=r"incomplete Z-Image file \(1 tensors missing: "
                                                  r"layers\.1\.feed_forward\.w2\.weight") as error:
        registry.resolve(save(tmp_path, tensors))
    assert "re-download" in error.value.hint


def test_an_omni_file_is_refused(built, tmp_path):
    tensors = {**original_state_dict(built), "siglip_embedder.1.weight": torch.zeros(96, 32)}
    with pytest.raises(registry.ModelError, match="Z-Image-Omni"):
        registry.resolve(save(tmp_path, tensors))


def test_detects_z_image_keys_only(built):
    keys = set(original_state_dict(built))
    assert z_image_checkpoint.detect_prefix(keys) == ""
    assert z_image_checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."
    lumina2 = keys - {"x_pad_token", "cap_pad_token"}  # Lumina 2: the same names without the pad tokens
    assert z_image_checkpoint.detect_prefix(lumina2) is None
