"""HunyuanVideo 1.5 files in Tencent's original key layout (bare or in a checkpoint, fp8) load into
diffusers' HunyuanVideo15Transformer3DModel at any width; the other HunyuanVideo 1.5 files (MeanFlow,
super-resolution) and incomplete files are named."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from safetensors.torch import save_file

from xdit_backend.errors import UserError
from xdit_backend.models import hunyuan_video15_checkpoint as checkpoint, registry
from xdit_backend.models.storage import StoredLinear

TINY = {"in_channels": 65, "out_channels": 32, "num_attention_heads": 2, "attention_head_dim": 32, "num_layers": 2,
        "num_refiner_layers": 2, "mlp_ratio": 2.0, "patch_size": 1, "patch_size_t": 1, "qk_norm": "rms_norm",
        "text_embed_dim": 48, "text_embed_2_dim": 24, "image_embed_dim": 16, "rope_theta": 256.0,
        "rope_axes_dim": (4, 14, 14)}
# tencent/HunyuanVideo-1.5 480p_t2v, 480p_i2v, 720p_t2v, 720p_i2v: one architecture (diffusers'
# scripts/convert_hunyuan_video1_5_to_diffusers.py TRANSFORMER_CONFIGS, without target_size / task_type,
# which its forward never reads)
FULL = {**TINY, "num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 54, "mlp_ratio": 4.0,
        "text_embed_dim": 3584, "text_embed_2_dim": 1472, "image_embed_dim": 1152, "rope_axes_dim": (16, 56, 56)}
HYV1_KEYS = {"img_in.proj.weight", "txt_in.input_embedder.weight", "double_blocks.0.img_attn_qkv.weight"}
FLUX_KEYS = {"img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"}


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers → Tencent's key layout, written out here from the original names (the module names
    of Tencent's hyvideo transformer), independently of the converter."""
    sd = transformer.state_dict()
    out = {}

    def param(original, diffusers, names=("weight", "bias")):
        for name in names:
            out[f"{original}.{name}"] = sd[f"{diffusers}.{name}"]

    param("img_in.proj", "x_embedder.proj")  # Conv3d [D, 65, 1, 1, 1]
    param("time_in.mlp.0", "time_embed.timestep_embedder.linear_1")  # Sequential(Linear, SiLU, Linear)
    param("time_in.mlp.2", "time_embed.timestep_embedder.linear_2")
    txt = "context_embedder"
    param("txt_in.input_embedder", f"{txt}.proj_in")
    param("txt_in.t_embedder.mlp.0", f"{txt}.time_text_embed.timestep_embedder.linear_1")
    param("txt_in.t_embedder.mlp.2", f"{txt}.time_text_embed.timestep_embedder.linear_2")
    param("txt_in.c_embedder.linear_1", f"{txt}.time_text_embed.text_embedder.linear_1")
    param("txt_in.c_embedder.linear_2", f"{txt}.time_text_embed.text_embedder.linear_2")
    for i in range(len(transformer.context_embedder.token_refiner.refiner_blocks)):
        o, d = f"txt_in.individual_token_refiner.blocks.{i}", f"{txt}.token_refiner.refiner_blocks.{i}"
        for name in ("norm1", "norm2"):
            param(f"{o}.{name}", f"{d}.{name}")
        for name in ("weight", "bias"):  # one fused qkv Linear, q rows first
            out[f"{o}.self_attn_qkv.{name}"] = torch.cat([sd[f"{d}.attn.to_{x}.{name}"] for x in "qkv"])
        param(f"{o}.self_attn_proj", f"{d}.attn.to_out.0")
        param(f"{o}.mlp.fc1", f"{d}.ff.net.0.proj")
        param(f"{o}.mlp.fc2", f"{d}.ff.net.2")
        param(f"{o}.adaLN_modulation.1", f"{d}.norm_out.linear")  # Sequential(SiLU, Linear)
    for original, ours in (("layernorm", "norm"), ("fc1", "linear_1"), ("fc2", "linear_2"), ("fc3", "linear_3")):
        param(f"byt5_in.{original}", f"context_embedder_2.{ours}")
    for index, ours in ((0, "norm_in"), (1, "linear_1"), (3, "linear_2"), (4, "norm_out")):  # 2: GELU
        param(f"vision_in.proj.{index}", f"image_embedder.{ours}")
    out["cond_type_embedding.weight"] = sd["cond_type_embed.weight"]
    for i in range(len(transformer.transformer_blocks)):
        o, d = f"double_blocks.{i}", f"transformer_blocks.{i}"
        param(f"{o}.img_mod.linear", f"{d}.norm1.linear")  # (shift, scale, gate) × 2 in both
        param(f"{o}.txt_mod.linear", f"{d}.norm1_context.linear")
        for x in "qkv":
            param(f"{o}.img_attn_{x}", f"{d}.attn.to_{x}")
            param(f"{o}.txt_attn_{x}", f"{d}.attn.add_{x}_proj")
        param(f"{o}.img_attn_q_norm", f"{d}.attn.norm_q", ("weight",))
        param(f"{o}.img_attn_k_norm", f"{d}.attn.norm_k", ("weight",))
        param(f"{o}.txt_attn_q_norm", f"{d}.attn.norm_added_q", ("weight",))
        param(f"{o}.txt_attn_k_norm", f"{d}.attn.norm_added_k", ("weight",))
        param(f"{o}.img_attn_proj", f"{d}.attn.to_out.0")
        param(f"{o}.txt_attn_proj", f"{d}.attn.to_add_out")
        param(f"{o}.img_mlp.fc1", f"{d}.ff.net.0.proj")
        param(f"{o}.img_mlp.fc2", f"{d}.ff.net.2")
        param(f"{o}.txt_mlp.fc1", f"{d}.ff_context.net.0.proj")
        param(f"{o}.txt_mlp.fc2", f"{d}.ff_context.net.2")
    for name in ("weight", "bias"):  # the final modulation: original (shift, scale), diffusers (scale, shift)
        scale, shift = sd[f"norm_out.linear.{name}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{name}"] = torch.cat([shift, scale])
    param("final_layer.linear", "proj_out")
    return {k: v.contiguous() for k, v in out.items()}


