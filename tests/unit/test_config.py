"""ParallelConfig rules, each checked by the message a user would read, and the auto policy."""

import pytest

from xdit_backend.distributed.config import DEGREES, ConfigError, ModelFacts, ParallelConfig, RequestFacts

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


def test_ulysses_takes_any_head_count_up_to_the_heads():
    """Heads that ulysses does not divide are padded (parallel/sequence.USPAttention); more ranks than heads
    would leave ranks without a head, and that is refused with a layout that works."""
    ParallelConfig(ulysses=3).validate(3, FLUX_TINY, TWO_PASSES)
    error = refused(ParallelConfig(ulysses=8), world=8)
    assert "ulysses=8 is more than the 4 attention heads" in error.message
    assert "ulysses=4, ring=2" in error.hint


def test_any_token_count_splits_but_every_sequence_rank_needs_a_token():
    """Token counts that ring × ulysses does not divide are padded, image and text alike."""
    ParallelConfig(ring=2, ulysses=2).validate(4, FLUX_TINY, RequestFacts(2, 4098, 3.5, True, text_tokens=154))
    error = refused(ParallelConfig(ring=2, ulysses=2), world=4, request=RequestFacts(2, 3, 3.5, True))
    assert "ring × ulysses = 4 is more than the 3 image tokens" in error.message


def test_auto_prefers_degrees_that_split_the_tokens_and_pads_only_when_none_places_every_rank():
    """154 text tokens split 2 ways: ulysses=2 and data parallel for the other factor; with a batch of one,
    ulysses=4 with the text padded."""
    request = RequestFacts(batch=2, image_tokens=4096, cfg_scale=1.0, has_negative=False, text_tokens=154)
    config, why = ParallelConfig.auto(4, FLUX_TINY, request)
    assert (config.ulysses, config.ring, config.dp) == (2, 1, 2), why
    config, why = ParallelConfig.auto(4, FLUX_TINY, RequestFacts(1, 4096, 1.0, False, text_tokens=154))
    assert (config.ulysses, config.ring, config.dp) == (4, 1, 1) and "padded" in why, why
    config, why = ParallelConfig.auto(4, ModelFacts("z-image", heads=30, supports=FLUX_TINY.supports),
                                      RequestFacts(1, 63 * 63, 1.0, False))
    assert (config.ulysses, config.ring) == (2, 2) and "padded" in why, why


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
    data_only = ModelFacts("data-only", heads=4, supports=frozenset({"dp"}))
    with pytest.raises(ConfigError, match="no layout of 3 ranks"):
        ParallelConfig.auto(3, data_only, RequestFacts(1, 4096, 1.0, False))


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


def test_the_larger_patch_must_split_over_the_sequence_ranks_too():
    """9 × 9 tokens in 2 patches: bands of 4 and 5 rows (36 and 45 tokens). The 45 used to pass (only the
    smaller patch was checked) and hung the ranks, each dropping a token; 3 patches of 27 at ulysses=3 split."""
    request = RequestFacts(1, 81, 1.0, False, token_rows=9)
    error = pf_refused(ParallelConfig(pipefusion=2, ulysses=2), world=4, request=request)
    assert "a patch of 45 tokens does not split into ring × ulysses = 2" in error.message
    ParallelConfig(pipefusion=2, ulysses=3, num_pipeline_patch=3).validate(6, FLUX_TINY_PF, request)


def test_pipefusion_is_refused_by_name_for_a_family_without_it():
    error = refused(ParallelConfig(pipefusion=2), model=FLUX_TINY)
    assert "flux-tiny does not support pipefusion" in error.message


def test_a_valid_pipefusion_layout_passes():
    ParallelConfig(pipefusion=2, ulysses=2, num_pipeline_patch=4, warmup_steps=0,
                   pipefusion_blocks=(2, 5)).validate(4, FLUX_TINY_PF, GRID)


# ----------------------------------------------------------------------------- auto over measured links

FLUX_DEV_FACTS = ModelFacts("flux-dev", heads=24, supports=frozenset({"dp", "cfg", "pipefusion", "ring", "ulysses"}),
                            blocks=57, hidden=3072)


def flux_1024(batch=1, cfg=1.0, negative=False):
    """Flux.1-dev at 1024² in bf16: 4096 image tokens, a 512-token prompt (split with the image), 28 steps."""
    return RequestFacts(batch, 4096, cfg, negative, token_rows=64, text_tokens=512, value_bytes=2, steps=28)


def links(world, gbps, p2p, tflops):
    """Every pair of ``world`` GPUs on the same kind of link, and the ranks' matmul rate."""
    from xdit_backend.distributed.topology import Pair, Topology

    pairs = tuple(Pair((i, j), p2p, gbps) for i in range(world) for j in range(i + 1, world))
    return Topology("cuda", pairs, compute_tflops=tflops)


NVLINK = {"gbps": 300.0, "p2p": True, "tflops": 700.0}  # H100 SXM class
PCIE_P2P = {"gbps": 25.0, "p2p": True, "tflops": 180.0}  # L40 class, PCIe 4.0 with peer access
PCIE_NO_P2P = {"gbps": 11.0, "p2p": False, "tflops": 165.0}  # consumer cards: through the host


