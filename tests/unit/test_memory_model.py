"""The written memory model against what is actually held: parameters counted on a tiny model (stored
in bf16 and fp8, and sharded by torch's own FSDP2 over a fake process group of 2 and 4 ranks), GGUF
bytes against the gguf package's quantiser, and the activation formula's scaling with tokens."""

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

from xdit_backend.memory import model as memory_model

# Odd widths (C = 3 heads × 6 = 18 rows, 72 MLP rows): dim 0 is not a multiple of 4, so FSDP2 pads.
ODD = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=6,
           num_attention_heads=3, joint_attention_dim=10, pooled_projection_dim=6, guidance_embeds=True,
           axes_dims_rope=(2, 2, 2))
FP8 = torch.float8_e4m3fn


def odd_flux(matrices: torch.dtype = torch.bfloat16) -> FluxTransformer2DModel:
    """The tiny model in bf16, its matrices (2-D weights) stored in ``matrices``."""
    model = FluxTransformer2DModel(**ODD).to(torch.bfloat16)
    for param in model.parameters():
        if param.dim() >= 2:
            param.data = param.data.to(matrices)
    return model


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's parameters and buffers occupy in this process: each distinct storage once
    (an FSDP2 shard's storage includes its dim-0 padding)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.fixture
def fake_group():
    """A world of ``ranks`` for FSDP2 in this one process (torch's fake process group: no traffic)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(ranks: int, rank: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("matrices, rule", [(torch.bfloat16, 2), (FP8, memory_model.fp8_storage(torch.bfloat16))],
                         ids=["bf16", "fp8"])
def test_unsharded_weight_bytes_are_the_bytes_the_parameters_hold(matrices, rule):
    model = odd_flux(matrices)
    on_meta = FluxTransformer2DModel.from_config(model.config).to("meta")
    estimate = memory_model.estimate(on_meta, storage_bytes_per_value=rule, compute_dtype=torch.bfloat16,
                                     shard_ranks=1, tokens_per_rank=0, rows=1)
    assert estimate.weights_resident == held_bytes(model)
    if matrices == FP8:  # the matrices are at 1 byte a value: well under the bf16 model's bytes
        assert estimate.weights_resident < 0.6 * held_bytes(odd_flux())


@pytest.mark.parametrize("ranks, rank", [(2, 1), (4, 0), (4, 3)])
@pytest.mark.parametrize("matrices, rule", [(torch.bfloat16, 2), (FP8, memory_model.fp8_storage(torch.bfloat16))],
                         ids=["bf16", "fp8"])
def test_sharded_weight_bytes_are_what_fsdp2_keeps_on_a_rank(fake_group, matrices, rule, ranks, rank):
    """torch's fully_shard on every block, the last rank included (its rows are fewer, its storage padded)."""
    from torch.distributed.fsdp import fully_shard

    fake_group(ranks, rank)
    model = odd_flux(matrices)
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        fully_shard(block)
    on_meta = FluxTransformer2DModel.from_config(model.config).to("meta")
    estimate = memory_model.estimate(on_meta, storage_bytes_per_value=rule, compute_dtype=torch.bfloat16,
                                     shard_ranks=ranks, tokens_per_rank=0, rows=1)
    assert estimate.weights_resident == held_bytes(model)
    padded = any(p.shape[0] % ranks for p in on_meta.transformer_blocks.parameters())
    assert padded == (ranks == 4)  # Flux's rows are all even (C = 18): only 4 ranks pad them


def test_sharded_transient_is_the_two_largest_gathered_blocks_whole():
    """With prefetch, two whole blocks (the running one and the next) at their storage precision."""
    model = odd_flux()
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    largest = max(sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks)
    on_meta = model.to("meta")
    estimate = memory_model.estimate(on_meta, storage_bytes_per_value=2, compute_dtype=torch.bfloat16,
                                     shard_ranks=4, tokens_per_rank=0, rows=1)
    assert estimate.weights - estimate.weights_resident == 2 * largest


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_bytes_match_the_gguf_quantiser(qtype):
    """A block matrix occupies what the gguf package says a tensor of its shape takes at ``qtype``
    (rows a whole number of blocks: 256 values for Q4_K); Q8_0 quantised for real (the package's
    Python quantiser has no K-quants)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    with torch.device("meta"):
        model = FluxTransformer2DModel(**{**ODD, "num_attention_heads": 2, "attention_head_dim": 128,
                                          "axes_dims_rope": (16, 56, 56)})
    rule = memory_model.gguf_storage(qtype, torch.bfloat16, memory_model.block_lists(model))
    name = "transformer_blocks.0.ff.net.0.proj.weight"  # [1024, 256]
    param = model.get_parameter(name)
    kind = gguf.GGMLQuantizationType[qtype]
    byte_shape = gguf.quants.quant_shape_to_byte_shape(tuple(param.shape), kind)  # [rows, bytes a row]
    assert rule(name, param) * param.numel() == byte_shape[0] * byte_shape[1]
    if qtype == "Q8_0":
        values = np.random.default_rng(0).standard_normal(tuple(param.shape), dtype=np.float32)
        assert gguf.quants.quantize(values, kind).nbytes == byte_shape[0] * byte_shape[1]
    assert rule("transformer_blocks.0.ff.net.0.proj.bias", model.get_parameter(
        "transformer_blocks.0.ff.net.0.proj.bias")) == 2  # 1-D: not quantised, held in bf16
    assert rule("x_embedder.weight", model.get_parameter("x_embedder.weight")) == 2  # an input layer


def test_activations_grow_linearly_with_tokens_at_the_architectures_width():
    """Per token, Flux's block holds 3·C residual + 3·C Q/K/V + C attention out + 2·4C MLP (GELU in
    and out) = 15·C values: the same slope at every token count, in the compute dtype's bytes."""
    with torch.device("meta"):
        model = FluxTransformer2DModel(**ODD)
    c = ODD["num_attention_heads"] * ODD["attention_head_dim"]

    def at(tokens, dtype=torch.bfloat16, rows=1, **kw):
        return memory_model.estimate(model, storage_bytes_per_value=2, compute_dtype=dtype, shard_ranks=1,
                                     tokens_per_rank=tokens, rows=rows, **kw)

    values = [at(t).activations for t in (0, 1000, 2000, 4000)]
    assert values == sorted(values) and len(set(values)) == 4
    assert values[2] - values[1] == values[1] - values[0] == (values[3] - values[2]) // 2 == 1000 * 15 * c * 2
    assert at(1000, torch.float32).activations - at(0, torch.float32).activations == 1000 * 15 * c * 4
    assert at(2000, rows=2).activations == 2 * at(2000).activations
    fused = [at(t).workspace for t in (1000, 2000)]
    assert fused[1] == 2 * fused[0]  # the log-sum-exp: linear in tokens
    math_path = [at(t, attention="math").workspace for t in (1000, 2000)]
    assert math_path[1] == 4 * math_path[0]  # the score matrix: quadratic


