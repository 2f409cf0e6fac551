"""HunyuanDiT 1.0–1.2 files in Tencent's original key layout (bare or in a checkpoint, fp8) load into
diffusers' HunyuanDiT2DModel; 1.0/1.1 are told from 1.2 by their shapes; with a ComfyUI checkout,
ComfyUI's own HunyuanDiT module writes the file and its forward is the reference for ours."""

import os
import sys

import pytest
import torch
from diffusers import HunyuanDiT2DModel
from safetensors.torch import save_file

from xdit_backend.errors import UserError
from xdit_backend.models import hunyuan_dit_checkpoint, registry
from xdit_backend.models.storage import StoredLinear

needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's HunyuanDiT")

V12 = {"num_attention_heads": 4, "attention_head_dim": 8, "in_channels": 4, "patch_size": 2,
       "activation_fn": "gelu-approximate", "sample_size": 128, "hidden_size": 32, "num_layers": 4,
       "mlp_ratio": (128 + 0.5) / 32, "learn_sigma": True, "cross_attention_dim": 24, "norm_type": "layer_norm",
       "cross_attention_dim_t5": 16, "pooled_projection_dim": 1024, "text_len": 6, "text_len_t5": 10,
       "use_style_cond_and_image_meta_size": False}
V11 = {**V12, "use_style_cond_and_image_meta_size": True}
# DiT-g/2, the released 1.0–1.2 size (Tencent's config; ComfyUI's model_detection: mlp_ratio 4.3637)
FULL = {**V12, "num_attention_heads": 16, "attention_head_dim": 88, "hidden_size": 1408, "num_layers": 40,
        "mlp_ratio": (6144 + 0.5) / 1408, "cross_attention_dim": 1024, "cross_attention_dim_t5": 2048,
        "text_len": 77, "text_len_t5": 256}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers HunyuanDiT → Tencent's key layout (comfy/ldm/hydit/models.py), written out here
    independently of the converter."""
    sd = transformer.state_dict()
    out = {}

    def copy(original, diffusers, params=("weight", "bias")):
        for param in params:
            out[f"{original}.{param}"] = sd[f"{diffusers}.{param}"]

    out["text_embedding_padding"] = sd["text_embedding_padding"]
    copy("mlp_t5.0", "text_embedder.linear_1")  # Sequential(Linear, SiLU, Linear)
    copy("mlp_t5.2", "text_embedder.linear_2")
    copy("x_embedder.proj", "pos_embed.proj")
    copy("t_embedder.mlp.0", "time_extra_emb.timestep_embedder.linear_1")
    copy("t_embedder.mlp.2", "time_extra_emb.timestep_embedder.linear_2")
    copy("extra_embedder.0", "time_extra_emb.extra_embedder.linear_1")
    copy("extra_embedder.2", "time_extra_emb.extra_embedder.linear_2")
    out["pooler.positional_embedding"] = sd["time_extra_emb.pooler.positional_embedding"]
    for proj in ("q_proj", "k_proj", "v_proj", "c_proj"):
        copy(f"pooler.{proj}", f"time_extra_emb.pooler.{proj}")
    if "time_extra_emb.style_embedder.weight" in sd:
        copy("style_embedder", "time_extra_emb.style_embedder", ("weight",))
    copy("final_layer.linear", "proj_out")
    for param in ("weight", "bias"):  # Tencent: (shift, scale); diffusers: (scale, shift)
        scale, shift = sd[f"norm_out.linear.{param}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{param}"] = torch.cat([shift, scale])
    for i, block in enumerate(transformer.blocks):
        o = d = f"blocks.{i}"
        copy(f"{o}.default_modulation.1", f"{d}.norm1.linear")
        copy(f"{o}.norm1", f"{d}.norm1.norm")
        for param in ("weight", "bias"):
            out[f"{o}.attn1.Wqkv.{param}"] = torch.cat([sd[f"{d}.attn1.to_{x}.{param}"] for x in "qkv"])
            out[f"{o}.attn2.kv_proj.{param}"] = torch.cat([sd[f"{d}.attn2.to_{x}.{param}"] for x in "kv"])
        for attn in ("attn1", "attn2"):
            copy(f"{o}.{attn}.q_norm", f"{d}.{attn}.norm_q")
            copy(f"{o}.{attn}.k_norm", f"{d}.{attn}.norm_k")
            copy(f"{o}.{attn}.out_proj", f"{d}.{attn}.to_out.0")
        copy(f"{o}.attn2.q_proj", f"{d}.attn2.to_q")
        copy(f"{o}.norm3", f"{d}.norm2")  # Tencent's norm3 comes before the cross-attention
        copy(f"{o}.norm2", f"{d}.norm3")  # and its norm2 before the MLP
        copy(f"{o}.mlp.fc1", f"{d}.ff.net.0.proj")
        copy(f"{o}.mlp.fc2", f"{d}.ff.net.2")
        if block.skip_linear is not None:
            copy(f"{o}.skip_norm", f"{d}.skip_norm")
            copy(f"{o}.skip_linear", f"{d}.skip_linear")
    return {k: v.contiguous() for k, v in out.items()}


def build(config, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HunyuanDiT2DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def conditioning(config, clip_tokens=None, mt5_tokens=None, seed=1):
    """Random CLIP and mT5 tokens, the last few of each marked padding."""
    g = torch.Generator().manual_seed(seed)
    clip_tokens, mt5_tokens = clip_tokens or config["text_len"], mt5_tokens or config["text_len_t5"]
    clip_mask, mt5_mask = torch.ones(2, clip_tokens), torch.ones(2, mt5_tokens)
    clip_mask[:, -2:], mt5_mask[1, -3:] = 0, 0
    return {"context": torch.randn(2, clip_tokens, config["cross_attention_dim"], generator=g),
            "context_mt5": torch.randn(2, mt5_tokens, config["cross_attention_dim_t5"], generator=g),
            "context_mask": clip_mask, "context_mt5_mask": mt5_mask}


def ours(path, cond, x, timestep, dtype=torch.float32):
    model = registry.build(str(path), torch.device("cpu"), dtype)
    with torch.no_grad():
        return model.output(x, timestep, cond, None)


@pytest.fixture(scope="module", params=[V12, V11], ids=["1.2", "1.0-1.1"])
def model(request):
    return request.param, build(request.param)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(model, tmp_path, prefix):
    """Every tensor equal, the same forward output, and the config and version read off the shapes."""
    config, built = model
    path = tmp_path / "hydit.safetensors"
    save_file({prefix + k: v for k, v in original_state_dict(built).items()}, str(path))
    source = registry.resolve(str(path))
    assert (source.family, source.prefix, source.config) == ("hunyuan_dit", prefix, config)
    version = "1.0 / 1.1" if config["use_style_cond_and_image_meta_size"] else "1.2"
    assert source.describes == f"HunyuanDiT {version} (architecture, width 32, 4 blocks)"
    loaded = registry.build(str(path), torch.device("cpu"))
    expected = built.state_dict()
    assert loaded.transformer.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    cond, x, t = conditioning(config), torch.randn(2, 4, 8, 12), torch.tensor([999.0, 321.0])
    with torch.no_grad():
        rope = loaded.transformer.rotary_table(8, 12)
        theirs = built(x, t, encoder_hidden_states=cond["context"], text_embedding_mask=cond["context_mask"],
                       encoder_hidden_states_t5=cond["context_mt5"], text_embedding_mask_t5=cond["context_mt5_mask"],
                       image_meta_size=torch.tensor([[64.0, 96.0, 64.0, 96.0, 0.0, 0.0]] * 2),
                       style=torch.zeros(2, dtype=torch.long), image_rotary_emb=rope, return_dict=False)[0]
        out = loaded.output(x, t, cond, None)
    assert (out - theirs[:, :4]).abs().max() <= 1e-5


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tmp_path):
    """A float8_e4m3fn file: the blocks' Linear weights stay float8 (models/storage.py); the rest loads
    to float32; all equal the fp8-rounded weights."""
    built = build(V12)
    path = tmp_path / "hydit-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(built).items()}, str(path))
    assert registry.resolve(str(path)).float8
    loaded = registry.build(str(path), torch.device("cpu")).transformer
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert {"blocks.0.attn1.to_q.weight", "blocks.3.attn2.to_v.weight", "proj_out.weight"} <= stored
    for key, value in built.state_dict().items():
        tensor, rounded = loaded.state_dict()[key], value.to(torch.float8_e4m3fn)
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), rounded.float()), key


@pytest.mark.parametrize("size_conditioning", [False, True], ids=["1.2", "1.0-1.1"])
def test_full_size_configs_and_versions_are_read_off_the_shapes(size_conditioning):
    """DiT-g/2 (built on meta), 1.2 and 1.0/1.1: the shapes give its config back, and its name."""
    config = {**FULL, "use_style_cond_and_image_meta_size": size_conditioning}
    with torch.device("meta"):
        built = HunyuanDiT2DModel(**config)
    shapes = {k: list(v.shape) for k, v in original_state_dict(built).items()}
    read = hunyuan_dit_checkpoint.config_from_shapes(shapes, "", "full.safetensors")
    assert read == config
    with torch.device("meta"):
        assert HunyuanDiT2DModel(**{**read, "num_layers": 2}).blocks[0].ff.net[0].proj.out_features == 6144
    version = "1.0 / 1.1" if size_conditioning else "1.2"
    assert hunyuan_dit_checkpoint.variant(read) == f"HunyuanDiT {version} (HunyuanDiT-g/2)"
    spec = registry.FAMILIES["hunyuan_dit"].spec(read)
    assert spec.model_sampling(None).linear_end == (0.03 if size_conditioning else 0.018)


def test_an_incomplete_file_is_named(tmp_path):
    """A file missing a block's fused attention is refused with the file and the tensor named."""
    original = original_state_dict(build(V12))
    del original["blocks.3.skip_linear.weight"]
    path = tmp_path / "broken.safetensors"
    save_file(original, str(path))
    with pytest.raises(UserError, match=r"broken.safetensors: its HunyuanDiT tensors .*skip_linear.weight': 'missing'"):
        registry.resolve(str(path))