@pytest.mark.parametrize("world,request_facts,expected", [
    (2, flux_1024(), ParallelConfig(ulysses=2)),
    (4, flux_1024(), ParallelConfig(ulysses=4)),
    (8, flux_1024(), ParallelConfig(ulysses=8)),
    (4, flux_1024(batch=2), ParallelConfig(ulysses=4)),
    (4, flux_1024(cfg=3.5, negative=True), ParallelConfig(cfg=2, ulysses=2)),
], ids=["w2", "w4", "w8", "w4-batch2", "w4-cfg"])
def test_on_nvlink_auto_keeps_ulysses(world, request_facts, expected):
    """At 300 GB/s Ulysses' all-to-alls cost a few per cent of a step: nothing is modeled 10 % faster."""
    config, why = ParallelConfig.auto(world, FLUX_DEV_FACTS, request_facts, links(world, **NVLINK))
    assert config == expected, why
    assert "GPUs with peer access at 300 GB/s: no layout modeled 10% faster" in why


def test_pcie_without_peer_access_takes_ring_over_ulysses():
    """Both send A·B·S·C·e = 57 · 4608 · 3072 · 2 B = 1.6 GB per step at P = 2: 147 ms at 11 GB/s. Ulysses
    waits for it; Ring hides α = 4608/(4608 + 6·3072) = 0.2 of the ~0.5 s compute share behind attention."""
    config, why = ParallelConfig.auto(2, FLUX_DEV_FACTS, flux_1024(), links(2, **PCIE_NO_P2P))
    assert config == ParallelConfig(ring=2)
    assert why.startswith("GPUs without peer access") and "at 11 GB/s: ring=2 instead of ulysses=2 (modeled" in why


@pytest.mark.parametrize("link", [PCIE_NO_P2P, PCIE_P2P], ids=["no-p2p", "p2p"])
def test_on_pcie_a_batch_goes_to_data_parallel(link):
    """Two images: data parallel sends nothing per step, so it beats sending the sequence over PCIe."""
    config, why = ParallelConfig.auto(2, FLUX_DEV_FACTS, flux_1024(batch=2), links(2, **link))
    assert config == ParallelConfig(dp=2) and "dp=2 instead of ulysses=2" in why


def test_on_pcie_cfg_stays_and_ring_takes_the_other_factor():
    config, why = ParallelConfig.auto(4, FLUX_DEV_FACTS, flux_1024(cfg=3.5, negative=True), links(4, **PCIE_P2P))
    assert config == ParallelConfig(cfg=2, ring=2)
    assert "GPUs with peer access at 25 GB/s: cfg=2 × ring=2 instead of cfg=2 × ulysses=2" in why


@pytest.mark.parametrize("link", [NVLINK, PCIE_P2P, PCIE_NO_P2P], ids=["nvlink", "pcie-p2p", "pcie-no-p2p"])
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("request_facts", [flux_1024(), flux_1024(batch=2), flux_1024(cfg=3.5, negative=True),
                                           RequestFacts(4, 4096, 1.0, False, 64, text_tokens=154, value_bytes=2)],
                         ids=["one-pass", "batch2", "cfg", "prompt154-batch4"])
def test_what_auto_picks_over_measured_links_always_validates(link, world, request_facts):
    config, why = ParallelConfig.auto(world, FLUX_DEV_FACTS, request_facts, links(world, **link))
    config.validate(world, FLUX_DEV_FACTS, request_facts)
    assert config.pipefusion == 1 and f"at {link['gbps']:g} GB/s" in why


def test_without_figures_auto_keeps_its_fixed_order():
    """No topology, links not probed (--topology-probe off), or a model whose width is unknown."""
    from xdit_backend.distributed.topology import Pair, Topology

    fixed = ParallelConfig.auto(2, FLUX_DEV_FACTS, flux_1024())
    unprobed = Topology("cuda", (Pair((0, 1), False, None),))
    assert fixed[0] == ParallelConfig(ulysses=2)
    assert ParallelConfig.auto(2, FLUX_DEV_FACTS, flux_1024(), unprobed) == fixed
    no_width = ModelFacts("flux-dev", heads=24, supports=FLUX_DEV_FACTS.supports, blocks=57)
    assert ParallelConfig.auto(2, no_width, flux_1024(), links(2, **PCIE_NO_P2P)) == fixed


@pytest.mark.parametrize("config", [ParallelConfig(cfg=2, ulysses=2), ParallelConfig(dp=2, ring=2, ulysses=2),
                                    ParallelConfig(cfg=2, ring=3), ParallelConfig(dp=3, cfg=2, ulysses=2)], ids=str)
def test_rank_groups_follow_the_meshs_row_major_layout(config):
    """A DeviceMesh of shape (dp, cfg, pipefusion, ring, ulysses) lays the ranks out as arange(world).view(shape)."""
    import torch

    shape = [getattr(config, name) for name in DEGREES]
    mesh = torch.arange(config.world_size).view(shape)
    for k, axis in enumerate(DEGREES):
        expected = mesh.movedim(k, -1).reshape(-1, shape[k]).tolist()
        assert sorted(config.rank_groups(axis)) == sorted(expected), axis
