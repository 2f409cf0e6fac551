"""Qwen-Image: ComfyUI-layout files (bare, in a checkpoint, fp8) load into diffusers at any width; the
model wrapper computes what ComfyUI's own Qwen-Image model computes, reference latents included; a
reference stays exact under ulysses 2 and ring 2."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from safetensors.torch import save_file
from spawned import on_ranks

from xdit_backend.models import qwen_image_checkpoint, registry
from xdit_backend.models.flux import pack
from xdit_backend.models.storage import StoredLinear
from xdit_backend.parallel import attention, sequence

TINY = registry.BUILTINS["qwen-image-tiny"].config
needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with its own model")

# ComfyUI's names for one block's tensors (comfy/ldm/qwen_image/model.py's modules), written out here
# rather than taken from the converter; every one has a weight and a bias unless listed in NORMS.
BLOCK_LINEARS = ("img_mod.1", "txt_mod.1", "attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj",
                 "attn.add_k_proj", "attn.add_v_proj", "attn.to_out.0", "attn.to_add_out",
                 "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")
BLOCK_NORMS = ("attn.norm_q", "attn.norm_k", "attn.norm_added_q", "attn.norm_added_k")
GLOBAL_LINEARS = ("img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1",
                  "time_text_embed.timestep_embedder.linear_2", "norm_out.linear", "proj_out")


def comfy_layout(shapes_of: dict[str, tuple], blocks: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random file in ComfyUI's Qwen-Image key layout; ``shapes_of`` maps its Linear names to (out, in)."""
    g = torch.Generator().manual_seed(seed)
    out = {"txt_norm.weight": 1 + 0.1 * torch.randn(shapes_of["txt_norm"], generator=g)}
    names = list(GLOBAL_LINEARS) + [f"transformer_blocks.{i}.{n}" for i in range(blocks) for n in BLOCK_LINEARS]
    for name in names:
        rows, columns = shapes_of[name.split(".", 2)[-1] if name.startswith("transformer_blocks") else name]
        out[f"{name}.weight"] = 0.2 * torch.randn(rows, columns, generator=g)
        out[f"{name}.bias"] = 0.1 * torch.randn(rows, generator=g)
    for i in range(blocks):
        for name in BLOCK_NORMS:
            out[f"transformer_blocks.{i}.{name}.weight"] = 1 + 0.1 * torch.randn(shapes_of["head"], generator=g)
    return out


def shapes(width: int, head: int, text: int, channels: int = 16) -> dict[str, tuple]:
    """Qwen-Image's Linear shapes at a width, head size and text width (its published architecture)."""
    table = {"img_in": (width, 4 * channels), "txt_in": (width, text), "txt_norm": (text,), "head": (head,),
             "time_text_embed.timestep_embedder.linear_1": (width, 256),
             "time_text_embed.timestep_embedder.linear_2": (width, width),
             "norm_out.linear": (2 * width, width), "proj_out": (4 * channels, width),
             "img_mod.1": (6 * width, width), "txt_mod.1": (6 * width, width),
             "img_mlp.net.0.proj": (4 * width, width), "img_mlp.net.2": (width, 4 * width),
             "txt_mlp.net.0.proj": (4 * width, width), "txt_mlp.net.2": (width, 4 * width)}
    for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
        table[f"attn.{name}"] = (width, width)
    return table


def tiny_file() -> dict[str, torch.Tensor]:
    width = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    return comfy_layout(shapes(width, TINY["attention_head_dim"], TINY["joint_attention_dim"]), TINY["num_layers"])


def reference_model(state: dict[str, torch.Tensor]) -> QwenImageTransformer2DModel:
    """diffusers' model with the file's tensors under the same names (strict: every key used)."""
    model = QwenImageTransformer2DModel(**TINY)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.eval()


def inputs(seed=0, h=8, w=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, h, w, generator=g)
    context = torch.randn(1, 8, TINY["joint_attention_dim"], generator=g)
    return x, torch.tensor([0.6]), {"context": context}


