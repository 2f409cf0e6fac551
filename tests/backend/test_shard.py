"""Weight sharding (FSDP2, parallel/shard.py): exact in every layout, 1/S of the blocks per rank, counted gathers."""

import math

import pytest
import torch
from conftest import flux_tiny_conditioning, serial_of

from xdit_backend.distributed.config import ConfigError, MemoryFit, ModelFacts, ParallelConfig, RequestFacts
from xdit_backend.models import registry

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 128, "height": 64, "steps": 3, "seed": 21, "cfg": 3.5, "batch": 2}

# (world, degrees): sharded runs compared with the serial latent
PARITY = [
    (2, {"ulysses": 2}),
    (2, {"ring": 2}),
    (2, {"cfg": 2}),
    (2, {"dp": 2}),
    (4, {"ulysses": 2, "ring": 2}),
]
# PipeFusion is approximate by design (stale K/V): sharded equals the same layout unsharded
PIPEFUSION = {"pipefusion": 2, "ulysses": 2, "warmup_steps": 1}


@pytest.fixture(scope="module")
def conditioning():
    return flux_tiny_conditioning()


@pytest.fixture(scope="module")
def serial(conditioning):
    """The serial latent, computed in this process by the world-1 code path."""
    return serial_of(FIELDS, conditioning)


@pytest.fixture(scope="module")
def blocks():
    """flux-tiny's blocks (float32, as the requests run) and the parameters outside them, counted here."""
    model = registry.build("flux-tiny", torch.device("cpu"))
    transformer = model.transformer
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    inside = {id(p) for block in blocks for p in block.parameters()}
    outside = sum(p.numel() * p.element_size() for p in transformer.parameters() if id(p) not in inside)
    return blocks, outside


def shard_bytes(blocks, ranks: int) -> int:
    """A rank's share of the blocks: ⌈rows/S⌉ rows of each parameter (FSDP2 pads dim 0 to a multiple of S)."""
    return sum(math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0]) * p.element_size()
               for block in blocks for p in block.parameters())


def run(client, degrees, conditioning, **extra):
    return client.sample({**FIELDS, **extra, "parallel": degrees}, conditioning)


@pytest.mark.parametrize("case", PARITY, ids=lambda case: "x".join(f"{k}{v}" for k, v in case[1].items()))
def test_sharded_layout_equals_serial(case, serial, conditioning, blocks, request):
    """The latent equals serial; each rank holds ≤ 1/S of the blocks (+ padding) plus the whole other layers."""
    world, degrees = case
    client = request.getfixturevalue(f"backend{world}")
    result, info = run(client, {**degrees, "shard_weights": True}, conditioning, profile=True)
    assert "weights sharded" in info["layout"]
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= TOLERANCE, f"{degrees}: max |sharded − serial| = {difference:.3g}"
    block_list, outside = blocks
    whole = sum(p.numel() * p.element_size() for b in block_list for p in b.parameters()) + outside
    for record in info["profile"]:
        resident = record["resident_parameter_bytes"]
        assert resident <= shard_bytes(block_list, world) + outside, record
        assert resident < whole


def test_sharded_pipefusion_equals_it_unsharded(backend4, conditioning, blocks):
    """Sharded over each stage's two ranks, PipeFusion gives what it gives unsharded; a stage gathers its
    own blocks once per chunk it runs (the whole latent in the warm-up step, then each patch)."""
    from xdit_backend.parallel.pipefusion import stage_bounds

    unsharded, _ = run(backend4, PIPEFUSION, conditioning)
    sharded, info = run(backend4, {**PIPEFUSION, "shard_weights": True}, conditioning, profile=True)
    assert "weights sharded 2 ways" in info["layout"]
    difference = (sharded["samples"] - unsharded["samples"]).abs().max().item()
    assert difference <= TOLERANCE
    block_list, _ = blocks
    bounds = stage_bounds(registry.block_sizes("flux-tiny"), 2)
    chunks = 1 + (FIELDS["steps"] - 1) * 2  # warm-up 1, then 2 patches (the default: as many as stages)
    for record in info["profile"]:
        start, end = bounds[record["rank"] // 2]  # ranks [0, 1] run stage 0, [2, 3] stage 1
        per_chunk = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * p.element_size()
                        for block in block_list[start:end] for p in block.parameters())
        assert record["sent_bytes"]["shard_all_gather"] == per_chunk * chunks, record["rank"]


