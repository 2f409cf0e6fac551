"""Every parallel layout gives the serial latent: one table of (request, world, layout, tolerance) rows, each
sent to the session's backend of its world and compared with the serial reference of its request.

Tolerances are 1e-4 in float32: absolute for flux-tiny, relative to the largest value of the serial latent
(absolute below 1) for the other families. A random-weight PixArt predicts ε of order 1, which EPS sampling
multiplies by σ_max ≈ 157 and the SD 1.5 latent scale by 1/0.18215, so its latents reach ~4·10³; there,
float32 rounding of a different summation order (Ring's log-sum-exp merge) alone is ~2·10⁻³ absolute
(6·10⁻⁷ relative). PipeFusion rows run with full warm-up (every step on the whole latent): exact by design;
its stale K/V is measured in test_pipefusion.py.
"""

import math
import re
from dataclasses import dataclass, field

import pytest
import torch
from parity import PIPELINED, SIZES, TI2V, TOLERANCE, bound, conditioning, family, serial

from xdit_backend.models import registry



@dataclass(frozen=True)
class Row:
    fields: dict  # the request, without its layout
    world: int
    degrees: dict | str  # the request's "parallel"
    relative: bool = True  # the tolerance scaled by the serial latent's largest value (when above 1)
    conditioning: str | None = None  # parity.CONDITIONING's name; None: rank 0's from the seed
    options: dict = field(default_factory=dict)  # request fields that leave the serial latent as it is
    layout: str | None = None  # a pattern the result's layout description must match (re.search)

    @property
    def id(self) -> str:
        extra = {k: v for k, v in self.fields.items() if k not in ("model", "seed", "cfg")}
        layout = self.degrees if isinstance(self.degrees, str) else "x".join(f"{k}{v}" for k, v in self.degrees.items())
        return "-".join([self.fields["model"], *(f"{k}{v}" for k, v in extra.items()), f"world{self.world}", layout,
                         *(f"{k}{v}" for k, v in self.options.items())])


# flux-tiny with CFG (scale 3.5, a negative) and a batch of 2, so cfg and dp always have two of something to split
FLUX = {"model": "flux-tiny", "width": 128, "height": 64, "steps": 4, "seed": 21, "cfg": 3.5, "batch": 2}
# 272×272 px is 17 × 17 = 289 image tokens, with 7 text tokens: no degree below divides either; 4 heads pad to 6 at 3
FLUX_PADDED = {"model": "flux-tiny", "width": 272, "height": 272, "steps": 2, "seed": 3, "cfg": 3.5, "batch": 1}
FLUX_SHARDED = {**FLUX, "steps": 3}