def test_nonsense_arguments_are_refused():
    with torch.device("meta"):
        model = FluxTransformer2DModel(**ODD)
    with pytest.raises(ValueError, match="shard_ranks=0"):
        memory_model.estimate(model, storage_bytes_per_value=2, compute_dtype=torch.bfloat16, shard_ranks=0,
                              tokens_per_rank=1, rows=1)
    with pytest.raises(ValueError, match="Q9_9"):
        memory_model.gguf_storage("Q9_9", torch.bfloat16, ())


def test_the_tables_architectures_have_their_published_sizes():
    """bench memory's premise: each full-size architecture, built on the meta device from the config the
    table cites, has the parameter count its makers publish (12, 32, 8.9, 20, 14, 8.3, 19, 22, 7 and 33 billion)."""
    from xdit_backend.bench.memory_table import ARCHITECTURES

    published = {"Flux.1-dev": 12e9, "Flux.2-dev": 32e9, "Chroma1-HD": 8.9e9, "Qwen-Image": 20e9,
                 "Wan 2.2 A14B (one expert)": 14e9, "HunyuanVideo 1.5": 8.3e9, "LTX-2.0": 19.6e9,
                 "LTX-2.3": 21e9, "Qwen-Image 2.1": 7e9, "MiniMax-H3": 33e9}  # "19 B" and "22 B" published: 18.9 B of blocks and 0.7 B of text connectors (in
    # ComfyUI's diffusion model); 2.3's 22 B counts its text projections too (1.16 B), which ComfyUI's text encoder runs
    counted = {a.name: sum(p.numel() for p in a.build_on_meta().parameters()) for a in ARCHITECTURES}
    assert counted.keys() == published.keys()
    assert {name: round(n / published[name], 2) for name, n in counted.items()} == {
        name: pytest.approx(1.0, abs=0.03) for name in published}