def build(config=TINY, seed=0):
    """A seeded model whose every parameter is random (so no two tensors can be swapped unnoticed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = HunyuanVideo15Transformer3DModel(**config)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def conditioning(config, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"context": torch.randn(1, 8, config["text_embed_dim"], generator=g),
            "context_byt5": torch.randn(1, 4, config["text_embed_2_dim"], generator=g)}


def diffusers_forward(transformer, x, cond):
    """diffusers' own forward and processor, fed as its text-to-video pipeline feeds it (zero image
    latent, mask and SigLIP tokens)."""
    for block in transformer.transformer_blocks:
        block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    b = x.shape[0]
    with torch.no_grad():
        return transformer(hidden_states=torch.cat([x, torch.zeros(b, 33, *x.shape[2:])], dim=1),
                           timestep=torch.tensor([700.0]), encoder_hidden_states=cond["context"],
                           encoder_attention_mask=torch.ones(b, 8), encoder_hidden_states_2=cond["context_byt5"],
                           encoder_attention_mask_2=torch.ones(b, 4),
                           image_embeds=torch.zeros(b, 9, TINY["image_embed_dim"]), return_dict=False)[0]


@pytest.fixture(scope="module")
def built():
    return build()


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_original_file_loads_as_the_same_model(built, tmp_path, prefix):
    """Every tensor equal, the config and name read off the shapes, and the backend's forward equals
    diffusers' own on the original model."""
    path = tmp_path / "hunyuanvideo1.5_t2v.safetensors"
    save_file({prefix + k: v for k, v in original_state_dict(built).items()}, str(path))
    source = registry.resolve(str(path))
    assert (source.family, source.prefix, source.config) == ("hunyuan_video15", prefix, TINY)
    assert source.describes == "HunyuanVideo 1.5 architecture, width 64, 2 blocks"
    model = registry.build(str(path), torch.device("cpu"))
    expected = built.state_dict()
    assert model.transformer.state_dict().keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(model.transformer.state_dict()[key], value), key
    x = torch.randn(1, 32, 2, 4, 6, generator=torch.Generator().manual_seed(3))
    cond = conditioning(TINY)
    with torch.no_grad():
        ours = model.output(x, torch.tensor([700.0]), cond, None)
    assert ours.shape == (1, 32, 2, 4, 6)
    assert (ours - diffusers_forward(built, x, cond)).abs().max() <= 1e-5


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(built, tmp_path):
    """A float8_e4m3fn file: the Linear weights stay float8 (models/storage.py) except where diffusers
    keeps a module in full precision; everything equals the fp8-rounded weights."""
    path = tmp_path / "hunyuanvideo1.5_fp8_e4m3fn.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in original_state_dict(built).items()}, str(path))
    assert registry.resolve(str(path)).float8
    loaded = registry.build(str(path), torch.device("cpu")).transformer
    stored = {f"{name}.weight" for name, module in loaded.named_modules() if isinstance(module, StoredLinear)}
    assert "transformer_blocks.0.attn.to_q.weight" in stored and "proj_out.weight" in stored
    for key, value in built.state_dict().items():
        tensor = loaded.state_dict()[key]
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), value.to(torch.float8_e4m3fn).float()), key


