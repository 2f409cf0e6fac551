"""GGUF model files in city96's layout (models/gguf_file.py): written here by a writer that follows
city96's tools/convert.py with the gguf package, loaded with the quantized matrices kept as raw
blocks on the device, dequantized per layer by diffusers' kernels; the result equals the model
built from the gguf package's own dequantisation."""

import pytest
import torch
from safetensors.torch import save_file
from backend.test_model_files import bfl_state_dict, forward

from xdit_backend.memory import fit as memory_fit
from xdit_backend.models import registry
from xdit_backend.models.registry import ModelError
from xdit_backend.models.resolved import resolve_model
from xdit_backend.models.storage import StoredLinear
from xdit_backend.selftest.files import gguf_file as written_gguf

gguf = pytest.importorskip("gguf")  # the optional extra "gguf" (installed in CI)
from gguf import GGMLQuantizationType as GGML  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return registry.build("flux-tiny", CPU)


K_QUANTS = (GGML.Q4_K, GGML.Q5_K, GGML.Q6_K)  # the gguf package cannot quantize these: synthetic blocks
HIGH_PRECISION = ("time_in.", "txt_in.", "vector_in.", "img_in.", "guidance_in.", "final_layer.")  # kept F32


def gguf_file(state: dict, path, kind: GGML) -> dict[str, torch.Tensor]:
    """A GGUF file as city96's tools/convert.py lays it out (original key names, 1-D tensors and the embedders /
    final layer in F32, the other matrices in ``kind``, F32 where a row does not fit its blocks); returns the
    reference: every tensor as the gguf package dequantises it."""
    return written_gguf(state, path, kind.name,
                        plain=lambda key, value: value.dim() == 1 or any(name in key for name in HIGH_PRECISION))


@pytest.mark.parametrize("kind", [GGML.Q8_0, GGML.Q4_0, GGML.Q5_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K, GGML.BF16],
                         ids=lambda kind: kind.name)
def test_a_gguf_file_keeps_its_blocks_and_matches_the_dequantised_model(tiny, tmp_path, kind):
    path = tmp_path / f"flux-{kind.name}.gguf"
    reference = gguf_file(bfl_state_dict(tiny.transformer), path, kind)
    save_file(reference, str(tmp_path / "reference.safetensors"))
    expected = registry.build(str(tmp_path / "reference.safetensors"), CPU)
    assert registry.resolve(str(path)).config == registry.resolve("flux-tiny").config
    loaded = registry.build(str(path), CPU)
    stored = {name: m for name, m in loaded.transformer.named_modules() if isinstance(m, StoredLinear)}
    if kind == GGML.BF16:  # a plain type: bfloat16 in the file, the compute dtype on the device
        assert stored == {} and loaded.storage_dtype == "float32"
    else:
        assert stored and all(m.weight.dtype == torch.uint8 for m in stored.values())
        assert loaded.storage_dtype.startswith(f"gguf {kind.name}") or loaded.storage_dtype.endswith(f"gguf {kind.name}")
        values, size = gguf.GGML_QUANT_SIZES[kind]  # raw blocks resident: bytes per value = size / values
        assert all(m.weight.numel() == m.out_features * m.in_features // values * size for m in stored.values())
        assert "transformer_blocks.0.attn.to_q" in stored or kind in K_QUANTS  # split from the fused qkv
    for name, module in stored.items():
        assert torch.allclose(module.upcast(torch.float32), expected.transformer.get_submodule(name).weight,
                              rtol=1e-6, atol=1e-7), name
    out, want = forward(loaded.transformer), forward(expected.transformer)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_gguf_type_the_backend_cannot_dequantize_is_named(tiny, tmp_path):
    path = tmp_path / "flux-iq2.gguf"
    state = bfl_state_dict(tiny.transformer)
    writer = gguf.GGUFWriter(str(path), arch="flux")
    for key, value in state.items():
        if key == "double_blocks.0.img_mlp.2.weight":  # [64, 256]: one IQ2_XXS block of 66 bytes per row
            writer.add_tensor(key, torch.zeros(64, 66, dtype=torch.uint8).numpy(), raw_dtype=GGML.IQ2_XXS)
        else:
            writer.add_tensor(key, value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelError, match=r"flux-iq2.gguf: tensor double_blocks.0.img_mlp.2.weight is quantized "
                                         r"as IQ2_XXS") as info:
        registry.build(str(path), CPU)
    assert "Q8_0" in info.value.hint


def sharded_against_whole(rank: int, paths: list[str], torch_before_2_13: bool) -> list[tuple[str, int, float]]:
    """On each rank: each model loaded as a sharded backend loads it (each block's stored weights read in this
    rank's rows only and sharded by FSDP2 on dim 0: shard.RowSharding), against the same model unsharded:
    (storage, rows held, max difference). ``torch_before_2_13``: as a torch whose FSDP2 cannot shard an integer
    parameter (compat.py), which keeps GGUF's blocks whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from xdit_backend.distributed import compat
    from xdit_backend.parallel import shard

    if torch_before_2_13:
        compat.fsdp_shards_integer_parameters = lambda: False
    mesh = init_device_mesh("cpu", (2,))
    answers = []
    for path in paths:
        loader = shard.row_sharding(mesh, CPU, integer_weights=path.endswith(".gguf"))
        sharded = registry.build(path, CPU, sharding=loader)
        shard.shard_blocks(sharded, mesh, CPU)
        whole = registry.build(path, CPU)
        weight = sharded.transformer.transformer_blocks[0].attn.to_q.weight
        difference = (forward(sharded.transformer) - forward(whole.transformer)).abs().max().item()
        held = weight.to_local() if isinstance(weight, DTensor) else weight  # a sharded weight, or a whole one
        answers.append((sharded.storage_dtype, held.shape[0], difference))
    return answers


@pytest.mark.parametrize("torch_before_2_13", [False, True], ids=["torch", "torch-2.11"])
def test_stored_weights_shard_with_fsdp2_on_their_rows(tiny, tmp_path, torch_before_2_13):
    """The contract with weight sharding: GGUF blocks and scaled-fp8 weights (per-row scales) are
    plain Parameters FSDP2 shards on dim 0, and the sharded model computes exactly the unsharded one. Before
    torch 2.13 FSDP2 cannot shard GGUF's integer blocks: they stay whole on every rank, the result the same."""
    from spawned import on_ranks
    from backend.test_storage import comfy_scaled_file

    from xdit_backend.distributed import compat

    gguf_path, fp8_path = tmp_path / "flux-q8.gguf", tmp_path / "flux-scaled.safetensors"
    gguf_file(bfl_state_dict(tiny.transformer), gguf_path, GGML.Q8_0)
    comfy_scaled_file(bfl_state_dict(tiny.transformer), fp8_path, per_row=True)
    # torch 2.7's FSDP2 gathers a float8 block as float8, which gloo cannot ("Invalid scalar type"; from 2.8 a block
    # gathers as bytes): there the scaled-fp8 file is left to NCCL (the GPU selftest's nccl section)
    paths = [str(gguf_path)] + ([str(fp8_path)] if compat.fsdp_shards_mixed_dtypes() else [])
    for answers in on_ranks(sharded_against_whole, 2, paths, torch_before_2_13):
        (q8, q8_rows, q8_difference), *scaled = answers
        assert q8.startswith("gguf Q8_0")
        whole = torch_before_2_13 or not compat.fsdp_shards_integer_parameters()  # this torch, or one made to act so
        assert q8_rows == (64 if whole else 32)
        assert q8_difference == 0
        for fp8, fp8_rows, fp8_difference in scaled:
            assert fp8 == "float8_e4m3fn scaled"
            assert fp8_rows == 32  # half of to_q's 64 output rows on each rank
            assert fp8_difference == 0


def test_a_pipefusion_stage_of_a_gguf_file_reads_only_its_blocks(tiny, tmp_path):
    from xdit_backend.parallel.pipefusion import keep_stage

    path = tmp_path / "flux-q8.gguf"
    gguf_file(bfl_state_dict(tiny.transformer), path, GGML.Q8_0)
    stage = registry.build(str(path), CPU, blocks=(1, 4))
    unread = {k.split(".")[0] + "." + k.split(".")[1] for k, p in stage.transformer.named_parameters() if p.is_meta}
    assert unread == {"transformer_blocks.0", "single_transformer_blocks.2", "single_transformer_blocks.3",
                      "single_transformer_blocks.4"}
    whole = registry.build(str(path), CPU).transformer
    kept = keep_stage(stage.transformer, stage.spec.stage_plan, 1, 4)
    names = ("transformer_blocks.1", "single_transformer_blocks.0", "single_transformer_blocks.1")
    for block, name in zip(kept, names):
        expected = whole.get_submodule(name).state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in block.state_dict().items()), name
        assert block.attn.to_q.weight.dtype == torch.uint8