def velocity(model, x, sigma, cond):
    with torch.no_grad():
        return model.output(x, sigma, cond, None)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_a_comfyui_layout_file_loads_as_the_same_model(tmp_path, prefix):
    """Every tensor equal, the config read off the shapes, and the forward of diffusers' model given the
    same tensors directly (x0 within 1e-5)."""
    state = tiny_file()
    path = tmp_path / "qwen.safetensors"
    save_file({prefix + k: v for k, v in state.items()}, str(path))
    source = registry.resolve(str(path))
    assert source.family == "qwen_image" and source.prefix == prefix
    assert {k: source.config[k] for k in TINY} == {**TINY, "axes_dims_rope": qwen_image_checkpoint.rope_axes(16)}
    loaded = registry.build(str(path), torch.device("cpu"))
    for key, value in state.items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    expected = reference_model(state)
    x, sigma, cond = inputs()
    with torch.no_grad():
        theirs = expected(hidden_states=pack(x), encoder_hidden_states=cond["context"], timestep=sigma,
                          img_shapes=[[(1, 4, 8)]], return_dict=False)[0]
    ours = velocity(loaded, x, sigma, cond)
    assert ours.shape == x.shape
    assert (pack(ours) - theirs).abs().max() <= 1e-5  # even sizes: diffusers' positions are ComfyUI's


def test_an_fp8_file_keeps_its_linear_weights_in_fp8(tmp_path):
    """A float8_e4m3fn file: the blocks' Linear weights stay float8, all tensors equal the fp8-rounded ones,
    and the forward is that of the rounded weights."""
    state = {k: v.to(torch.float8_e4m3fn) for k, v in tiny_file().items()}
    path = tmp_path / "qwen-fp8.safetensors"
    save_file(state, str(path))
    loaded = registry.build(str(path), torch.device("cpu"))
    stored = {f"{name}.weight" for name, module in loaded.transformer.named_modules()
              if isinstance(module, StoredLinear)}
    assert "transformer_blocks.0.attn.to_q.weight" in stored and "transformer_blocks.1.img_mod.1.weight" in stored
    for key, value in state.items():
        tensor = loaded.transformer.state_dict()[key]
        assert tensor.dtype == (torch.float8_e4m3fn if key in stored else torch.float32), key
        assert torch.equal(tensor.float(), value.float()), key
    expected = reference_model(state)
    x, sigma, cond = inputs(1)
    with torch.no_grad():
        theirs = expected(hidden_states=pack(x), encoder_hidden_states=cond["context"], timestep=sigma,
                          img_shapes=[[(1, 4, 8)]], return_dict=False)[0]
    assert (pack(velocity(loaded, x, sigma, cond)) - theirs).abs().max() <= 1e-4


def test_the_full_size_config_and_name_are_read_off_the_shapes():
    """Qwen-Image's published shapes (width 3072, 24 heads of 128, 60 blocks, Qwen2.5-VL's 3584) give its
    diffusers config back, RoPE axes (16, 56, 56) included; with ComfyUI's 2511 marker, zero_cond_t."""
    file_shapes = {k: list(v.shape) for k, v in comfy_layout_meta(3072, 128, 3584, 60).items()}
    config = qwen_image_checkpoint.config_from_shapes(file_shapes, "", "qwen_image_bf16.safetensors")
    assert config == {"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                      "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                      "axes_dims_rope": (16, 56, 56), "zero_cond_t": False}
    assert qwen_image_checkpoint.variant(config) == "Qwen-Image / Qwen-Image-Edit (20 B)"
    marked = qwen_image_checkpoint.config_from_shapes({**file_shapes, "__index_timestep_zero__": [0]}, "",
                                                      "qwen_image_edit_2511_bf16.safetensors")
    assert marked == {**config, "zero_cond_t": True}
    assert qwen_image_checkpoint.variant(marked) == "Qwen-Image-Edit-2511 (20 B)"


def comfy_layout_meta(width, head, text, blocks):
    """The full-size layout's shapes without allocating: tensors on the meta device."""
    table = shapes(width, head, text)
    out = {"txt_norm.weight": torch.empty(table["txt_norm"], device="meta")}
    for name in list(GLOBAL_LINEARS) + [f"transformer_blocks.{i}.{n}" for i in range(blocks) for n in BLOCK_LINEARS]:
        rows, columns = table[name.split(".", 2)[-1] if name.startswith("transformer_blocks") else name]
        out[f"{name}.weight"] = torch.empty(rows, columns, device="meta")
    for i in range(blocks):
        for name in BLOCK_NORMS:
            out[f"transformer_blocks.{i}.{name}.weight"] = torch.empty(head, device="meta")
    return out


