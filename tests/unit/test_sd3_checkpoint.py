"""SD3 / SD3.5 files in the original Stability / ComfyUI layout (bare or in a checkpoint, fp8) load
into diffusers' SD3Transformer2DModel; every variant's config is read off the shapes alone."""

import pytest
import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file, save_file

from xdit_backend.errors import UserError
from xdit_backend.models import checkpoint, registry, sd3_checkpoint
from xdit_backend.models.storage import StoredLinear

TINY = {"sample_size": 32, "patch_size": 2, "in_channels": 16, "num_layers": 2, "attention_head_dim": 64,
        "num_attention_heads": 2, "joint_attention_dim": 32, "caption_projection_dim": 128,
        "pooled_projection_dim": 32, "out_channels": 16, "pos_embed_max_size": 32, "dual_attention_layers": (),
        "qk_norm": None}
TINY_35 = {**TINY, "num_layers": 3, "dual_attention_layers": (0,), "qk_norm": "rms_norm"}
# The published architectures (Stability's model cards; diffusers' single-file detection: SD3 medium's
# context modulation is 9216 = 6 × 1536 wide, pos_embed holds 192² or 384² positions, SD3.5 large has
# joint_blocks.37).
TEXT = {"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "attention_head_dim": 64,
        "joint_attention_dim": 4096, "pooled_projection_dim": 2048}
FULL = {
    "SD3-medium": {**TEXT, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                   "pos_embed_max_size": 192, "dual_attention_layers": (), "qk_norm": None},
    "SD3.5-medium": {**TEXT, "num_layers": 24, "num_attention_heads": 24, "caption_projection_dim": 1536,
                     "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"},
    "SD3.5-large": {**TEXT, "num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                    "pos_embed_max_size": 192, "dual_attention_layers": (), "qk_norm": "rms_norm"},
}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers SD3 → the original Stability key layout, written out here independently of the loader."""
    sd = transformer.state_dict()
    out = {"pos_embed": sd["pos_embed.pos_embed"]}

    def linear(original, diffusers):
        out[f"{original}.weight"], out[f"{original}.bias"] = sd[f"{diffusers}.weight"], sd[f"{diffusers}.bias"]

    def shift_scale(original, diffusers):  # diffusers' AdaLayerNormContinuous is (scale, shift)
        for suffix in ("weight", "bias"):
            scale, shift = sd[f"{diffusers}.{suffix}"].chunk(2)
            out[f"{original}.{suffix}"] = torch.cat([shift, scale])

    for original, dif in [("x_embedder.proj", "pos_embed.proj"), ("context_embedder", "context_embedder"),
                          ("t_embedder.mlp.0", "time_text_embed.timestep_embedder.linear_1"),
                          ("t_embedder.mlp.2", "time_text_embed.timestep_embedder.linear_2"),
                          ("y_embedder.mlp.0", "time_text_embed.text_embedder.linear_1"),
                          ("y_embedder.mlp.2", "time_text_embed.text_embedder.linear_2"),
                          ("final_layer.linear", "proj_out")]:
        linear(original, dif)
    shift_scale("final_layer.adaLN_modulation.1", "norm_out.linear")
    last = len(transformer.transformer_blocks) - 1
    for i in range(last + 1):
        d, o = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        linear(f"{o}.x_block.adaLN_modulation.1", f"{d}.norm1.linear")
        if i == last:  # pre-only context block: (shift, scale) for attention, nothing after it
            shift_scale(f"{o}.context_block.adaLN_modulation.1", f"{d}.norm1_context.linear")
        else:
            linear(f"{o}.context_block.adaLN_modulation.1", f"{d}.norm1_context.linear")
        attentions = [("x_block.attn", "attn", ("to_q", "to_k", "to_v"), "norm_q", "norm_k", "to_out.0"),
                      ("context_block.attn", "attn", ("add_q_proj", "add_k_proj", "add_v_proj"),
                       "norm_added_q", "norm_added_k", "to_add_out")]
        if f"{d}.attn2.to_q.weight" in sd:
            attentions.append(("x_block.attn2", "attn2", ("to_q", "to_k", "to_v"), "norm_q", "norm_k", "to_out.0"))
        for original, attn, qkv, norm_q, norm_k, proj in attentions:
            for suffix in ("weight", "bias"):
                out[f"{o}.{original}.qkv.{suffix}"] = torch.cat([sd[f"{d}.{attn}.{n}.{suffix}"] for n in qkv])
            if f"{d}.{attn}.{proj}.weight" in sd:
                linear(f"{o}.{original}.proj", f"{d}.{attn}.{proj}")
            if f"{d}.{attn}.{norm_q}.weight" in sd:
                out[f"{o}.{original}.ln_q.weight"] = sd[f"{d}.{attn}.{norm_q}.weight"]
                out[f"{o}.{original}.ln_k.weight"] = sd[f"{d}.{attn}.{norm_k}.weight"]
        for stream, ff in (("x_block", "ff"), ("context_block", "ff_context")):
            if f"{d}.{ff}.net.0.proj.weight" in sd:
                linear(f"{o}.{stream}.mlp.fc1", f"{d}.{ff}.net.0.proj")
                linear(f"{o}.{stream}.mlp.fc2", f"{d}.{ff}.net.2")
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed):
    """A seeded model whose every tensor (norm scales and the position table included) is random."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SD3Transformer2DModel(**config)
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.copy_(torch.randn_like(tensor) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=[TINY, TINY_35], ids=["sd3", "sd3.5"])
def tiny(request):
    return request.param, build(request.param, seed=0)


def load(path, dtype=torch.float32):
    """Through the registry, as the backend loads it: detected, config off the shapes, a strict load."""
    source = registry.resolve(str(path))
    assert source.family == "sd3"
    return source.config, registry.build(str(path), torch.device("cpu"), dtype).transformer


def forward(transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 16, 16, 16, generator=g),
                           encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
                           pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([500.0]),
                           return_dict=False)[0]


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(tiny, tmp_path, prefix):
    """Bare and checkpoint-prefixed files give every tensor and the same output as the built model."""
    config, model = tiny
    path = tmp_path / "sd3.safetensors"
    save_file({prefix + k: v for k, v in original_state_dict(model).items()}, str(path))
    loaded_config, loaded = load(path)
    assert loaded_config == config
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert [key for key, value in loaded.state_dict().items() if not torch.equal(value, expected[key])] == []
    assert (forward(loaded) - forward(model)).abs().max() <= 1e-5