def test_gathered_bytes_equal_the_formula(backend2, conditioning, blocks):
    """Each rank sends (S − 1)·⌈rows/S⌉·bytes per row per parameter, once per block per model call."""
    _, info = run(backend2, {"ulysses": 2, "shard_weights": True}, conditioning, profile=True)
    block_list, _ = blocks
    per_pass = sum((2 - 1) * math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * p.element_size()
                   for block in block_list for p in block.parameters())
    for record in info["profile"]:  # euler: one model call per step
        assert record["sent_bytes"]["shard_all_gather"] == per_pass * FIELDS["steps"]
        assert record["shard_bytes_per_pass"] == per_pass


def test_unsharded_layouts_gather_nothing(backend2, conditioning):
    _, info = run(backend2, {"ulysses": 2}, conditioning, profile=True)
    assert all("shard_all_gather" not in record["sent_bytes"] for record in info["profile"])


# ---------------------------------------------------------------- the option and auto (no processes)

FLUX = ModelFacts("flux-tiny", heads=4, supports=frozenset({"cfg", "ulysses", "ring", "dp", "pipefusion"}), blocks=7)
REQUEST = RequestFacts(batch=2, image_tokens=32, cfg_scale=3.5, has_negative=True, token_rows=4)


def test_sharding_one_rank_is_refused():
    with pytest.raises(ConfigError, match="one rank would keep all of it"):
        ParallelConfig(shard_weights=True).validate(1, FLUX, REQUEST)


def test_sharding_a_stage_of_one_rank_is_refused():
    with pytest.raises(ConfigError, match="each stage's blocks are held by one rank"):
        ParallelConfig(pipefusion=2, shard_weights=True).validate(2, FLUX, REQUEST)


def test_shard_weights_travels_in_the_layout_json():
    config = ParallelConfig(ulysses=2, shard_weights=True)
    assert ParallelConfig.from_json(config.to_json()) == config
    assert "shard_weights" not in ParallelConfig(ulysses=2).to_json()  # unsharded layouts' JSON is unchanged
    with pytest.raises(ConfigError, match="true or false"):
        ParallelConfig.from_json({"ulysses": 2, "shard_weights": 1})


def test_auto_shards_only_when_the_weights_would_not_fit():
    fits = MemoryFit(weight_bytes=10 * 2**30, free_bytes=20 * 2**30)
    config, why = ParallelConfig.auto(2, FLUX, REQUEST, memory=lambda config: fits)
    assert not config.shard_weights
    tight = MemoryFit(weight_bytes=24 * 2**30, free_bytes=20 * 2**30)
    config, why = ParallelConfig.auto(2, FLUX, REQUEST, memory=lambda config: tight)
    assert config.shard_weights and "weights sharded 2 ways" in why and "24.0 GiB" in why
    config, _ = ParallelConfig.auto(1, FLUX, REQUEST, memory=lambda config: tight)  # nothing to share with
    assert not config.shard_weights


def sample_args(*flags):
    from xdit_backend import cli

    parser = cli.build_parser()
    return cli.sample_fields(parser.parse_args(["sample", "--model", "flux-tiny", "--out", "o.safetensors", *flags]))


def test_the_cli_flag_asks_for_sharding_with_degrees_only():
    assert sample_args("--ulysses", "2", "--shard-weights")["parallel"] == {"ulysses": 2, "shard_weights": True}
    with pytest.raises(SystemExit, match="--shard-weights goes with degrees"):
        sample_args("--shard-weights")


# ---------------------------------------------------------------- storage dtypes: one block, several dtypes

class MixedBlock(torch.nn.Module):
    """A block as an fp8 file keeps it: float8 matrices upcast at compute, a bf16 norm weight, float32 biases."""

    def __init__(self, width: int):
        super().__init__()
        self.proj = torch.nn.Linear(width, 3 * width)  # 3·width output rows: dim 0 shards unevenly at S = 4
        self.out = torch.nn.Linear(3 * width, width)
        for linear in (self.proj, self.out):
            linear.weight = torch.nn.Parameter(linear.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.rand(width).to(torch.bfloat16), requires_grad=False)

    def forward(self, x):
        x = x * self.norm.float()
        hidden = torch.nn.functional.linear(x, self.proj.weight.float(), self.proj.bias)
        return x + torch.nn.functional.linear(torch.relu(hidden), self.out.weight.float(), self.out.bias)


