"""Weight sharding's option and ``auto`` (no processes; through a backend: tests/backend/test_shard.py)."""

import pytest

from xdit_backend.distributed.config import ConfigError, MemoryFit, ModelFacts, ParallelConfig, RequestFacts
from xdit_backend.errors import UsageError

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
    with pytest.raises(UsageError, match="--shard-weights without degrees"):
        sample_args("--shard-weights")


def test_before_torch_2_13_sharding_a_gguf_model_is_not_counted_as_shrinking_it(monkeypatch):
    """FSDP2 before 2.13 keeps GGUF's integer blocks whole on every rank (compat.py): neither the fit check nor
    auto's weighing may count them as sharded; a safetensors model still shards."""
    from types import SimpleNamespace

    from xdit_backend.distributed import compat
    from xdit_backend.distributed.config import ParallelConfig
    from xdit_backend.parallel import shard
    from xdit_backend.service.leader import Leader

    monkeypatch.setattr(compat, "fsdp_shards_integer_parameters", lambda: False)
    assert not shard.shards_its_matrices(gguf=True) and shard.shards_its_matrices(gguf=False)
    leader = Leader.__new__(Leader)
    leader.memory = [{"rank": 0}]  # a gathered record: auto would weigh sharding
    gguf = SimpleNamespace(source=SimpleNamespace(gguf=True))
    assert leader.memory_fit(None, gguf, ParallelConfig(ulysses=2, shard_weights=True), 0) is None
    monkeypatch.setattr(compat, "fsdp_shards_integer_parameters", lambda: True)
    assert shard.shards_its_matrices(gguf=True)