def test_fewer_tokens_than_comfyui_pads_to_are_refused(model, tmp_path):
    config, built = model
    path = tmp_path / "hydit.safetensors"
    save_file(original_state_dict(built), str(path))
    cond = conditioning(config)
    cond["context_mt5"] = cond["context_mt5"][:, :4]
    with pytest.raises(UserError, match="context_mt5 has 4 tokens; HunyuanDiT takes at least 10"):
        ours(path, cond, torch.randn(2, 4, 8, 8), torch.tensor([500.0, 500.0]))


def comfy_hydit(config, seed=0):
    """ComfyUI's own HunYuanDiT (comfy/ldm/hydit/models.py) at the config's size, every parameter random."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ldm.hydit.models
    import comfy.ops

    size = config["use_style_cond_and_image_meta_size"]
    model = comfy.ldm.hydit.models.HunYuanDiT(
        patch_size=config["patch_size"], in_channels=config["in_channels"], hidden_size=config["hidden_size"],
        depth=config["num_layers"], num_heads=config["num_attention_heads"], mlp_ratio=config["mlp_ratio"],
        text_states_dim=config["cross_attention_dim"], text_states_dim_t5=config["cross_attention_dim_t5"],
        text_len=config["text_len"], text_len_t5=config["text_len_t5"], size_cond=size, use_style_cond=size,
        operations=comfy.ops.disable_weight_init)
    return filled_randomly(model, seed)


def filled_randomly(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``module`` with every parameter drawn from ``seed`` (ComfyUI's modules are built uninitialised)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=g))
    return module.eval()


@needs_comfyui
@pytest.mark.parametrize("config", [V12, V11], ids=["1.2", "1.0-1.1"])
@pytest.mark.parametrize("tokens", [(None, None), (9, 13)], ids=["padded-length", "longer-prompts"])
@pytest.mark.parametrize("latent", [(8, 12), (14, 8)], ids=["wide", "tall"])
def test_comfyui_writes_the_file_and_its_forward_is_ours(config, tokens, latent, tmp_path):
    """ComfyUI's HunYuanDiT state dict is the original layout; loaded here, our output equals ComfyUI's
    forward (its RoPE, text padding, pooler, size and style conditioning, final modulation order)."""
    theirs = comfy_hydit(config)
    path = tmp_path / "comfy-hydit.safetensors"
    save_file({"model.diffusion_model." + k: v.contiguous() for k, v in theirs.state_dict().items()}, str(path))
    cond = conditioning(config, *tokens)
    h, w = latent
    x, t = torch.randn(2, 4, h, w, generator=torch.Generator().manual_seed(3)), torch.tensor([999.0, 41.0])
    with torch.no_grad():
        reference = theirs(x, t, cond["context"].clone(), cond["context_mask"], cond["context_mt5"].clone(),
                           cond["context_mt5_mask"],
                           image_meta_size=torch.tensor([[h * 8.0, w * 8.0, h * 8.0, w * 8.0, 0.0, 0.0]] * 2))
    out = ours(path, cond, x, t)
    assert out.shape == reference.shape == (2, 4, h, w)
    assert (out - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max().item())


def test_rope_rows_of_a_wide_image_step_from_its_crop_as_comfyui_lays_them():
    """A 4 × 6 token grid fits the 32 × 32 base as rows 6..27 (ComfyUI's get_fill_resize_and_crop):
    row i sits at 6 + i·21/4, as np.linspace(6, 27, 4, endpoint=False) (diffusers' own table puts it at
    6 + i·(27·3/4 − 6)/3). The second half of each head's table rotates by the row, at frequency 1 first."""
    from xdit_backend.models.hunyuan_dit import RotaryTable

    cos, sin = RotaryTable(head_dim=8, patch=2)(8, 12)  # latent 8 × 12 → 4 × 6 tokens
    rows = torch.tensor([6.0, 11.25, 16.5, 21.75])
    assert torch.allclose(cos[::6, 4], rows.cos(), atol=1e-6) and torch.allclose(sin[::6, 4], rows.sin(), atol=1e-6)


@pytest.mark.parametrize("depth", [2, 6])
def test_configs_of_other_depths_are_read_off_the_shapes(depth):
    """A depth-2 file has no skip blocks (nothing after the middle one); depth 6 has two."""
    config = {**V12, "num_layers": depth}
    shapes = {k: list(v.shape) for k, v in original_state_dict(build(config)).items()}
    assert hunyuan_dit_checkpoint.config_from_shapes(shapes, "", "few-blocks.safetensors") == config
