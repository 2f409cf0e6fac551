"""Flux files as ComfyUI users have them (BFL layout, bare or in a checkpoint) and diffusers
folders load into the same model; damaged or foreign files get an error naming the file. (fp8,
scaled-fp8 and GGUF files: test_storage.py.)"""

import pytest
import torch
from safetensors.torch import save_file

from xdit_backend.models import registry
from xdit_backend.models.registry import ModelError


def bfl_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers Flux → the original BFL key layout, written out here independently of the loader."""
    sd = transformer.state_dict()
    out = {}

    def linear(bfl, diffusers):
        out[f"{bfl}.weight"], out[f"{bfl}.bias"] = sd[f"{diffusers}.weight"], sd[f"{diffusers}.bias"]

    for bfl, dif in [("img_in", "x_embedder"), ("txt_in", "context_embedder"),
                     ("time_in.in_layer", "time_text_embed.timestep_embedder.linear_1"),
                     ("time_in.out_layer", "time_text_embed.timestep_embedder.linear_2"),
                     ("vector_in.in_layer", "time_text_embed.text_embedder.linear_1"),
                     ("vector_in.out_layer", "time_text_embed.text_embedder.linear_2"),
                     ("final_layer.linear", "proj_out")]:
        linear(bfl, dif)
    if "time_text_embed.guidance_embedder.linear_1.weight" in sd:
        linear("guidance_in.in_layer", "time_text_embed.guidance_embedder.linear_1")
        linear("guidance_in.out_layer", "time_text_embed.guidance_embedder.linear_2")
    for suffix in ("weight", "bias"):  # diffusers (scale, shift) ↔ BFL (shift, scale)
        scale, shift = sd[f"norm_out.linear.{suffix}"].chunk(2)
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = torch.cat([shift, scale])
    out.update(bfl_blocks(transformer, modulated=True))
    return {k: v.contiguous() for k, v in out.items()}


def bfl_blocks(transformer, modulated: bool) -> dict[str, torch.Tensor]:
    """A diffusers Flux-kind transformer's double and single blocks in BFL's names (``modulated``: with their
    modulation layers; Chroma's blocks have none)."""
    sd = transformer.state_dict()
    out = {}

    def linear(bfl, diffusers):
        out[f"{bfl}.weight"], out[f"{bfl}.bias"] = sd[f"{diffusers}.weight"], sd[f"{diffusers}.bias"]

    for i in range(len(transformer.transformer_blocks)):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        if modulated:
            linear(f"{b}.img_mod.lin", f"{d}.norm1.linear")
            linear(f"{b}.txt_mod.lin", f"{d}.norm1_context.linear")
        for stream, q, k, v, proj, nq, nk in [("img", "to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k"),
                                              ("txt", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                                               "norm_added_q", "norm_added_k")]:
            for suffix in ("weight", "bias"):
                out[f"{b}.{stream}_attn.qkv.{suffix}"] = torch.cat([sd[f"{d}.attn.{n}.{suffix}"] for n in (q, k, v)])
            linear(f"{b}.{stream}_attn.proj", f"{d}.attn.{proj}")
            out[f"{b}.{stream}_attn.norm.query_norm.scale"] = sd[f"{d}.attn.{nq}.weight"]
            out[f"{b}.{stream}_attn.norm.key_norm.scale"] = sd[f"{d}.attn.{nk}.weight"]
        for stream, ff in (("img", "ff"), ("txt", "ff_context")):
            linear(f"{b}.{stream}_mlp.0", f"{d}.{ff}.net.0.proj")
            linear(f"{b}.{stream}_mlp.2", f"{d}.{ff}.net.2")
    for i in range(len(transformer.single_transformer_blocks)):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        if modulated:
            linear(f"{b}.modulation.lin", f"{d}.norm.linear")
        for suffix in ("weight", "bias"):
            out[f"{b}.linear1.{suffix}"] = torch.cat([sd[f"{d}.{n}.{suffix}"]
                                                      for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
        linear(f"{b}.linear2", f"{d}.proj_out")
        out[f"{b}.norm.query_norm.scale"] = sd[f"{d}.attn.norm_q.weight"]
        out[f"{b}.norm.key_norm.scale"] = sd[f"{d}.attn.norm_k.weight"]
    return out


@pytest.fixture(scope="module")
def tiny():
    return registry.build("flux-tiny", torch.device("cpu"))


def forward(transformer, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return transformer(hidden_states=torch.randn(1, 16, 64, generator=g),
                           encoder_hidden_states=torch.randn(1, 8, 64, generator=g),
                           pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.7]),
                           img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), guidance=torch.tensor([3.5]),
                           return_dict=False)[0]


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."], ids=["diffusion_models", "checkpoint"])
def test_bfl_file_loads_as_the_same_model(tiny, tmp_path, prefix):
    path = tmp_path / "flux.safetensors"
    save_file({prefix + k: v for k, v in bfl_state_dict(tiny.transformer).items()}, str(path))
    loaded = registry.build(str(path), torch.device("cpu"))
    for key, value in tiny.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    assert (forward(loaded.transformer) - forward(tiny.transformer)).abs().max() <= 1e-5
    assert registry.resolve(str(path)).describes == "Flux-dev architecture, width 64, 2+5 blocks"


def test_diffusers_folder_loads(tiny, tmp_path):
    tiny.transformer.save_pretrained(tmp_path / "flux")
    loaded = registry.build(str(tmp_path / "flux"), torch.device("cpu"))
    assert (forward(loaded.transformer) - forward(tiny.transformer)).abs().max() <= 1e-5


def random_inits(monkeypatch) -> list[int]:
    """Counts the elements nn.Linear initialises for real (not on the meta device)."""
    counted, reset = [], torch.nn.Linear.reset_parameters

    def counting(module):
        if not module.weight.is_meta:
            counted.append(module.weight.numel())
        reset(module)

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", counting)
    return counted


@pytest.mark.parametrize("shard", [None, "100KB"], ids=["one-file", "sharded"])
def test_a_folder_loads_what_diffusers_loads_without_a_random_init(tiny, tmp_path, monkeypatch, shard):
    """The same tensors as diffusers' from_pretrained (bf16), from one file or an index of shards;
    no weight is randomly initialised first (from_pretrained without accelerate does, in float32)."""
    from diffusers import FluxTransformer2DModel

    folder = tmp_path / "flux"
    tiny.transformer.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    assert (folder / "diffusion_pytorch_model.safetensors.index.json").exists() == bool(shard)
    expected = FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16).state_dict()
    inits = random_inits(monkeypatch)
    ours = registry.build(str(folder), torch.device("cpu"), torch.bfloat16).transformer.state_dict()
    assert inits == []
    assert ours.keys() == expected.keys()
    assert [k for k in expected if not (ours[k].dtype == expected[k].dtype and torch.equal(ours[k], expected[k]))] == []
    FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    assert sum(inits) >= sum(p.numel() for p in tiny.transformer.parameters()) // 2  # the count sees diffusers' init


