"""Weight sharding (FSDP2) of one block whose parameters have several storage dtypes, on a spawned world of 2."""

import math

import pytest
import torch

from xdit_backend.distributed import compat


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
    from xdit_backend.distributed import compat

    whole_too = set() if compat.fsdp_shards_mixed_dtypes() else \
        {id(p) for block in transformer.blocks for p in shard.minor_dtype_parameters(block)}  # torch 2.7
    per_pass = sum((world - 1) * math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
                   for p in transformer.blocks.parameters() if id(p) not in whole_too)
    kept_whole = sorted(name for name, p in transformer.named_parameters() if id(p) in whole_too)
    model = SimpleNamespace(transformer=transformer, spec=SimpleNamespace(stage_plan=SimpleNamespace(block_lists=("blocks",))))
    shard.shard_blocks(model, init_device_mesh("cpu", (world,)), torch.device("cpu"))
    order = []  # the first pass: each all-gather, and each block's start (after FSDP's own pre-hook)
    for index, block in enumerate(transformer.blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: order.append(f"run {index}"))
    with torch.no_grad(), traffic.counting(False) as sent:
        name = compat.single_tensor_all_gathers()[0]  # the one FSDP2 calls on this torch
        gather = getattr(torch.distributed, name)  # traffic's counting wrapper

        def logged(*args, **kwargs):
            order.append("gather")
            return gather(*args, **kwargs)

        setattr(torch.distributed, name, logged)
        through_root = transformer(x)
        setattr(torch.distributed, name, gather)
        for block in transformer.blocks:  # as PipeFusion calls them: without the transformer's forward
            by_blocks = block(by_blocks)
    local = {name: (p.dtype, shard.resident_bytes(torch.nn.ParameterList([p]))) for name, p in transformer.named_parameters()}
    return {"root": (through_root - expected).abs().max().item(), "blocks": (by_blocks - expected).abs().max().item(),
            "whole": whole, "local": local, "sent": sent["shard_all_gather"], "order": order,
            "formula": 2 * per_pass, "kept whole": kept_whole}  # two passes: through the transformer, then block by block


@pytest.mark.skipif(not compat.fsdp_shards_mixed_dtypes(), reason="torch 2.7's FSDP2 gathers a float8 block as "
                    "float8, which gloo cannot ('Invalid scalar type'); NCCL can: the GPU selftest's nccl section")
def test_a_block_of_fp8_bf16_and_fp32_parameters_shards_and_gathers_exactly():
    """FSDP2 gathers a block's float8, bf16 and float32 parameters together (one collective, as bytes):
    the output is exact, each rank keeps its rows at their own dtype, and the layers outside stay whole.
    On torch 2.7 (one dtype per FSDP block) the block's bf16 and float32 parameters stay whole too."""
    from spawned import on_ranks

    for result in on_ranks(_sharded_mixed_dtypes, 2):
        assert result["root"] == 0 and result["blocks"] == 0
        for name, (dtype, size, rows) in result["whole"].items():
            local_dtype, local_size = result["local"][name]
            assert local_dtype == dtype
            if name.startswith("blocks.") and name not in result["kept whole"]:
                assert local_size == math.ceil(rows / 2) * (size // rows), name  # its half of the rows
            else:
                assert local_size == size, name
        assert result["sent"] == result["formula"] > 0
        # forward prefetch: block i + 1's gather is issued before block i runs
        assert result["order"][:6] == ["gather", "gather", "run 0", "gather", "run 1", "run 2"]  # the first pass