def test_conversion_matches_diffusers_own_converter(tiny, tmp_path):
    """Ground truth for the layout (qkv bands, every modulation's order): diffusers' converter agrees."""
    from diffusers.loaders import single_file_utils

    _, model = tiny
    path = tmp_path / "sd3.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in original_state_dict(model).items()}, str(path))
    expected = single_file_utils.convert_sd3_transformer_checkpoint_to_diffusers(load_file(str(path)))
    ours = load(path)[1].state_dict()
    assert ours.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(ours[key], expected[key])] == []


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tiny, tmp_path):
    """A float8_e4m3fn file: Linear weights stay float8 (models/storage.py), the rest loads as
    float32; all equal to the fp8-rounded weights."""
    _, model = tiny
    path = tmp_path / "sd3-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(model).items()}, str(path))
    loaded = load(path)[1]
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert "transformer_blocks.0.attn.to_q.weight" in stored
    rounded = {k: v.to(torch.float8_e4m3fn).float() for k, v in model.state_dict().items()}
    assert [key for key, value in loaded.state_dict().items()
            if value.dtype != (torch.float8_e4m3fn if key in stored else torch.float32)] == []
    assert [key for key, value in loaded.state_dict().items() if not torch.equal(value.float(), rounded[key])] == []


@pytest.mark.parametrize("name", list(FULL))
def test_full_size_variants_are_read_off_shapes_alone(name):
    """Each published variant's config and name come from its tensor shapes; no weights needed."""
    config = FULL[name]
    with torch.device("meta"):
        model = SD3Transformer2DModel(**config)
    shapes = {key: list(tensor.shape) for key, tensor in original_state_dict(model).items()}
    assert shapes["pos_embed"][1] == config["pos_embed_max_size"] ** 2
    read = sd3_checkpoint.config_from_shapes(shapes, "", f"{name}.safetensors")
    assert read == config
    assert sd3_checkpoint.variant(read) == name
    targets = model.state_dict()
    for key, source in sd3_checkpoint.sources(targets.keys(), "", read).items():
        rows = shapes[source.key][0] if source.rows is None else source.rows[1] - source.rows[0]
        assert [rows, *shapes[source.key][1:]] == list(targets[key].shape), key


def test_tiny_variants_are_named_by_architecture(tiny):
    """A model of no published size is named by its family, width and depth."""
    config, model = tiny
    shapes = {key: list(v.shape) for key, v in original_state_dict(model).items()}
    name = sd3_checkpoint.variant(sd3_checkpoint.config_from_shapes(shapes, "", "tiny.safetensors"))
    family = "SD3.5" if config["qk_norm"] else "SD3"
    assert name == f"{family} architecture, width 128, {config['num_layers']} blocks"


def test_prefix_is_detected_and_other_layouts_are_not(tiny):
    """The prefix comes back for SD3 files; Flux, PixArt, Wan and random key sets give None."""
    keys = list(original_state_dict(tiny[1]))
    for prefix in checkpoint.PREFIXES:
        assert sd3_checkpoint.detect_prefix([prefix + k for k in keys]) == prefix
    flux = {"img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"}
    pixart = {"x_embedder.proj.weight", "blocks.0.attn.qkv.weight", "t_block.1.weight", "pos_embed"}
    wan = {"patch_embedding.weight", "blocks.0.self_attn.q.weight", "head.head.weight"}
    for foreign in (flux, {"model.diffusion_model." + k for k in flux}, pixart, wan, {"a", "b.c", "joint_blocks"}):
        assert sd3_checkpoint.detect_prefix(foreign) is None


def test_inconsistent_shapes_are_named_with_the_file(tiny):
    """A qkv that is not 3 × width raises a UserError naming the file and the tensor."""
    shapes = {key: list(v.shape) for key, v in original_state_dict(tiny[1]).items()}
    shapes["joint_blocks.1.x_block.attn.qkv.weight"] = [100, 128]
    with pytest.raises(UserError) as info:
        sd3_checkpoint.config_from_shapes(shapes, "", "/models/odd.safetensors")
    assert "/models/odd.safetensors" in info.value.message
    assert "joint_blocks.1.x_block.attn.qkv.weight" in info.value.message and "[100, 128]" in info.value.message


def test_missing_tensor_is_a_key_error(tiny):
    """A tensor the config needs that the file lacks surfaces as KeyError naming it."""
    shapes = {key: list(v.shape) for key, v in original_state_dict(tiny[1]).items()}
    del shapes["y_embedder.mlp.0.weight"]
    with pytest.raises(KeyError, match="y_embedder.mlp.0.weight"):
        sd3_checkpoint.config_from_shapes(shapes, "", "cut.safetensors")


def test_unknown_diffusers_key_is_a_key_error():
    """sources() refuses a diffusers key it has no original for."""
    with pytest.raises(KeyError, match="transformer_blocks.0.attn.mystery.weight"):
        sd3_checkpoint.sources(["transformer_blocks.0.attn.mystery.weight"], "", TINY)