def test_a_wan_folder_loads_with_its_float32_modules(tmp_path):
    """diffusers' from_pretrained refuses Wan without accelerate (its _keep_in_fp32_modules needs
    low_cpu_mem_usage); ours loads it, keeping those modules float32 by diffusers' own rule."""
    from diffusers import WanTransformer3DModel

    wan = registry.build("wan-tiny", torch.device("cpu")).transformer
    wan.save_pretrained(tmp_path / "wan")
    loaded = registry.build(str(tmp_path / "wan"), torch.device("cpu"), torch.bfloat16).transformer
    kept = WanTransformer3DModel._keep_in_fp32_modules
    for key, value in loaded.state_dict().items():
        float32 = any(module in key.split(".") for module in kept)  # diffusers' load_model_dict_into_meta rule
        assert value.dtype == (torch.float32 if float32 else torch.bfloat16), key
        assert torch.equal(value, wan.state_dict()[key].to(value.dtype)), key


def test_a_folder_without_safetensors_weights_says_what_it_found(tiny, tmp_path):
    folder = tmp_path / "flux"
    tiny.transformer.save_pretrained(folder)
    (folder / "diffusion_pytorch_model.safetensors").rename(folder / "diffusion_pytorch_model.bin")
    with pytest.raises(ModelError) as info:
        registry.build(str(folder), torch.device("cpu"))
    assert str(folder) in info.value.message and "diffusion_pytorch_model.bin" in info.value.message
    assert "pickled .bin weights are not loaded" in info.value.hint


