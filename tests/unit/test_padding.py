"""Any token count under sequence parallelism: shares differ by at most one token, and the gather drops the
padding (the padded layouts against serial: test_parity.py)."""

import torch

from xdit_backend.parallel.sequence import Shard


def test_shares_differ_by_at_most_one_token_and_the_gather_drops_the_padding():
    shard = Shard(None, 0, 4)
    assert shard.counts(289) == [73, 72, 72, 72] and shard.share(289) == 73
    assert shard.counts(7) == [2, 2, 2, 1]
    tokens = torch.arange(7.0).view(1, 7, 1)  # [B, S, C]
    shares = [Shard(None, i, 4).cut(tokens, 1, "test", "text") for i in range(4)]
    assert [s.flatten().tolist() for s in shares] == [[0, 1], [2, 3], [4, 5], [6, 0]]