def test_full_size_config_and_name_are_read_off_the_shapes():
    """The released 8.3 B model (built on meta): its shapes give its config back; 480p and 720p,
    text and image to video, share these shapes, and the name says so."""
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(HunyuanVideo15Transformer3DModel(**FULL)).items()}
    config = checkpoint.config_from_shapes(shapes, "", "full.safetensors")
    assert config == FULL
    assert checkpoint.variant(config) == ("HunyuanVideo 1.5 (8.3 B; 480p and 720p, text and image to video have "
                                          "the same shapes)")


def test_detects_hunyuan_video15_keys_only():
    """Found bare and under ComfyUI's prefixes; not for HunyuanVideo 1.0 (no byT5, no type embedding) or Flux."""
    with torch.device("meta"):
        keys = set(original_state_dict(HunyuanVideo15Transformer3DModel(**TINY)))
    assert checkpoint.detect_prefix(keys) == ""
    assert checkpoint.detect_prefix({"model.diffusion_model." + k for k in keys}) == "model.diffusion_model."
    assert checkpoint.detect_prefix(HYV1_KEYS) is None
    assert checkpoint.detect_prefix(FLUX_KEYS) is None


def tiny_shapes(**changes):
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in original_state_dict(HunyuanVideo15Transformer3DModel(**TINY)).items()}
    return {**shapes, **changes}


@pytest.mark.parametrize("changes, words", [
    ({"time_r_in.mlp.0.weight": [64, 256]}, "MeanFlow (step-distilled)"),
    ({"img_in.proj.weight": [64, 98, 1, 1, 1]}, "98 input channels (the super-resolution models)"),
    ({"double_blocks.0.img_mlp.fc2.weight": [64, 100]}, "double_blocks.0.img_mlp.fc2.weight"),
], ids=["meanflow", "super-resolution", "damaged"])
def test_other_files_are_refused_by_name(changes, words):
    with pytest.raises(UserError) as info:
        checkpoint.config_from_shapes(tiny_shapes(**changes), "", "/models/other.safetensors")
    assert "/models/other.safetensors" in info.value.message and words in info.value.message


def test_an_incomplete_file_names_the_missing_tensor(built, tmp_path):
    """A file cut short of a tensor the shapes need: the registry says which, and to re-download."""
    tensors = original_state_dict(built)
    del tensors["double_blocks.0.img_attn_q_norm.weight"]
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(registry.ModelError) as info:
        registry.resolve(str(path))
    assert "double_blocks.0.img_attn_q_norm.weight" in info.value.message and "re-download" in info.value.hint