def test_an_incomplete_file_is_named_with_the_missing_tensor(tmp_path):
    state = tiny_file()
    del state["proj_out.weight"]
    path = tmp_path / "cut.safetensors"
    save_file(state, str(path))
    with pytest.raises(registry.ModelError, match="proj_out.weight.*missing"):
        registry.resolve(str(path))


def test_a_layered_model_is_refused_with_the_reason(tmp_path):
    state = {**tiny_file(), "time_text_embed.addition_t_embedding.weight": torch.zeros(2, 64)}
    path = tmp_path / "layered.safetensors"
    save_file(state, str(path))
    with pytest.raises(registry.ModelError, match="Layered"):
        registry.resolve(str(path))


def test_a_reference_latent_changes_the_result_and_comfyui_5d_latents_are_the_same():
    model = registry.build("qwen-image-tiny", torch.device("cpu"))
    x, sigma, cond = inputs(2)
    reference = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(3))
    alone = velocity(model, x, sigma, cond)
    edited = velocity(model, x, sigma, {**cond, "reference_0": reference})
    as_comfyui = velocity(model, x, sigma, {**cond, "reference_0": reference[:, :, None]})  # [B, 16, 1, h, w]
    assert (edited - alone).abs().max() > 1e-2
    assert torch.equal(edited, as_comfyui)


def comfy_and_ours(comfy):
    """ComfyUI's QwenImageTransformer2DModel and our qwen-image-tiny, both with ``tiny_file``'s weights."""
    state = tiny_file()
    theirs = comfy.ldm.qwen_image.model.QwenImageTransformer2DModel(**TINY, operations=comfy.ops.disable_weight_init)
    theirs.load_state_dict(state, strict=True)
    model = registry.build("qwen-image-tiny", torch.device("cpu"))
    model.transformer.load_state_dict(state, strict=True)
    return theirs, model


def comfyui():
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.latent_formats
    import comfy.ldm.qwen_image.model
    import comfy.ops

    return comfy


@needs_comfyui
@pytest.mark.parametrize("size", [(8, 16), (6, 10)], ids=["even-token-rows", "odd-token-rows"])
def test_the_forward_equals_comfyuis_own_qwen_image_model(size):
    """ComfyUI's QwenImageTransformer2DModel with the same tensors, fed as its model_base feeds it (a
    [B, 16, 1, h, w] latent, σ, references through Wan21.process_in): the same velocity, with two
    reference latents of other sizes (one odd, padded to the patch) and odd token counts (positions
    centred as ComfyUI centres them)."""
    comfy = comfyui()
    theirs, model = comfy_and_ours(comfy)
    x, sigma, cond = inputs(4, *size)
    g = torch.Generator().manual_seed(5)
    references = [torch.randn(1, 16, 1, 6, 8, generator=g), torch.randn(1, 16, 1, 5, 7, generator=g)]
    wan21 = comfy.latent_formats.Wan21()
    with torch.no_grad():
        expected = theirs(x[:, :, None], sigma, cond["context"],
                          ref_latents=[wan21.process_in(r) for r in references])[:, :, 0]
    ours = velocity(model, x, sigma, {**cond, "reference_0": references[0], "reference_1": references[1]})
    assert (ours - expected).abs().max() <= 1e-5
    plain = velocity(model, x, sigma, cond)
    with torch.no_grad():
        assert (plain - theirs(x[:, :, None], sigma, cond["context"])[:, :, 0]).abs().max() <= 1e-5


def sequence_parallel_differences(rank: int, x, sigma, conds: list[dict]) -> list[dict[str, float]]:
    """On each rank of a world of 2, per conditioning: max |velocity − serial velocity| under ulysses 2,
    then under ring 2 (plain floats: tensors would not outlive the process that returns them)."""
    import torch.distributed as dist

    model = registry.build("qwen-image-tiny", torch.device("cpu"))
    out = []
    for cond in conds:
        serial, differences = velocity(model, x, sigma, cond), {}
        for method in ("ulysses", "ring"):
            layout = SimpleNamespace(sequence_group=dist.group.WORLD, sequence_index=rank,
                                     config=SimpleNamespace(sequence=2),
                                     group=lambda name, method=method: dist.group.WORLD if name == method else None)
            attached = sequence.attach(model.transformer, model.spec.sequence_plan, layout,
                                       attention.local_attention(torch.device("cpu")))
            try:
                differences[method] = (velocity(model, x, sigma, cond) - serial).abs().max().item()
            finally:
                attached.detach()
        out.append(differences)
    return out


