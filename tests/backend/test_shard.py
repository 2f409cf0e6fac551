"""Weight sharding (FSDP2, parallel/shard.py) through a backend: counted gathers, PipeFusion's stages sharded,
and a failure's rebuilt groups (every sharded layout against serial: test_parity.py)."""

import math

import pytest
import torch
import parity

from xdit_backend.models import registry
from xdit_backend.models.resolved import resolve_model

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 128, "height": 64, "steps": 3, "seed": 21, "cfg": 3.5, "batch": 2}
# PipeFusion is approximate by design (stale K/V): sharded equals the same layout unsharded
PIPEFUSION = {"pipefusion": 2, "ulysses": 2, "warmup_steps": 1}


@pytest.fixture(scope="module")
def conditioning():
    return parity.conditioning("flux")


@pytest.fixture(scope="module")
def blocks():
    """flux-tiny's blocks (float32, as the requests run) and the parameters outside them, counted here."""
    model = registry.build("flux-tiny", torch.device("cpu"))
    transformer = model.transformer
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    inside = {id(p) for block in blocks for p in block.parameters()}
    outside = sum(p.numel() * p.element_size() for p in transformer.parameters() if id(p) not in inside)
    return blocks, outside


def run(client, degrees, conditioning, **extra):
    return client.sample({**FIELDS, **extra, "parallel": degrees}, conditioning)


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
    bounds = stage_bounds(resolve_model("flux-tiny").block_sizes, 2)
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