def test_the_fit_check_counts_a_gguf_files_blocks_as_stored(tiny, tmp_path):
    """Before loading, the memory model sizes a GGUF file's weights by the bytes its quantized blocks
    take, not at the compute dtype: counted against the loaded model's parameters."""
    path = tmp_path / "flux-Q8_0.gguf"
    gguf_file(bfl_state_dict(tiny.transformer), path, GGML.Q8_0)
    estimate = memory_fit.needed(resolve_model(str(path)), torch.float32, "default", 1, None, tokens_per_rank=16,
                                 rows=1)
    loaded = registry.build(str(path), CPU).transformer
    held = sum(p.numel() * p.element_size() for p in loaded.parameters())
    assert abs(estimate.weights_resident - held) <= 0.05 * held, (estimate.weights_resident, held)


@pytest.mark.parametrize("name", ["wan-i2v-tiny", "wan-ti2v-tiny"])
def test_a_wan_image_to_video_gguf_file_loads_as_its_variant_and_matches_the_dequantised_model(tmp_path, name):
    """Wan 2.1 I2V (36 input channels, the CLIP image embedder) and TI2V-5B (48) as Q8_0 GGUF files: read as their
    variant, the image embedder's and blocks' matrices kept as raw blocks, the forward that of the dequantised
    weights, the concatenated channels and image tokens included."""
    from unit.test_wan_checkpoint import original_state_dict

    built = registry.build(name, CPU)
    path = tmp_path / f"{name}-Q8_0.gguf"
    reference = written_gguf(original_state_dict(built.transformer), path, "Q8_0",
                             plain=lambda key, value: value.dim() != 2)
    save_file(reference, str(tmp_path / "reference.safetensors"))
    expected = registry.build(str(tmp_path / "reference.safetensors"), CPU)
    assert registry.resolve(str(path)).config == registry.resolve(str(tmp_path / "reference.safetensors")).config
    loaded = registry.build(str(path), CPU)
    assert loaded.spec.concat_channels == expected.spec.concat_channels
    stored = {n for n, m in loaded.transformer.named_modules() if isinstance(m, StoredLinear)}
    assert "blocks.0.attn1.to_q" in stored
    spec = loaded.spec
    shape = spec.latent_shape(1, 64, 64, 5)
    positive, _ = registry.random_conditioning(name, 1, 3, spec, latent=shape)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out, want = (model.output(x, torch.tensor([700.0]), positive, None) for model in (loaded, expected))
    assert (out - want).abs().max() <= 1e-5 * max(1.0, want.abs().max())
