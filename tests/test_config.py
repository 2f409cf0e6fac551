"""ParallelConfig rules, each checked by the message a user would read, and the auto policy."""

import pytest

from xdit_backend.config import ConfigError, ModelFacts, ParallelConfig, RequestFacts

FLUX_TINY = ModelFacts("flux-tiny", heads=4, supports=frozenset({"dp", "cfg", "ring", "ulysses"}))
FLUX_DEV = ModelFacts("flux-dev", heads=24, supports=frozenset({"dp", "cfg", "ring", "ulysses"}))
SERIAL_ONLY = ModelFacts("serial-only", heads=4, supports=frozenset())
TWO_PASSES = RequestFacts(batch=2, image_tokens=4096, cfg_scale=3.5, has_negative=True)
ONE_PASS = RequestFacts(batch=1, image_tokens=4096, cfg_scale=1.0, has_negative=False)


def refused(config: ParallelConfig, world=2, model=FLUX_TINY, request=TWO_PASSES, devices="2 ranks on cpu"):
    with pytest.raises(ConfigError) as info:
        config.validate(world, model, request, devices)
    return info.value


def test_world_size_rule_lists_every_factor_the_devices_and_two_fixes():
    error = refused(ParallelConfig(ulysses=4), world=2)
    assert "multiply to 4 (dp=1 × cfg=1 × pipefusion=1 × ring=1 × ulysses=4)" in error.message
    assert "the backend runs 2 ranks (2 ranks on cpu)" in error.message
    assert "set ulysses=2" in error.hint and "--nproc 4" in error.hint


def test_cfg_degree_is_one_or_two():
    error = refused(ParallelConfig(cfg=4), world=4)
    assert "cfg=4" in error.message and "1 or 2" in error.message


def test_cfg_parallel_without_two_passes_is_refused_with_sequence_parallel_as_the_way_out():
    error = refused(ParallelConfig(cfg=2), request=ONE_PASS)
    assert "no negative prompt" in error.message
    assert "ulysses=2" in error.hint
    error = refused(ParallelConfig(cfg=2), request=RequestFacts(1, 4096, 1.0, True))
    assert "cfg scale is 1" in error.message and "Flux-dev" in error.message
    assert "cfg scale is 0.5" in refused(ParallelConfig(cfg=2), request=RequestFacts(1, 4096, 0.5, True)).message


def test_heads_must_divide_by_ulysses():
    error = refused(ParallelConfig(ulysses=3), world=3)
    assert "ulysses=3 does not divide the 4 attention heads" in error.message
    assert "[1, 2, 4]" in error.hint


def test_image_tokens_must_divide_by_the_sequence_degree():
    error = refused(ParallelConfig(ring=2, ulysses=2), world=4, request=RequestFacts(2, 4098, 3.5, True))
    assert "ring × ulysses = 4 does not divide the 4098 image tokens" in error.message
    assert "not padded" in error.message


def test_text_tokens_of_a_joint_model_must_divide_by_the_sequence_degree():
    """A joint model's prompt is split with the image: the rule names the text count and the degrees that fit."""
    prompt_154 = RequestFacts(batch=1, image_tokens=4096, cfg_scale=1.0, has_negative=False, text_tokens=154)
    error = refused(ParallelConfig(ulysses=4), world=4, request=prompt_154)
    assert "ring × ulysses = 4 does not divide the 154 text tokens" in error.message
    assert "[1, 2]" in error.hint and "cfg, dp or pipefusion" in error.hint
    ParallelConfig(ulysses=2).validate(2, FLUX_TINY, prompt_154)


def test_auto_keeps_the_sequence_degree_within_what_the_text_allows():
    """154 text tokens allow ulysses=2 on 4 ranks; the other factor goes to data parallel."""
    request = RequestFacts(batch=2, image_tokens=4096, cfg_scale=1.0, has_negative=False, text_tokens=154)
    config, why = ParallelConfig.auto(4, FLUX_TINY, request)
    assert (config.ulysses, config.ring, config.dp) == (2, 1, 2), why
    with pytest.raises(ConfigError) as error:
        ParallelConfig.auto(4, FLUX_TINY, RequestFacts(1, 4096, 1.0, False, text_tokens=154))
    assert "154 text tokens" in error.value.message and "a prompt of a length that 4 divides" in error.value.hint


def test_batch_must_divide_by_dp():
    error = refused(ParallelConfig(dp=2), request=RequestFacts(3, 4096, 3.5, True))
    assert "dp=2 does not divide the batch of 3" in error.message


def test_degrees_are_positive():
    assert "at least 1" in refused(ParallelConfig(ring=0), world=0).message


