"""Wan 2.1 / 2.2 files in the original key layout (bare or in a checkpoint, fp8) load into diffusers'
WanTransformer3DModel at any width: text to video, and image to video (Wan 2.1 I2V and FLF2V with the CLIP image
embedder, Wan 2.2 I2V A14B without); foreign, damaged or other-variant files are named."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from safetensors.torch import save_file

from xdit_backend.errors import UserError
from xdit_backend.models import wan_checkpoint, registry
from xdit_backend.models.storage import StoredLinear

TINY = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 32, "in_channels": 16,
        "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
        "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}
TI2V_LIKE = {**TINY, "in_channels": 48, "out_channels": 48}
I2V_LIKE = {**TINY, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 64}  # Wan 2.1 I2V
FLF2V_LIKE = {**I2V_LIKE, "pos_embed_seq_len": 514}  # the first and last frame's CLIP tokens, each placed
I2V_A14B_LIKE = {**TINY, "in_channels": 36}  # Wan 2.2 I2V: the channels only, no image embedder
FUN_CONTROL_LIKE = {**I2V_LIKE, "in_channels": 48}  # Wan 2.1 Fun Control: the control video's and start image's
# The released sizes, from the Wan configs (dim, ffn_dim, num_heads, num_layers; TI2V's 48-channel VAE).
FULL = {
    "Wan2.1-T2V-1.3B": {"num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30},
    "Wan-14B (Wan2.1-T2V-14B or a Wan2.2-T2V-A14B expert)": {"num_attention_heads": 40, "ffn_dim": 13824,
                                                             "num_layers": 40},
    "Wan2.1-I2V-14B (480p or 720p)": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40,
                                      "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
    "Wan2.1-FLF2V-14B": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 36,
                         "image_dim": 1280, "added_kv_proj_dim": 5120, "pos_embed_seq_len": 514},
    "a Wan2.2-I2V-A14B expert": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 36},
    "Wan2.2-TI2V-5B": {"num_attention_heads": 24, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
                       "out_channels": 48},
    "Wan2.1-Fun-14B-Control": {"num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40, "in_channels": 48,
                               "image_dim": 1280, "added_kv_proj_dim": 5120},
}
FLUX_KEYS = {"img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers Wan → the original Wan key layout, written out here independently of the converter."""
    sd = transformer.state_dict()
    out = {}

    def linear(original, diffusers):
        out[f"{original}.weight"], out[f"{original}.bias"] = sd[f"{diffusers}.weight"], sd[f"{diffusers}.bias"]

    linear("patch_embedding", "patch_embedding")  # the same Conv3d kernel [D, C, 1, 2, 2]
    linear("text_embedding.0", "condition_embedder.text_embedder.linear_1")  # Sequential(Linear, GELU, Linear)
    linear("text_embedding.2", "condition_embedder.text_embedder.linear_2")
    linear("time_embedding.0", "condition_embedder.time_embedder.linear_1")  # Sequential(Linear, SiLU, Linear)
    linear("time_embedding.2", "condition_embedder.time_embedder.linear_2")
    linear("time_projection.1", "condition_embedder.time_proj")  # Sequential(SiLU, Linear)
    linear("head.head", "proj_out")
    out["head.modulation"] = sd["scale_shift_table"]  # [1, 2, D]: (shift, scale) in both
    for i in range(len(transformer.blocks)):
        o, d = f"blocks.{i}", f"blocks.{i}"
        for attn, ours in (("self_attn", "attn1"), ("cross_attn", "attn2")):
            linear(f"{o}.{attn}.q", f"{d}.{ours}.to_q")
            linear(f"{o}.{attn}.k", f"{d}.{ours}.to_k")
            linear(f"{o}.{attn}.v", f"{d}.{ours}.to_v")
            linear(f"{o}.{attn}.o", f"{d}.{ours}.to_out.0")
            out[f"{o}.{attn}.norm_q.weight"] = sd[f"{d}.{ours}.norm_q.weight"]
            out[f"{o}.{attn}.norm_k.weight"] = sd[f"{d}.{ours}.norm_k.weight"]
        linear(f"{o}.norm3", f"{d}.norm2")  # Wan's norm3 is the cross-attention norm; its norm2 (FFN) has no weights
        linear(f"{o}.ffn.0", f"{d}.ffn.net.0.proj")
        linear(f"{o}.ffn.2", f"{d}.ffn.net.2")
        out[f"{o}.modulation"] = sd[f"{d}.scale_shift_table"]  # [1, 6, D]: shift, scale, gate (attn, then FFN)
        if f"{d}.attn2.add_k_proj.weight" in sd:  # I2V: the image tokens' keys and values
            linear(f"{o}.cross_attn.k_img", f"{d}.attn2.add_k_proj")
            linear(f"{o}.cross_attn.v_img", f"{d}.attn2.add_v_proj")
            out[f"{o}.cross_attn.norm_k_img.weight"] = sd[f"{d}.attn2.norm_added_k.weight"]
    image = "condition_embedder.image_embedder"
    if f"{image}.norm1.weight" in sd:  # ComfyUI's MLPProj: Sequential(LayerNorm, Linear, GELU, Linear, LayerNorm)
        linear("img_emb.proj.0", f"{image}.norm1")
        linear("img_emb.proj.1", f"{image}.ff.net.0.proj")
        linear("img_emb.proj.3", f"{image}.ff.net.2")
        linear("img_emb.proj.4", f"{image}.norm2")
        if f"{image}.pos_embed" in sd:
            out["img_emb.emb_pos"] = sd[f"{image}.pos_embed"]  # [1, 514, 1280]
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def load(path, dtype=torch.float32):
    """Through the registry, as the backend loads it; RoPE's tables (never in a file) must be real."""
    source = registry.resolve(str(path))
    assert source.family == "wan"
    model = registry.build(str(path), torch.device("cpu"), dtype).transformer
    assert not model.rope.freqs_cos.is_meta
    model.set_attn_processor(WanAttnProcessor())  # diffusers' own, as the model built here has (not the wrapper's)
    return model, source.config