def test_activations_are_what_a_flux_forward_holds_at_its_peak():
    """The formula against torch's MemTracker: the peak bytes of live tensors during one serial Flux
    forward (width 256, 1 double + 1 single block, 1024 image + 64 text tokens, float32), within 15 %."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=64,
                  num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True,
                  axes_dims_rope=(8, 28, 28))
    model = FluxTransformer2DModel(**config)
    g = torch.Generator().manual_seed(0)
    image, text = 1024, 64
    inputs = dict(hidden_states=torch.randn(1, image, 64, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 64, generator=g),
                  pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                  img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3), guidance=torch.tensor([3.5]))
    tracker = MemTracker()
    with torch.no_grad(), tracker:
        model(**inputs)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    measured = peak["Total"] - sum(v for k, v in peak.items() if getattr(k, "name", "") in ("PARAM", "BUFFER"))
    estimate = memory_model.estimate(model.to("meta"), storage_bytes_per_value=4, compute_dtype=torch.float32,
                                     shard_ranks=1, tokens_per_rank=image + text, rows=1)
    assert estimate.activations + estimate.workspace == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize("name, exact", [("flux-tiny", True), ("wan-tiny", True), ("hunyuan-dit-tiny", True),
                                         ("sd3-tiny", False)])
def test_pipefusion_adds_the_k_and_v_its_stages_buffers_hold(name, exact):
    """Under PipeFusion a stage keeps K and V over the whole sequence in every attention module its family's plan
    gives a stale-K/V processor (parallel/stale_kv.py): the buffers, filled for a request, hold what the estimate
    adds to the activations — for the heaviest stage, every sequence rank holding all tokens. A bound where blocks
    differ: sd3-tiny's one dual-attention block (two buffers) is counted for every block of the stage (SD3.5
    medium's 13 dual blocks fill its first stage, where the bound is exact)."""
    from xdit_backend.models.resolved import resolve_model
    from xdit_backend.parallel import stale_kv
    from xdit_backend.parallel.pipefusion import keep_stage

    model = resolve_model(name).build(torch.device("cpu"), torch.float32)
    plan, transformer = model.spec.stage_plan, model.transformer
    blocks = sum(len(getattr(transformer, n)) for n in plan.block_lists)
    rows, tokens, stages, ulysses = 2, 24, 2, 2
    chunk = stale_kv.Chunk()
    chunk.describe(0, 0, (1, 4, tokens * ulysses // 4), (0, 4))  # every token of every sequence rank
    estimate = {s: memory_model.estimate(transformer, storage_bytes_per_value=4, compute_dtype=torch.float32,
                                         shard_ranks=1, tokens_per_rank=tokens, rows=rows, stages=s, ulysses=ulysses,
                                         stale_buffers=plan.buffers_per_block(transformer))
                for s in (1, stages)}
    heaviest = keep_stage(transformer, plan, 0, -(-blocks // stages))  # the first stage: ⌈blocks / stages⌉
    assert len(heaviest) == -(-blocks // stages)
    buffers = {}
    stale_kv.attach(transformer, plan, chunk, None, None, buffers)
    held = 0
    for module_name, buffer in buffers.items():
        module = transformer.get_submodule(module_name)
        like = torch.zeros(rows, chunk.total, module.heads, transformer.config.attention_head_dim)
        buffer.write_rows(chunk, like, like)
        held += buffer.k.nbytes + buffer.v.nbytes
    added = estimate[stages].activations - estimate[1].activations
    assert held > 0
    assert added == held if exact else held < added <= 2 * held