def test_schnell_variant_is_inferred_from_the_missing_guidance(tmp_path):
    from diffusers import FluxTransformer2DModel

    config = {**registry.BUILTINS["flux-tiny"].config, "guidance_embeds": False}
    path = tmp_path / "schnell.safetensors"
    save_file(bfl_state_dict(FluxTransformer2DModel(**config)), str(path))
    source = registry.resolve(str(path))
    assert source.config["guidance_embeds"] is False and "schnell" in source.describes
    assert source.config["axes_dims_rope"] == (4, 6, 6)


@pytest.mark.parametrize("in_channels, concat", [(384, 80), (128, 16)], ids=["fill", "depth-canny"])
def test_fill_and_depth_files_are_read_off_the_shapes_and_load_as_the_same_model(tmp_path, in_channels, concat):
    """Flux.1 Fill (the image and its 8×8 mask: 80 latent channels concatenated) and Depth / Canny (the control
    image: 16): the config from the shapes, every tensor equal; another channel count is refused naming the file."""
    from diffusers import FluxTransformer2DModel

    config = {**registry.BUILTINS["flux-tiny"].config, "in_channels": in_channels, "out_channels": 64}
    built = FluxTransformer2DModel(**config)
    path = tmp_path / "variant.safetensors"
    save_file(bfl_state_dict(built), str(path))
    source = registry.resolve(str(path))
    assert {k: source.config[k] for k in ("in_channels", "out_channels")} == {"in_channels": in_channels,
                                                                             "out_channels": 64}
    loaded = registry.build(str(path), torch.device("cpu"))
    assert loaded.spec.concat_channels == concat
    for key, value in built.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[key], value), key
    weights = bfl_state_dict(FluxTransformer2DModel(**{**config, "in_channels": 192}))
    save_file(weights, str(tmp_path / "odd.safetensors"))
    with pytest.raises(ModelError, match="odd.safetensors: a Flux file with 192 input channels and 64 output"):
        registry.resolve(str(tmp_path / "odd.safetensors"))


def test_an_fp8_fill_file_keeps_its_block_weights_in_fp8_and_takes_its_concatenated_channels(tmp_path):
    """Flux.1 Fill as Comfy-Org ships it in float8: the blocks' Linear weights stay float8, every tensor equals the
    fp8-rounded one, and the 384-channel input embedding comes with it (80 channels concatenated)."""
    from diffusers import FluxTransformer2DModel

    from xdit_backend.models.storage import StoredLinear

    built = FluxTransformer2DModel(**{**registry.BUILTINS["flux-tiny"].config, "in_channels": 384, "out_channels": 64})
    path = tmp_path / "fill-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in bfl_state_dict(built).items()}, str(path))
    loaded = registry.build(str(path), torch.device("cpu"))
    assert loaded.spec.concat_channels == 80
    stored = {f"{name}.weight" for name, module in loaded.transformer.named_modules()
              if isinstance(module, StoredLinear)}
    assert "transformer_blocks.0.attn.to_q.weight" in stored
    for key, value in built.state_dict().items():
        tensor = loaded.transformer.state_dict()[key]
        assert torch.equal(tensor.float(), value.to(torch.float8_e4m3fn).float()), key