def test_a_family_without_the_method_is_refused_by_name():
    error = refused(ParallelConfig(ring=2), model=SERIAL_ONLY)
    assert "serial-only does not support ring" in error.message


def test_unknown_or_non_integer_settings_are_refused():
    with pytest.raises(ConfigError, match="unknown parallel settings"):
        ParallelConfig.from_json({"ulysess": 2})
    with pytest.raises(ConfigError, match="whole number"):
        ParallelConfig.from_json({"ulysses": "2"})


@pytest.mark.parametrize("world,model,request_facts,expected", [
    (1, FLUX_TINY, TWO_PASSES, ParallelConfig()),
    (2, FLUX_TINY, TWO_PASSES, ParallelConfig(cfg=2)),
    (2, FLUX_TINY, ONE_PASS, ParallelConfig(ulysses=2)),
    (4, FLUX_TINY, TWO_PASSES, ParallelConfig(cfg=2, ulysses=2)),
    (4, FLUX_TINY, ONE_PASS, ParallelConfig(ulysses=4)),
    (8, FLUX_TINY, TWO_PASSES, ParallelConfig(cfg=2, ulysses=4)),
    (8, FLUX_TINY, ONE_PASS, ParallelConfig(ulysses=4, ring=2)),
    (8, FLUX_DEV, ONE_PASS, ParallelConfig(ulysses=8)),
    (8, FLUX_DEV, RequestFacts(8, 4092, 1.0, False), ParallelConfig(ulysses=4, dp=2)),
], ids=["w1", "w2-cfg", "w2-no-cfg", "w4-cfg", "w4-no-cfg", "w8-cfg", "w8-heads-then-ring", "w8-dev",
        "w8-tokens-limit-then-dp"])
def test_auto_policy(world, model, request_facts, expected):
    """CFG first when there are two passes, Ulysses as far as heads and tokens allow, Ring, then dp."""
    config, why = ParallelConfig.auto(world, model, request_facts)
    assert config == expected
    config.validate(world, model, request_facts)  # what auto picks always passes validation
    assert why


def test_auto_says_when_nothing_fits():
    with pytest.raises(ConfigError, match="no layout of 3 ranks"):
        ParallelConfig.auto(3, FLUX_TINY, RequestFacts(1, 4096, 1.0, False))


# ----------------------------------------------------------------------------- PipeFusion

FLUX_TINY_PF = ModelFacts("flux-tiny", heads=4, supports=frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"}),
                          blocks=7)
GRID = RequestFacts(batch=1, image_tokens=8 * 4, cfg_scale=1.0, has_negative=False, token_rows=4)  # 128×64


def pf_refused(config: ParallelConfig, world=2, request=GRID):
    return refused(config, world=world, model=FLUX_TINY_PF, request=request)


def test_pipefusion_stages_at_most_blocks():
    assert "pipefusion=8 stages, but flux-tiny has 7 blocks" in pf_refused(ParallelConfig(pipefusion=8), 8).message


def test_pipefusion_block_counts_must_sum_to_the_blocks():
    error = pf_refused(ParallelConfig(pipefusion=2, pipefusion_blocks=(3, 3)))
    assert "summing to the 7 blocks" in error.message and "they sum to 6" in error.message


def test_pipefusion_patches_are_bands_of_token_rows():
    error = pf_refused(ParallelConfig(pipefusion=2, num_pipeline_patch=5))
    assert "num_pipeline_patch=5" in error.message and "4 rows" in error.message and "1..4" in error.hint


def test_pipefusion_warmup_is_not_negative():
    assert "warmup_steps=-1" in pf_refused(ParallelConfig(pipefusion=2, warmup_steps=-1)).message


def test_pipefusion_patch_must_split_over_the_sequence_ranks():
    request = RequestFacts(1, 3 * 4, 1.0, False, token_rows=4)  # 3 tokens per row
    error = pf_refused(ParallelConfig(pipefusion=2, ulysses=2, num_pipeline_patch=4), world=4, request=request)
    assert "a patch of 3 tokens does not split into ring × ulysses = 2" in error.message


def test_pipefusion_is_refused_by_name_for_a_family_without_it():
    error = refused(ParallelConfig(pipefusion=2), model=FLUX_TINY)
    assert "flux-tiny does not support pipefusion" in error.message


def test_a_valid_pipefusion_layout_passes():
    ParallelConfig(pipefusion=2, ulysses=2, num_pipeline_patch=4, warmup_steps=0,
                   pipefusion_blocks=(2, 5)).validate(4, FLUX_TINY_PF, GRID)