class MixedTransformer(torch.nn.Module):
    def __init__(self, width: int = 10, blocks: int = 3):
        super().__init__()
        self.embed = torch.nn.Linear(width, width)  # outside the blocks: stays whole
        self.blocks = torch.nn.ModuleList(MixedBlock(width) for _ in range(blocks))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def _sharded_mixed_dtypes(rank: int) -> dict:
    from types import SimpleNamespace

    from torch.distributed.device_mesh import init_device_mesh

    from xdit_backend.parallel import shard, traffic

    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    transformer = MixedTransformer().requires_grad_(False)
    x = torch.randn(2, 10)
    with torch.no_grad():
        expected = transformer(x)
        by_blocks = transformer.embed(x)
    whole = {name: (p.dtype, p.numel() * p.element_size(), p.shape[0]) for name, p in transformer.named_parameters()}
    # each call of a block: every rank sends its ⌈rows/S⌉ rows of each parameter to the S − 1 others
    per_pass = sum((world - 1) * math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
                   for p in transformer.blocks.parameters())
    model = SimpleNamespace(transformer=transformer, spec=SimpleNamespace(stage_plan=SimpleNamespace(block_lists=("blocks",))))
    shard.shard_blocks(model, init_device_mesh("cpu", (world,)), torch.device("cpu"))
    order = []  # the first pass: each all-gather, and each block's start (after FSDP's own pre-hook)
    for index, block in enumerate(transformer.blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: order.append(f"run {index}"))
    with torch.no_grad(), traffic.counting(False) as sent:
        gather = torch.distributed.all_gather_single  # traffic's counting wrapper

        def logged(*args, **kwargs):
            order.append("gather")
            return gather(*args, **kwargs)

        torch.distributed.all_gather_single = logged
        through_root = transformer(x)
        torch.distributed.all_gather_single = gather
        for block in transformer.blocks:  # as PipeFusion calls them: without the transformer's forward
            by_blocks = block(by_blocks)
    local = {name: (p.dtype, shard.resident_bytes(torch.nn.ParameterList([p]))) for name, p in transformer.named_parameters()}
    return {"root": (through_root - expected).abs().max().item(), "blocks": (by_blocks - expected).abs().max().item(),
            "whole": whole, "local": local, "sent": sent["shard_all_gather"], "order": order,
            "formula": 2 * per_pass}  # two passes: through the transformer, then block by block


def test_a_block_of_fp8_bf16_and_fp32_parameters_shards_and_gathers_exactly():
    """FSDP2 gathers a block's float8, bf16 and float32 parameters together (one collective, as bytes):
    the output is exact, each rank keeps its rows at their own dtype, and the layers outside stay whole."""
    from spawned import on_ranks

    for result in on_ranks(_sharded_mixed_dtypes, 2):
        assert result["root"] == 0 and result["blocks"] == 0
        for name, (dtype, size, rows) in result["whole"].items():
            local_dtype, local_size = result["local"][name]
            assert local_dtype == dtype
            if name.startswith("blocks."):
                assert local_size == math.ceil(rows / 2) * (size // rows), name  # its half of the rows
            else:
                assert local_size == size, name
        assert result["sent"] == result["formula"] > 0
        # forward prefetch: block i + 1's gather is issued before block i runs
        assert result["order"][:6] == ["gather", "gather", "run 0", "gather", "run 1", "run 2"]  # the first pass


def test_compiled_blocks_run_sharded(backend2, serial, conditioning):
    """compile.py's compiled block forward runs between FSDP2's eager hooks (gather, then free)."""
    result, _ = run(backend2, {"ulysses": 2, "shard_weights": True}, conditioning, compile=True)
    assert (result["samples"] - serial).abs().max().item() <= TOLERANCE


def test_after_a_failed_request_the_sharded_model_is_sharded_again_over_the_new_groups(backends, monkeypatch):
    """A simulated out-of-memory in rank 1's 3rd model call: the failure destroys the layout's groups,
    the shard group with them, so the next request shards the model anew over the rebuilt mesh and
    gives the unsharded latent. (On gloo a destroyed group's object still runs collectives, so this
    checks the path and the result; what the re-sharding prevents is NCCL's: aborted communicators.)"""
    from conftest import SMALL

    from xdit_backend.client import BackendError

    monkeypatch.setenv("XDIT_TEST_FAULT", "1:3")
    client = backends.start(2, collective_timeout=10.0, heartbeat=4.0)
    fields = {**SMALL, "steps": 4, "parallel": {"ulysses": 2, "shard_weights": True}}
    with pytest.raises(BackendError, match="simulated"):
        client.sample(fields)
    fields["steps"] = 2  # two model calls: the rebuilt model's fault hook (its own count) does not reach its 3rd
    result, info = client.sample(fields)
    assert "weights sharded 2 ways" in info["layout"]
    whole, _ = client.sample({**fields, "parallel": {"ulysses": 2}})
    assert (result["samples"] - whole["samples"]).abs().max() <= TOLERANCE