def masked_text(config: dict, g: torch.Generator) -> dict:
    """Batch 2's text conditioning with masks that differ per sample (byT5 4 tokens, Qwen2.5-VL 8)."""
    return {"context": torch.randn(2, 8, config["text_embed_dim"], generator=g),
            "context_byt5": torch.randn(2, 4, config["text_embed_2_dim"], generator=g),
            "context_mask": torch.tensor([[1.0] * 8, [1.0] * 5 + [0.0] * 3]),
            "context_byt5_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])}


def test_padded_text_matches_diffusers_masked_forward():
    """Batch 2 with text masks that differ per sample: our loop (padding in every sample dropped, the
    rest masked as keys) equals diffusers' forward (valid tokens reordered first, an S × S mask, 9
    masked-out SigLIP tokens)."""
    model = registry.build("hunyuan-video-1.5-tiny", torch.device("cpu"))
    config = registry.resolve("hunyuan-video-1.5-tiny").config
    g = torch.Generator().manual_seed(5)
    cond = masked_text(config, g)
    x = torch.randn(2, 32, 2, 4, 4, generator=g)
    timestep = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        ours = model.output(x, timestep, cond, None)
    t = model.transformer
    for block in t.transformer_blocks:
        block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    with torch.no_grad():
        theirs = t(hidden_states=torch.cat([x, torch.zeros(2, 33, 2, 4, 4)], dim=1), timestep=timestep,
                   encoder_hidden_states=cond["context"], encoder_attention_mask=cond["context_mask"],
                   encoder_hidden_states_2=cond["context_byt5"], encoder_attention_mask_2=cond["context_byt5_mask"],
                   image_embeds=torch.zeros(2, 9, config["image_embed_dim"]), return_dict=False)[0]
    assert (ours - theirs).abs().max() <= 1e-5
    assert model.joint_text_tokens(cond) == 3 + 8  # byT5 position 3 and no Qwen position is padding in both


def test_image_to_video_matches_diffusers_forward_with_the_start_image_and_its_siglip_tokens():
    """HunyuanVideo15ImageToVideo's inputs: the start latent and mask concatenated (ComfyUI's concat_cond) and the
    SigLIP tokens (its clip_fea): our loop equals diffusers' forward given the same 65-channel input and
    image_embeds (the image tokens valid, placed first), with the text masks of two samples differing too."""
    model = registry.build("hunyuan-video-1.5-tiny", torch.device("cpu"))
    config = registry.resolve("hunyuan-video-1.5-tiny").config
    g = torch.Generator().manual_seed(6)
    image = torch.zeros(2, 32, 2, 4, 4)
    image[:, :, :1] = torch.randn(2, 32, 1, 4, 4, generator=g)
    mask = torch.ones(2, 1, 2, 4, 4)
    mask[:, :, :1] = 0.0
    cond = {**masked_text(config, g), "concat_latent_image": image, "concat_mask": mask,
            "clip_vision_output": torch.randn(2, 9, config["image_embed_dim"], generator=g)}
    x = torch.randn(2, 32, 2, 4, 4, generator=g)
    timestep = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        ours = model.output(x, timestep, cond, None)
        text_only = model.output(x, timestep, {k: v for k, v in cond.items() if k != "clip_vision_output"}, None)
    concat = torch.cat([model.latent_format.process_in(image), 1.0 - mask], dim=1)  # [2, 33, 2, 4, 4]
    t = model.transformer
    for block in t.transformer_blocks:
        block.attn.set_processor(HunyuanVideo15AttnProcessor2_0())
    with torch.no_grad():
        theirs = t(hidden_states=torch.cat([x, concat], dim=1), timestep=timestep,
                   encoder_hidden_states=cond["context"], encoder_attention_mask=cond["context_mask"],
                   encoder_hidden_states_2=cond["context_byt5"], encoder_attention_mask_2=cond["context_byt5_mask"],
                   image_embeds=cond["clip_vision_output"], return_dict=False)[0]
    assert (ours - theirs).abs().max() <= 1e-5
    assert (ours - text_only).abs().max() > 1e-3  # the image tokens count
    assert model.joint_text_tokens(cond) == 9 + 3 + 8  # what the blocks carry (padding in both samples dropped)
    assert model.spec.split_text_tokens(cond) == 9 + 4 + 8  # what the memory model and auto count, at most


def test_the_concatenated_channels_are_comfyuis_concat_cond():
    """Comfy-Org/ComfyUI comfy/model_base.py HunyuanVideo15.concat_cond (094c74c), the parts written out here: the
    image latent resized to the latent and shifted into model space, the mask inverted, resized and zero-padded
    over the frames it lacks (1: nothing to keep); without either, zeros."""
    model = registry.build("hunyuan-video-1.5-tiny", torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    image = torch.randn(1, 32, 3, 4, 6, generator=g)
    mask = torch.ones(1, 1, 1, 32, 48)  # pixel size, one frame of three
    mask[..., :16, :] = 0.0  # the top half kept
    concat = model.concat((1, 32, 3, 4, 6), {"concat_latent_image": image, "concat_mask": mask})
    assert concat.shape == (1, 33, 3, 4, 6)
    assert torch.allclose(concat[:, :32], model.latent_format.process_in(image))  # the latent's size already
    expected_mask = torch.zeros(1, 1, 3, 4, 6)
    expected_mask[:, :, 0, :2] = 1.0  # 1 − mask on the first frame, the others padded with 0
    assert torch.allclose(concat[:, 32:], expected_mask)
    assert torch.equal(model.concat((1, 32, 3, 4, 6), {}), torch.zeros(1, 33, 3, 4, 6))
    with pytest.raises(UserError, match="concat_latent_image has 2 frames; the latent has 3"):
        model.concat((1, 32, 3, 4, 6), {"concat_latent_image": image[:, :, :2]})


def test_the_text_masks_are_read_back_once_per_request_not_at_every_step(monkeypatch):
    """The masks reach the device with the request's conditioning: reading them back to the host at every step
    would make the host wait for the device each step (gpu-paths-2.md B14). A request's masks are read at its
    first step, not again at the next; another request's masks are read anew, never taken from the last one."""
    model = registry.build("hunyuan-video-1.5-tiny", torch.device("cpu"))
    config = registry.resolve("hunyuan-video-1.5-tiny").config
    g = torch.Generator().manual_seed(5)
    cond = masked_text(config, g)
    x, timestep = torch.randn(2, 32, 2, 4, 4, generator=g), torch.tensor([700.0, 250.0])
    reads, host_copy = [], torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.shape) or host_copy(self, *a, **k))
    with torch.no_grad():
        first = model.output(x, timestep, cond, None)
        assert reads, "the first step reads the masks"
        read_at_first = len(reads)
        assert torch.equal(model.output(x, timestep, cond, None), first) and len(reads) == read_at_first
        other = {**cond, "context_mask": torch.ones(2, 8), "context_byt5_mask": torch.tensor([[1.0] * 4, [1.0] * 4])}
        another = model.output(x, timestep, other, None)
        assert len(reads) > read_at_first
        assert torch.equal(another, registry.build("hunyuan-video-1.5-tiny", torch.device("cpu")).output(
            x, timestep, other, None))
