"""Any head count and any token count under sequence parallelism: padded heads and padded, masked tokens
give the serial latent (flux-tiny: 4 heads; 272×272 px is 17 × 17 = 289 image tokens, and a prompt of 7
text tokens, which no degree below divides)."""

import pytest
import torch

from conftest import flux_tiny_conditioning, serial_of
from xdit_backend.parallel.sequence import Shard

TOLERANCE = 1e-4
FIELDS = {"model": "flux-tiny", "width": 272, "height": 272, "steps": 2, "seed": 3, "cfg": 3.5, "batch": 1}
CASES = [
    (2, {"ulysses": 2}),  # 289 image tokens, 7 text tokens: one rank holds a padded share of each
    (2, {"ring": 2}),
    (3, {"ulysses": 3}),  # 4 heads padded to 6; 289 and 7 tokens over 3 ranks
    (3, {"ring": 3}),  # three K/V blocks, each with its own padding, in yunchang's ring order
    (4, {"ulysses": 2, "ring": 2}),
    (4, {"ulysses": 4}),  # 7 text tokens over 4 ranks: one rank holds a whole share of padding text
]


@pytest.fixture(scope="module")
def conditioning():
    """A 7-token prompt for flux-tiny, positive and negative."""
    return flux_tiny_conditioning(seed=11, batch=1, text_tokens=7)


@pytest.fixture(scope="module")
def serial(conditioning):
    """The serial latent, computed in this process by the world-1 code path."""
    return serial_of(FIELDS, conditioning)


def case_id(case):
    world, degrees = case
    return f"world{world}-" + "x".join(f"{k}{v}" for k, v in degrees.items())


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_padded_layout_equals_serial(case, serial, conditioning, request):
    world, degrees = case
    client = request.getfixturevalue(f"backend{world}")
    result, info = client.sample({**FIELDS, "parallel": degrees}, conditioning)
    assert info["world_size"] == world
    difference = (result["samples"] - serial).abs().max().item()
    assert difference <= TOLERANCE, f"{case_id(case)}: max |parallel − serial| = {difference:.3g}"


def test_shares_differ_by_at_most_one_token_and_the_gather_drops_the_padding():
    shard = Shard(None, 0, 4)
    assert shard.counts(289) == [73, 72, 72, 72] and shard.share(289) == 73
    assert shard.counts(7) == [2, 2, 2, 1]
    tokens = torch.arange(7.0).view(1, 7, 1)  # [B, S, C]
    shares = [Shard(None, i, 4).cut(tokens, 1, "test", "text") for i in range(4)]
    assert [s.flatten().tolist() for s in shares] == [[0, 1], [2, 3], [4, 5], [6, 0]]