def test_unknown_file_names_what_it_found(tmp_path):
    path = tmp_path / "vae.safetensors"
    save_file({"encoder.conv_in.weight": torch.zeros(2), "decoder.conv_out.weight": torch.zeros(2)}, str(path))
    with pytest.raises(ModelError) as info:
        registry.resolve(str(path))
    assert str(path) in info.value.message and "decoder, encoder" in info.value.message
    assert "Flux" in info.value.hint


def test_truncated_file_is_named(tiny, tmp_path):
    path = tmp_path / "cut.safetensors"
    save_file(bfl_state_dict(tiny.transformer), str(path))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelError) as info:
        registry.build(str(path), torch.device("cpu"))
    assert str(path) in info.value.message and "truncated" in info.value.hint


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_file_with_non_finite_weights_is_refused_at_load_naming_the_tensor(tiny, tmp_path, stored):
    """Issue 25 (9): NaN weights (in fp8: kept as stored, NaN once upcast) gave a NaN latent as a success."""
    weights = {key: value.to(stored) if value.dim() == 2 else value for key, value in
               bfl_state_dict(tiny.transformer).items()}
    broken = weights["double_blocks.0.img_mlp.0.weight"].float()
    broken[3, 5] = float("nan")
    weights["double_blocks.0.img_mlp.0.weight"] = broken.to(stored)
    path = tmp_path / "nan.safetensors"
    save_file(weights, str(path))
    with pytest.raises(ModelError) as info:
        registry.build(str(path), torch.device("cpu"))
    assert info.value.message == (f"{path}: 1 tensors hold NaN or infinite values once loaded "
                                  "(transformer_blocks.0.ff.net.0.proj.weight)")
    assert "re-download" in info.value.hint


@pytest.mark.parametrize("name", ["model.ckpt", "model.pt"])
def test_a_pytorch_pickle_is_named_as_one_not_as_a_damaged_file(tmp_path, name):
    """Issue 30: a .ckpt was told it "may be truncated … re-download it"; it is a pickle, which is not loaded."""
    path = tmp_path / name
    torch.save({"state_dict": {"weight": torch.zeros(2)}}, str(path))
    with pytest.raises(ModelError) as info:
        registry.resolve(str(path))
    assert "is a PyTorch pickle" in info.value.message and "truncated" not in str(info.value)
    assert ".safetensors" in info.value.hint


def test_a_folder_whose_config_names_no_class_says_so(tmp_path):
    """Issue 30: a config.json without _class_name was told it "holds a None"."""
    (tmp_path / "config.json").write_text('{"num_layers": 2}')
    with pytest.raises(ModelError) as info:
        registry.resolve(str(tmp_path))
    assert "names no model class (no _class_name)" in info.value.message and "None" not in info.value.message
    assert "FluxTransformer2DModel" in info.value.hint


def test_shapes_matching_no_variant_are_named(tiny, tmp_path):
    weights = bfl_state_dict(tiny.transformer)
    weights["double_blocks.0.img_mlp.0.weight"] = torch.zeros(100, 64)
    path = tmp_path / "odd.safetensors"
    save_file(weights, str(path))
    with pytest.raises(ModelError) as info:
        registry.resolve(str(path))
    assert str(path) in info.value.message and "match no Flux variant" in info.value.message


def test_missing_path_lists_what_to_give():
    with pytest.raises(ModelError) as info:
        registry.resolve("/nowhere/flux.safetensors")
    assert "no model at /nowhere/flux.safetensors" in info.value.message and "flux-tiny" in info.value.hint