FAMILY_LAYOUTS = [(2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (4, {"ulysses": 2, "ring": 2})]
FOUR_WAYS = [{"ulysses": 4}, {"ring": 4}, {"cfg": 2, "ulysses": 2}]
PIPEFUSION_LAYOUTS = [(2, {"pipefusion": 2, "num_pipeline_patch": 4}), (4, {"pipefusion": 2, "ulysses": 2}),
                      (4, {"pipefusion": 2, "cfg": 2})]
SHARDED = "weights sharded"
UNEVEN_COGVIDEOX = {"model": "cogvideox-tiny", "width": 80, "height": 48, "frames": 5, "steps": 3, "seed": 7,
                    "cfg": 3.5}


def full_warmup(fields: dict, degrees: dict) -> dict:
    return {**degrees, "warmup_steps": fields["steps"]}


ROWS = [
    # flux-tiny: every method, and their hybrids on 4 ranks
    *(Row(FLUX, world, degrees, relative=False, conditioning="flux") for world, degrees in [
        (2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (2, {"dp": 2}), (4, {"ulysses": 2, "ring": 2}),
        (4, {"ulysses": 4}), (4, {"ring": 4}), (4, {"cfg": 2, "ulysses": 2}), (4, {"cfg": 2, "ring": 2}),
        (4, {"dp": 2, "ulysses": 2})]),
    Row(FLUX, 4, "auto", relative=False, conditioning="flux", layout="^cfg=2 × ulysses=2"),
    # padded heads and padded, masked tokens: one rank holds a padded share (a whole share of padding text at 4)
    *(Row(FLUX_PADDED, world, degrees, relative=False, conditioning="flux-7-tokens") for world, degrees in [
        (2, {"ulysses": 2}), (2, {"ring": 2}), (3, {"ulysses": 3}), (3, {"ring": 3}), (4, {"ulysses": 2, "ring": 2}),
        (4, {"ulysses": 4})]),
    # PipeFusion with full warm-up, alone and in each hybrid
    *(Row(FLUX, world, full_warmup(FLUX, degrees), relative=False, conditioning="flux") for world, degrees in [
        (2, {"pipefusion": 2}), (4, {"pipefusion": 2, "ulysses": 2}), (4, {"pipefusion": 2, "ring": 2}),
        (4, {"pipefusion": 2, "cfg": 2}), (4, {"pipefusion": 2, "dp": 2}), (4, {"pipefusion": 4})]),
    # FSDP2 weight sharding beside each method (profiled: each rank's share of the blocks is checked too)
    *(Row(FLUX_SHARDED, world, {**degrees, "shard_weights": True}, relative=False, conditioning="flux",
          options={"profile": True}, layout=SHARDED) for world, degrees in [
        (2, {"ulysses": 2}), (2, {"ring": 2}), (2, {"cfg": 2}), (2, {"dp": 2}), (4, {"ulysses": 2, "ring": 2})]),
    # every family in the sequence and CFG layouts, and with PipeFusion (full warm-up) in its hybrids
    *(Row(family(model), world, degrees) for model in SIZES for world, degrees in FAMILY_LAYOUTS),
    *(Row(family(model), world, full_warmup(family(model), degrees))
      for model in PIPELINED for world, degrees in PIPEFUSION_LAYOUTS),
    # the report: a reference system returned wrong HunyuanDiT images at sequence parallel degree 4;
    # its second-half blocks take a skip input, which FSDP2-sharded blocks must pass through
    Row(family("hunyuan-dit-tiny"), 4, {"ulysses": 4}),
    Row(family("hunyuan-dit-tiny"), 4, {"ring": 4}),
    Row(family("hunyuan-dit-tiny"), 2, {"ulysses": 2, "shard_weights": True}),
    # 80 × 48 px is 5 × 3 = 15 HunyuanDiT tokens: padded shares, and the RoPE table padded with them
    Row(family("hunyuan-dit-tiny", width=80, height=48), 2, {"ring": 2}),
    Row(family("hunyuan-dit-tiny", width=80, height=48), 4, {"ulysses": 4}),
    # pipefusion=4 over 4 blocks: block 0's output reaches block 3 through stages 1 and 2 (carried with each patch)
    Row(family("hunyuan-dit-tiny"), 4, full_warmup(family("hunyuan-dit-tiny"), {"pipefusion": 4, "num_pipeline_patch": 2})),
    # CogVideoX split 4 ways (text and video), cfg beside ulysses; 30 video and 7 text tokens, which 4 divides neither
    *(Row(family("cogvideox-tiny"), 4, degrees) for degrees in FOUR_WAYS),
    *(Row(UNEVEN_COGVIDEOX, 4, degrees, conditioning="cogvideox-7-tokens")
      for degrees in [*FOUR_WAYS, {"ulysses": 2, "ring": 2}]),
    Row(family("cogvideox-tiny"), 2, {"ulysses": 2, "shard_weights": True}, layout=SHARDED),
    # Z-Image's heads (30; the tiny's 6) do not divide by 4, and 112 × 80 px gives 7 × 5 = 35 image tokens: it pads
    # them and its caption to 32 each, so the unified sequence (64 + 32) splits
    *(Row(family("z-image-tiny", width=112, height=80), 4, degrees) for degrees in [{"ulysses": 4}, {"ulysses": 2, "ring": 2}]),
    # FSDP2 over Z-Image's three block lists (refiners and main blocks), batch 2
    Row(family("z-image-tiny", batch=2), 2, {"ulysses": 2, "shard_weights": True}, layout="weights sharded 2 ways"),
    # pipefusion=4 over 1 + 1 refiners and 2 main blocks: the context refiner alone on stage 1 (the caption travels
    # with the first patch)
    Row(family("z-image-tiny"), 4, full_warmup(family("z-image-tiny"), {"pipefusion": 4, "num_pipeline_patch": 2})),
    # Flux.2's double- and single-stream blocks (their fused projections) sharded
    Row(family("flux2-tiny"), 2, {"ulysses": 2, "shard_weights": True}),
    # Chroma's blocks sharded (the approximator, outside them, whole on every rank), and split 4 ways
    Row(family("chroma-tiny"), 2, {"ulysses": 2, "shard_weights": True}, layout=SHARDED),
    Row(family("chroma-tiny"), 4, {"ulysses": 4}),
    # HunyuanVideo 1.5 runs its blocks from its own loop, never the transformer's forward: FSDP's gathers still fire
    Row(family("hunyuan-video-1.5-tiny"), 2, {"ulysses": 2, "shard_weights": True}, layout=SHARDED),
    # Wan 2.2 TI2V-5B's image to video: the first frame fixed by a noise mask, a timestep per frame (per token)
    *(Row(TI2V, world, degrees, conditioning="ti2v-first-frame") for world, degrees in FAMILY_LAYOUTS),
    Row({**TI2V, "batch": 2}, 2, {"dp": 2}, conditioning="ti2v-first-frames-2"),
    *(Row(TI2V, world, full_warmup(TI2V, degrees), conditioning="ti2v-first-frame")
      for world, degrees in PIPEFUSION_LAYOUTS),
    # multistep samplers under PipeFusion (4 patches): each patch's walk equals its band of the serial walk
    *(Row(family("sd3-tiny", sampler=sampler, steps=4), 2, {"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 4})
      for sampler in ["euler_ancestral", "dpmpp_2m", "dpmpp_2m_sde", "uni_pc"]),
]


def blocks_and_rest(model: str):
    """The model's block parameters (as the requests run them: float32) and the bytes of the others."""
    transformer = registry.build(model, torch.device("cpu")).transformer
    blocks = [p for name in registry.spec(model).stage_plan.block_lists
              for block in getattr(transformer, name) for p in block.parameters()]
    inside = {id(p) for p in blocks}
    return blocks, sum(p.numel() * p.element_size() for p in transformer.parameters() if id(p) not in inside)


def assert_sharded_residency(info: dict, model: str, ranks: int) -> None:
    """Each rank holds ⌈rows/S⌉ rows of each block parameter (FSDP2 pads dim 0) and the whole other layers."""
    blocks, rest = blocks_and_rest(model)
    share = sum(math.ceil(p.shape[0] / ranks) * (p.numel() // p.shape[0]) * p.element_size() for p in blocks)
    whole = sum(p.numel() * p.element_size() for p in blocks) + rest
    for record in info["profile"]:
        assert record["resident_parameter_bytes"] <= share + rest, record
        assert record["resident_parameter_bytes"] < whole


# grouped by world: a worker keeps up to 7 ranks of shared backends (conftest.SharedBackends), so rows in table
# order (2, 4, 3, 2, …) would stop and start the same worlds again
@pytest.mark.parametrize("row", [pytest.param(row, id=row.id) for row in sorted(ROWS, key=lambda row: row.world)])
def test_layout_equals_serial(row, backend):
    expected = serial(row.fields, row.conditioning)
    result, info = backend(row.world).sample({**row.fields, **row.options, "parallel": row.degrees},
                                             conditioning(row.conditioning))
    assert info["world_size"] == row.world and result["samples"].shape == expected.shape
    if row.layout:
        assert re.search(row.layout, info["layout"]), info["layout"]
    if row.options.get("profile") and row.degrees.get("shard_weights"):
        assert_sharded_residency(info, row.fields["model"], row.world)
    tolerance = bound(expected) if row.relative else TOLERANCE
    difference = (result["samples"] - expected).abs().max().item()
    assert difference <= tolerance, f"{row.id}: max |parallel − serial| = {difference:.3g} > {tolerance:.3g}"


def test_another_seed_differs_beyond_the_tolerance():
    """The tolerance means something for every family: another seed moves the latent far more."""
    for model in SIZES:
        reference = serial(family(model))
        assert (serial(family(model, seed=8)) - reference).abs().max() > 100 * bound(reference), model