def forward(transformer, channels, text_dim, seed=0):
    """diffusers' own forward (and processors: its I2V cross-attention takes the image tokens to be all but the
    last 512 of the context, so an I2V model gets 512 text tokens, and 257 CLIP ones per image: FLF2V's two
    stacked in the batch, as diffusers takes them)."""
    g = torch.Generator().manual_seed(seed)
    image, images = transformer.config.image_dim, 2 if transformer.config.pos_embed_seq_len else 1
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, channels, 3, 8, 8, generator=g),
                           timestep=torch.tensor([700.0]),
                           encoder_hidden_states=torch.randn(1, 512 if image else 8, text_dim, generator=g),
                           encoder_hidden_states_image=(torch.randn(images, 257, image, generator=g)
                                                        if image else None), return_dict=False)[0]


@pytest.fixture(scope="module", params=[TINY, TI2V_LIKE, I2V_LIKE, FLF2V_LIKE, I2V_A14B_LIKE, FUN_CONTROL_LIKE],
                ids=["16-channel", "48-channel", "i2v", "flf2v", "i2v-a14b", "fun-control"])
def model(request):
    return request.param, build(request.param)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(model, tmp_path, prefix):
    """Every tensor equal, the same forward output, and the config and name read off the shapes."""
    config, built = model
    path = tmp_path / "wan.safetensors"
    save_file({prefix + k: v for k, v in original_state_dict(built).items()}, str(path))
    loaded, read_config = load(path)
    assert read_config == config
    kind = {20: " image to video", 32: " Fun Control"}.get(config["in_channels"] - config["out_channels"], "")
    assert wan_checkpoint.variant(read_config) == f"Wan{kind} architecture, width 64, 2 blocks"
    expected = built.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.state_dict()[key], value), key
    out = forward(loaded, config["in_channels"], config["text_dim"])
    assert out.shape == (1, config["out_channels"], 3, 8, 8)
    assert (out - forward(built, config["in_channels"], config["text_dim"])).abs().max() <= 1e-5