def test_a_reference_latent_stays_exact_under_ulysses_2_and_ring_2():
    """32 noisy + 12 reference image tokens and 8 text tokens cut in two; and 32 + 15 image tokens with 7
    text tokens, which 2 does not divide (padded shares): equal to serial within 1e-5, and the reference
    does change the result."""
    x, sigma, cond = inputs(6)
    g = torch.Generator().manual_seed(7)
    even = {**cond, "reference_0": torch.randn(1, 16, 4, 12, generator=g)}
    odd = {"context": cond["context"][:, :7], "reference_0": torch.randn(1, 16, 6, 10, generator=g)}
    model = registry.build("qwen-image-tiny", torch.device("cpu"))
    assert (velocity(model, x, sigma, even) - velocity(model, x, sigma, cond)).abs().max() > 1e-2
    for rank, results in enumerate(on_ranks(sequence_parallel_differences, 2, x, sigma, [even, odd])):
        for case, differences in zip(("even", "odd"), results):
            assert differences.keys() == {"ulysses", "ring"}
            assert max(differences.values()) <= 1e-5, (rank, case, differences)


def test_a_2511_file_modulates_its_references_at_timestep_zero_as_diffusers_zero_cond_t(tmp_path):
    """ComfyUI's Qwen-Image-Edit-2511 files carry an empty ``__index_timestep_zero__`` marker: the file loads as
    diffusers' zero_cond_t model (ComfyUI's "index_timestep_zero" reference method), its forward with a reference
    equals diffusers' own (the reference's image stream modulated at t = 0), and the same weights without the marker
    (Edit-2509's plain "index") give another result."""
    state = tiny_file()
    path, plain_path = tmp_path / "qwen-2511.safetensors", tmp_path / "qwen-2509.safetensors"
    save_file({**state, "__index_timestep_zero__": torch.zeros(0)}, str(path))
    save_file(state, str(plain_path))
    source = registry.resolve(str(path))
    assert source.config["zero_cond_t"] and not registry.resolve(str(plain_path)).config["zero_cond_t"]
    loaded, plain = (registry.build(str(p), torch.device("cpu")) for p in (path, plain_path))
    assert loaded.spec.comfy_model_inputs["ref_latents_method"] == "index_timestep_zero"
    x, sigma, cond = inputs(8)
    reference = torch.randn(1, 16, 4, 8, generator=torch.Generator().manual_seed(9))  # even, smaller than the latent
    cond = {**cond, "reference_0": reference}
    expected = QwenImageTransformer2DModel(**{**TINY, "zero_cond_t": True})
    expected.load_state_dict(state, strict=True)
    with torch.no_grad():
        tokens = torch.cat([pack(x), pack(loaded.latent_format.process_in(reference))], dim=1)  # [1, 32 + 8, 64]
        theirs = expected.eval()(hidden_states=tokens, encoder_hidden_states=cond["context"], timestep=sigma,
                                 img_shapes=[[(1, 4, 8), (1, 2, 4)]], return_dict=False)[0][:, :32]
    ours = velocity(loaded, x, sigma, cond)
    assert (pack(ours) - theirs).abs().max() <= 1e-5  # even sizes, a smaller reference: the positions agree
    assert (ours - velocity(plain, x, sigma, cond)).abs().max() > 1e-3


def test_a_comfyui_scaled_fp8_file_matches_its_dequantised_model(tmp_path):
    """Comfy-Org's scaled-fp8 form (``scaled_fp8`` marker, ``scale_weight`` per Linear): the block Linears
    keep fp8 and their scales, and the forward is that of the dequantised weights."""
    from backend.test_storage import comfy_scaled_file

    path = tmp_path / "qwen-scaled.safetensors"
    save_file(comfy_scaled_file(tiny_file(), path), str(tmp_path / "reference.safetensors"))
    loaded = registry.build(str(path), torch.device("cpu"))
    expected = registry.build(str(tmp_path / "reference.safetensors"), torch.device("cpu"))
    assert isinstance(loaded.transformer.transformer_blocks[0].attn.to_q, StoredLinear)
    assert "float8_e4m3fn scaled" in loaded.storage_dtype
    x, sigma, cond = inputs(10)
    reference = velocity(expected, x, sigma, cond)
    # within 1e-5 relative to the largest value (~10 here): the scales multiply in another order
    assert (velocity(loaded, x, sigma, cond) - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max())