def test_a_model_file_samples_like_the_same_weights_built_in(backend2, tiny, tmp_path):
    """Through the backend (ulysses=2): the file gives the built-in model's latent for the same inputs."""
    path = tmp_path / "flux.safetensors"
    save_file(bfl_state_dict(tiny.transformer), str(path))
    g = torch.Generator().manual_seed(1)
    tensors = {"context": torch.randn(1, 8, 64, generator=g), "pooled": torch.randn(1, 32, generator=g)}
    fields = {"width": 64, "height": 64, "steps": 3, "seed": 2, "parallel": {"ulysses": 2}}
    from_file, _ = backend2.sample({**fields, "model": str(path)}, tensors)
    built_in, _ = backend2.sample({**fields, "model": "flux-tiny"}, tensors)
    assert (from_file["samples"] - built_in["samples"]).abs().max() <= 1e-5
    with pytest.raises(Exception, match="needs text conditioning") as info:
        backend2.sample({**fields, "model": str(path)})
    assert "--embeds" in info.value.hint and "CLIP Text Encode" in info.value.node_hint  # each caller's own words


def test_conversion_matches_diffusers_own_converter_at_full_width(tmp_path):
    """Ground truth for the layout: diffusers' converter (which only works at width 3072) reads a
    full-width one-double, one-single-block Flux file into exactly the tensors our loader gives."""
    from diffusers import FluxTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers
    from safetensors.torch import load_file

    config = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=128,
                  num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                  guidance_embeds=True, axes_dims_rope=(16, 56, 56))
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # 545 M parameters: keep the test within a few GB
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = FluxTransformer2DModel(**config)
    finally:
        torch.set_default_dtype(default)
    path = tmp_path / "flux-full-width.safetensors"
    save_file(bfl_state_dict(model), str(path))
    del model
    expected = convert_flux_transformer_checkpoint_to_diffusers(load_file(str(path)))
    ours = registry.build(str(path), torch.device("cpu"), torch.bfloat16).transformer.state_dict()
    assert registry.resolve(str(path)).describes.startswith("Flux-dev architecture, width 3072")
    assert ours.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(ours[key], expected[key])] == []


def test_a_pipefusion_stage_reads_only_its_blocks_from_the_file(tiny, tmp_path):
    """blocks=(1, 4): the second double block and the first two single blocks are read (with the
    embeddings and the output layers); every other block is never read and stays on meta."""
    from xdit_backend.parallel.pipefusion import keep_stage

    path = tmp_path / "flux.safetensors"
    save_file(bfl_state_dict(tiny.transformer), str(path))
    stage = registry.build(str(path), torch.device("cpu"), blocks=(1, 4)).transformer
    params = dict(stage.named_parameters())
    read = {k for k, p in params.items() if not p.is_meta}
    assert {k.split(".")[0] + "." + k.split(".")[1] for k in params.keys() - read} == {
        "transformer_blocks.0", "single_transformer_blocks.2", "single_transformer_blocks.3",
        "single_transformer_blocks.4"}
    assert "x_embedder.weight" in read and "proj_out.weight" in read
    kept = keep_stage(stage, registry.spec(str(path)).stage_plan, 1, 4)
    assert not any(p.is_meta for p in stage.parameters())
    full = dict(tiny.transformer.named_modules())
    for block, name in zip(kept, ("transformer_blocks.1", "single_transformer_blocks.0", "single_transformer_blocks.1")):
        expected = full[name].state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in block.state_dict().items()), name


def test_pipefusion_from_a_file_equals_serial(backend2, tiny, tmp_path):
    """Each rank loads its stage from the file; with every step warm-up the result is the exact one
    (Ulysses here, itself equal to serial in test_parallel)."""
    path = tmp_path / "flux.safetensors"
    save_file(bfl_state_dict(tiny.transformer), str(path))
    g = torch.Generator().manual_seed(3)
    tensors = {"context": torch.randn(1, 8, 64, generator=g), "pooled": torch.randn(1, 32, generator=g)}
    fields = {"model": str(path), "width": 64, "height": 64, "steps": 3, "seed": 2}
    staged, _ = backend2.sample({**fields, "parallel": {"pipefusion": 2, "warmup_steps": 3}}, tensors)
    exact, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}}, tensors)
    assert (staged["samples"] - exact["samples"]).abs().max() <= 1e-4