def test_conversion_matches_diffusers_own_converter(model, tmp_path):
    """Ground truth for the layout: diffusers' renaming converter gives the same tensors as ours."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    path = tmp_path / "wan.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in original_state_dict(model[1]).items()}, str(path))
    theirs = convert_wan_transformer_to_diffusers(load_file(str(path)))
    ours = load(path)[0].state_dict()
    if "img_emb.emb_pos" in theirs:  # diffusers' single-file converter leaves FLF2V's position table unrenamed
        theirs["condition_embedder.image_embedder.pos_embed"] = theirs.pop("img_emb.emb_pos")
    assert ours.keys() == theirs.keys()
    assert [key for key in theirs if not torch.equal(ours[key], theirs[key])] == []


@pytest.mark.parametrize("config", [TINY, I2V_LIKE, FLF2V_LIKE, FUN_CONTROL_LIKE, TI2V_LIKE],
                         ids=["t2v", "i2v", "flf2v", "fun-control", "ti2v"])
def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tmp_path, config):
    """A float8_e4m3fn file of each variant: the Linear weights stay float8 (models/storage.py), except under the
    float32 modules (the time embedder); everything else loads to float32; all equal the fp8-rounded weights."""
    built = build(config)
    path = tmp_path / "wan-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(built).items()}, str(path))
    loaded, _ = load(path)
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert "blocks.0.attn1.to_q.weight" in stored and "proj_out.weight" in stored
    assert not any("time_embedder" in key for key in stored)
    for key, value in built.state_dict().items():
        tensor, rounded = loaded.state_dict()[key], value.to(torch.float8_e4m3fn)
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), rounded.float()), key


@pytest.mark.parametrize("name", list(FULL))
def test_full_size_configs_and_names_are_read_off_the_shapes(name):
    """For each released size (built on meta): the shapes give its config back, and its name."""
    config = {**TINY, "attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, **FULL[name]}
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(WanTransformer3DModel(**config)).items()}
    assert wan_checkpoint.config_from_shapes(shapes, "", "full.safetensors") == config
    assert wan_checkpoint.variant(config) == name


def test_detects_wan_keys_only():
    """The prefix is found for Wan keys, and no prefix for Flux or unrelated keys."""
    with torch.device("meta"):
        keys = set(original_state_dict(WanTransformer3DModel(**TINY)))
    assert wan_checkpoint.detect_prefix(keys) == ""
    assert wan_checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."
    assert wan_checkpoint.detect_prefix({"diffusion_model." + k for k in keys}) == "diffusion_model."
    assert wan_checkpoint.detect_prefix(FLUX_KEYS) is None
    assert wan_checkpoint.detect_prefix({"model.diffusion_model." + k for k in FLUX_KEYS}) is None
    assert wan_checkpoint.detect_prefix({"encoder.conv_in.weight", "head.weight", "blocks.0.q.weight"}) is None


def tiny_shapes(**changes):
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(WanTransformer3DModel(**TINY)).items()}
    return {**shapes, **changes}


@pytest.mark.parametrize("changes, words", [
    ({"blocks.0.ffn.2.weight": [64, 100]}, "blocks.0.ffn.2.weight"),
    ({"head.head.weight": [63, 64]}, "head.head.weight"),
    ({"blocks.0.modulation": [1, 2, 64]}, "blocks.0.modulation"),
], ids=["ffn", "head", "modulation"])
def test_inconsistent_shapes_name_the_file(changes, words):
    """Shapes that fit no Wan raise a UserError naming the file and the unexpected tensor."""
    with pytest.raises(UserError) as info:
        wan_checkpoint.config_from_shapes(tiny_shapes(**changes), "", "/models/odd-wan.safetensors")
    assert "/models/odd-wan.safetensors" in info.value.message and words in info.value.message


def test_width_with_no_head_size_is_refused():
    """A width divisible neither by 128 nor by 32 has no head count: refused, naming the file."""
    with torch.device("meta"):  # 5 heads of 20
        model = WanTransformer3DModel(**{**TINY, "num_attention_heads": 5, "attention_head_dim": 20})
    shapes = {k: list(v.shape) for k, v in original_state_dict(model).items()}
    with pytest.raises(UserError, match="odd.safetensors.*width 100"):
        wan_checkpoint.config_from_shapes(shapes, "", "odd.safetensors")


@pytest.mark.parametrize("changes, words", [
    ({"patch_embedding.weight": [64, 52, 1, 2, 2]}, "52 input channels and 16 output channels"),  # Wan 2.2 Fun
    ({"img_emb.proj.0.weight": [1280], "patch_embedding.weight": [64, 36, 1, 2, 2]}, "do not go together"),
], ids=["wan22-fun-control", "embedder-without-image-keys"])
def test_other_image_inputs_are_refused_by_name(changes, words):
    """A variant whose extra channels are neither image to video's 20 nor Fun Control's 32 (Wan 2.2 Fun Control's 36),
    or an image embedder without its blocks' image keys, is refused naming the file."""
    with pytest.raises(UserError, match="i2v.safetensors") as info:
        wan_checkpoint.config_from_shapes(tiny_shapes(**changes), "", "i2v.safetensors")
    assert words in info.value.message


@pytest.mark.parametrize("changes, words", [
    ({"vace_blocks.0.after_proj.weight": [64, 64]}, "extra modules (vace_blocks)"),
], ids=["vace"])
def test_other_wan_variants_are_refused(changes, words):
    """Files with more than a plain Wan text-to-video model are refused, not silently half-loaded."""
    with pytest.raises(UserError, match="other.safetensors") as info:
        wan_checkpoint.config_from_shapes(tiny_shapes(**changes), "", "other.safetensors")
    assert words in info.value.message


def test_missing_tensor_and_unknown_key_raise_key_error():
    """A missing tensor in the file, or a diffusers key with no original, is a KeyError naming it."""
    shapes = tiny_shapes()
    del shapes["blocks.0.ffn.0.weight"]
    with pytest.raises(KeyError, match="blocks.0.ffn.0.weight"):
        wan_checkpoint.config_from_shapes(shapes, "", "cut.safetensors")
    with pytest.raises(KeyError, match="condition_embedder.refiner"):
        wan_checkpoint.sources(["condition_embedder.refiner.norm1.weight"], "", TINY)
