"""ParallelConfig: one validated description of how the ranks share a generation.

The rule everything else relies on: ``dp × cfg × pipefusion × ring × ulysses == world size``.
Each violated rule raises ConfigError with the rule, the actual values and a way out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from math import prod
from typing import TYPE_CHECKING, NamedTuple

from ..errors import UserError
from .cost import Link, predict, serial_step, traffic_formula

if TYPE_CHECKING:
    from .topology import Pair, Topology

DEGREES = ("dp", "cfg", "pipefusion", "ring", "ulysses")
# A measured topology moves auto off its fixed order only for a layout modeled this much faster per step:
# the model leaves out what differs between the kernels (Ring's R partial attentions and their merges),
# the collectives' latency (the probe times bandwidth), and all-to-alls' contention for a shared link.
SWITCH_GAIN = 0.10


class ConfigError(UserError):
    """A parallel layout the backend will not run; says the rule, the values and the fix."""


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know of a model, without loading it."""

    name: str
    heads: int  # attention heads (Ulysses splits them)
    supports: frozenset[str]  # the degrees this family can run with > 1
    blocks: int = 0  # transformer blocks PipeFusion can cut into stages (each has one attention SP splits)
    hidden: int = 0  # width C = heads × head size, for the traffic model (0: unknown, auto keeps its fixed order)
    refusals: tuple[tuple[str, str], ...] = ()  # (degree, why the family does not run it), where it says why


@dataclass(frozen=True)
class RequestFacts:
    """What validation needs to know of a request."""

    batch: int
    image_tokens: int  # tokens of the latent the transformer sees (Flux: (H/16)·(W/16))
    cfg_scale: float
    has_negative: bool
    token_rows: int = 1  # rows of that token grid (Flux: H/16); PipeFusion's patches are bands of rows
    text_tokens: int = 0  # text tokens sequence parallelism cuts too (a joint model's prompt); 0: none
    value_bytes: int = 4  # bytes per value the ranks exchange (the request's compute dtype)
    steps: int = 1  # denoising steps (data parallel gathers once per generation)

    def splits(self, parts: int) -> bool:
        """Whether ``parts`` sequence ranks can each take an equal share of the image and text tokens."""
        return self.image_tokens % parts == 0 and self.text_tokens % parts == 0

    @property
    def cfg_worth_splitting(self) -> bool:
        """Two guided passes per step: a negative and a cfg scale above 1 (≤ 1 is not guidance to split)."""
        return self.cfg_scale > 1.0 and self.has_negative


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks share one generation. Every degree is a factor of the world size.

    dp:          data parallel: the batch is split into ``dp`` slices, one per group of ranks.
    cfg:         1 or 2: with 2, the conditional and unconditional passes run on the two halves.
    pipefusion:  pipeline stages over the transformer blocks (PipeFusion, parallel/pipefusion.py).
    ring:        sequence parallel: the tokens split ``ring`` ways, K/V passed around a ring.
    ulysses:     sequence parallel: the tokens split ``ulysses`` ways, heads exchanged all-to-all.
                 (Image tokens, and a joint model's text tokens too: each rank holds 1/(ring·ulysses).)
    num_pipeline_patch: PipeFusion's patches per step (default: the number of stages; more overlaps better).
    warmup_steps: PipeFusion's first steps, run synchronously on the whole latent (exact).
    pipefusion_blocks: blocks per stage, in order (default: as even as possible).
    shard_weights: FSDP2 weight sharding (parallel/shard.py): each rank keeps 1/S of every transformer block
                 and gathers a block just before it runs, S = the ranks that run the same blocks (all of
                 them; with PipeFusion, a stage's). Orthogonal to the degrees; exact.
    """

    dp: int = 1
    cfg: int = 1
    pipefusion: int = 1
    ring: int = 1
    ulysses: int = 1
    num_pipeline_patch: int | None = None
    warmup_steps: int = 1
    pipefusion_blocks: tuple[int, ...] | None = None
    shard_weights: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.cfg * self.pipefusion * self.ring * self.ulysses

    @property
    def shard_size(self) -> int:
        """Ranks that run the same blocks and so share their weights when sharded: all but PipeFusion's stages."""
        return self.world_size // self.pipefusion

    @property
    def sequence(self) -> int:
        """Ranks that share one sequence (ring × ulysses)."""
        return self.ring * self.ulysses

    @property
    def patches(self) -> int:
        """PipeFusion's patches per step: num_pipeline_patch, else one per stage."""
        return self.num_pipeline_patch or self.pipefusion

    def describe(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in DEGREES if getattr(self, name) > 1]
        text = " × ".join(parts) or "serial"
        if self.pipefusion > 1:
            text += f" ({self.patches} patches, warm-up {self.warmup_steps})"
        if self.shard_weights:
            text += f", weights sharded {self.shard_size} ways"
        return text

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if v is not None and not (k == "shard_weights" and not v)}

    @classmethod
    def from_json(cls, data: dict) -> ParallelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown parallel settings {unknown}", f"known: {', '.join(sorted(known))}")
        data = dict(data)
        if isinstance(data.get("pipefusion_blocks"), list):
            data["pipefusion_blocks"] = tuple(data["pipefusion_blocks"])
        if not isinstance(data.get("shard_weights", False), bool):
            raise ConfigError(f"parallel setting shard_weights must be true or false, got {data['shard_weights']!r}")
        for name, value in data.items():
            if name == "shard_weights":
                continue
            values = value if isinstance(value, tuple) else (value,)
            if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise ConfigError(f"parallel setting {name} must be whole numbers, got {value!r}")
        return cls(**data)

    # ------------------------------------------------------------------ validation

    def validate(self, world_size: int, model: ModelFacts, request: RequestFacts, devices: str = "") -> None:
        """Raise ConfigError for the first rule this layout breaks on this backend, model and request."""
        for name in DEGREES:
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name}={value}: every degree must be at least 1", f"set {name}=1 to not use it")
        self._check_world(world_size, devices)
        if self.cfg not in (1, 2):
            raise ConfigError(f"cfg={self.cfg}: CFG parallel splits exactly two passes (cond, uncond), so cfg is 1 or 2",
                              "set cfg=2, and put the other ranks into ulysses or ring")
        if self.cfg == 2 and not request.cfg_worth_splitting:
            why = "no negative prompt was given" if not request.has_negative else f"cfg scale is {request.cfg_scale:g}"
            raise ConfigError(
                f"CFG parallel needs two passes per step, but {why}, so there is only one pass to run "
                "(distilled-guidance models such as Flux-dev sample with cfg 1)",
                f"use sequence parallel instead: ulysses={self.cfg * self.ulysses} (or ring={self.cfg * self.ring})")
        for name in DEGREES:
            if getattr(self, name) > 1 and name not in model.supports:
                why = dict(model.refusals).get(name)
                raise ConfigError(f"{name}={getattr(self, name)}: model {model.name} does not support {name} "
                                  "parallelism" + (f": {why}" if why else " in this version"),
                                  f"supported: {', '.join(sorted(model.supports)) or 'none'}")
        if self.ulysses > model.heads:
            raise ConfigError(f"ulysses={self.ulysses} is more than the {model.heads} attention heads of {model.name}: "
                              "Ulysses gives each rank a share of the heads, and some ranks would get none",
                              f"use ulysses ≤ {model.heads} and ring for the remaining factor "
                              f"(e.g. ulysses={max(u for u in _divisors(self.ulysses) if u <= model.heads)}, "
                              f"ring={self.ring * self.ulysses // max(u for u in _divisors(self.ulysses) if u <= model.heads)})")
        if request.image_tokens < self.sequence:
            raise ConfigError(f"ring × ulysses = {self.sequence} is more than the {request.image_tokens} image tokens: "
                              "every sequence rank needs at least one", "use a larger image, or fewer sequence ranks")
        if request.batch % self.dp:
            raise ConfigError(f"dp={self.dp} does not divide the batch of {request.batch}",
                              f"use a batch that is a multiple of {self.dp}, or dp=1")
        if self.pipefusion > 1:
            self._check_pipefusion(model, request)
        if self.shard_weights:
            self._check_sharding()

    def _check_sharding(self) -> None:
        """Sharding needs two or more ranks running the same blocks. (Those ranks always call the blocks
        the same number of times in the same order, as FSDP's all-gathers require: CFG halves, sequence
        ranks and dp groups (equal batch slices: the dp rule above) each call the model once per model
        call of the sampler, and a PipeFusion stage's ranks run the same work list (parallel/shard.py).)"""
        if self.shard_size > 1:
            return
        if self.pipefusion > 1:
            raise ConfigError(f"shard_weights with pipefusion={self.pipefusion} on {self.world_size} ranks: each stage's "
                              "blocks are held by one rank, so there is no other rank to share them with "
                              "(sharding splits a block over the ranks that run it)",
                              "drop shard_weights (PipeFusion already gives each rank only its stage), or give "
                              "each stage more ranks (cfg, ulysses, ring or dp > 1)")
        raise ConfigError(f"shard_weights on {self.world_size} rank: sharding splits each block over the ranks, and "
                          "one rank would keep all of it",
                          "drop shard_weights, start the backend on more GPUs, or use an fp8 or GGUF file")

    def _check_pipefusion(self, model: ModelFacts, request: RequestFacts) -> None:
        if self.pipefusion > model.blocks:
            raise ConfigError(f"pipefusion={self.pipefusion} stages, but {model.name} has {model.blocks} blocks",
                              f"use at most {model.blocks} stages")
        if self.pipefusion_blocks is not None:
            counts = self.pipefusion_blocks
            if len(counts) != self.pipefusion or sum(counts) != model.blocks or min(counts) < 1:
                raise ConfigError(f"pipefusion_blocks {list(counts)} must give {self.pipefusion} stages of at least "
                                  f"one block each, summing to the {model.blocks} blocks of {model.name} "
                                  f"(they sum to {sum(counts)})", "or leave it out for an even split")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps={self.warmup_steps} must be 0 or more")
        patches = self.patches
        if not 1 <= patches <= request.token_rows:
            raise ConfigError(f"num_pipeline_patch={patches}: patches are bands of token rows, and the latent has "
                              f"{request.token_rows} rows (height / 16)", f"use 1..{request.token_rows} patches")
        # patches are bands of ⌊rows/patches⌋ or ⌈rows/patches⌉ token rows; the sequence ranks each take an
        # equal slice of a patch's tokens (then of the whole latent in a warm-up step too: the patches' sum)
        rows, row_tokens = request.token_rows, request.image_tokens // request.token_rows
        for tokens in sorted({rows // patches * row_tokens, -(-rows // patches) * row_tokens}):
            if tokens % self.sequence:
                raise ConfigError(f"a patch of {tokens} tokens does not split into ring × ulysses = {self.sequence} "
                                  "equal parts", f"choose a width whose W/16 is a multiple of {self.sequence} "
                                  "(every band of rows then splits), or another number of patches")

    def _check_world(self, world_size: int, devices: str) -> None:
        if self.world_size == world_size:
            return
        factors = " × ".join(f"{name}={getattr(self, name)}" for name in DEGREES)
        on = f" ({devices})" if devices else ""
        fix = _one_degree_fix(self, world_size)
        set_flag = f"set {fix[0]}={fix[1]}, " if fix else ""
        set_widget = f"set {fix[0]} to {fix[1]} (that alone makes it right), " if fix else ""
        raise ConfigError(
            f"the parallel degrees multiply to {self.world_size} ({factors}), "
            f"but the backend runs {world_size} rank{'s' if world_size != 1 else ''}{on}; "
            "dp × cfg × pipefusion × ring × ulysses must equal the number of ranks",
            f"{set_flag}or stop the backend (`xdit-backend stop`) and start it with --nproc {self.world_size}; or "
            "use --parallel auto",
            node_hint=f"on the xDiT Parallel Config, {set_widget}or set "
                      f"degrees whose product is {world_size}, or turn auto on; to run on {self.world_size} GPUs "
                      f"instead, stop the backend (xDiT Backend node: stop backend) and list {self.world_size} GPUs "
                      "in the config's gpus")

    # ------------------------------------------------------------------ auto

    @classmethod
    def auto(cls, world_size: int, model: ModelFacts, request: RequestFacts,
             topology: Topology | None = None,
             memory: Callable[[ParallelConfig], MemoryFit | None] | None = None) -> tuple[ParallelConfig, str]:
        """Pick degrees for this world size, and say why in a sentence; then turn weight sharding on
        when ``memory(config)`` (the picked layout's estimate) says the unsharded weights would not fit
        (``with_sharding_if_needed``)."""
        config, why = cls._auto_degrees(world_size, model, request, topology)
        return with_sharding_if_needed(config, why, memory(config) if memory else None)

    @classmethod
    def _auto_degrees(cls, world_size: int, model: ModelFacts, request: RequestFacts,
                      topology: Topology | None) -> tuple[ParallelConfig, str]:
        """The degrees auto picks.

        The fixed order first (``fixed_order``). With a measured topology (topology.py), every valid
        layout's step is modeled (cost.predict: compute at the measured rate, the method's traffic
        over the slowest link its groups span), and a layout modeled at least SWITCH_GAIN faster than
        the fixed order's pick replaces it: on links without peer access, CFG, data parallel or Ring
        (whose K/V passes overlap the attention) over Ulysses' blocking all-to-alls."""
        config, why = cls.fixed_order(world_size, model, request)
        if topology is None or world_size == 1 or not (model.blocks and model.hidden and topology.compute_tflops):
            return config, why
        fixed = _modeled_step(config, model, request, topology)
        if fixed is None:  # a link was not probed
            return config, why
        steps = [step for c in _valid_layouts(world_size, model, request)
                 if (step := _modeled_step(c, model, request, topology)) is not None]
        # Modeled times within a hundredth of the fixed order's step are a tie: then the fewest bytes
        # (a Ring fully hidden behind attention ties with data parallel, which sends nothing per step).
        best = min(steps, key=lambda step: (round(step.seconds / fixed.seconds, 2), step.sent))
        where = topology.describe(fixed.link)
        if best.seconds < (1 - SWITCH_GAIN) * fixed.seconds:
            return best.config, (f"{where}: {best.config.describe()} instead of {config.describe()} (modeled "
                                 f"{best.seconds * 1e3:.3g} ms per step against {fixed.seconds * 1e3:.3g} ms)")
        return config, f"{why}; {where}: no layout modeled {SWITCH_GAIN:.0%} faster"

    @classmethod
    def fixed_order(cls, world_size: int, model: ModelFacts, request: RequestFacts) -> tuple[ParallelConfig, str]:
        """CFG first when the request has two passes, then Ulysses up to what the heads allow, then Ring for
        what is left, then data parallel over the batch (auto without a topology). Sequence degrees that
        split the tokens evenly come first; when none places every rank, the tokens are padded (exact, at
        the cost of at most one token per rank: parallel/sequence.Shard)."""
        try:
            return cls._fixed_order(world_size, model, request, padded=False)
        except ConfigError:
            if request.image_tokens < 2 or not {"ulysses", "ring"} & model.supports:
                raise
            return cls._fixed_order(world_size, model, request, padded=True)

    @classmethod
    def _fixed_order(cls, world_size: int, model: ModelFacts, request: RequestFacts,
                     padded: bool) -> tuple[ParallelConfig, str]:
        def fits(parts: int) -> bool:
            return parts <= request.image_tokens if padded else request.splits(parts)

        remaining, picked, why = world_size, {}, []
        if remaining % 2 == 0 and request.cfg_worth_splitting and "cfg" in model.supports:
            picked["cfg"], remaining = 2, remaining // 2
            why.append("CFG parallel for the cond and uncond passes")
        if "ulysses" in model.supports:
            u = max(d for d in _divisors(remaining) if model.heads % d == 0 and fits(d))
            if u > 1:
                picked["ulysses"], remaining = u, remaining // u
                why.append(f"Ulysses as far as the {model.heads} heads allow")
        if remaining > 1 and "ring" in model.supports:
            ulysses = picked.get("ulysses", 1)
            r = max(d for d in _divisors(remaining) if fits(d * ulysses))
            if r > 1:
                picked["ring"], remaining = r, remaining // r
                why.append("Ring for the factor Ulysses cannot take")
        if remaining > 1 and "dp" in model.supports and request.batch % remaining == 0:
            picked["dp"], remaining = remaining, 1
            why.append(f"data parallel over the batch of {request.batch}")
        if remaining > 1:
            raise ConfigError(f"no layout of {world_size} ranks fits this request ({request.image_tokens} image tokens, "
                              f"{model.heads} heads, batch {request.batch})",
                              "start fewer ranks, or use a batch that the remaining ranks divide (data parallel)")
        if padded and not request.splits(picked.get("ulysses", 1) * picked.get("ring", 1)):
            why.append("tokens padded to equal shares")
        return cls(**picked), ", ".join(why) or "world size 1"

    def rank_groups(self, axis: str) -> list[list[int]]:
        """The ranks of each group along ``axis``. The mesh is row-major over DEGREES, outermost first
        (mesh.py): world 4 with cfg=2 × ulysses=2 has ulysses groups [0, 1], [2, 3] and cfg groups [0, 2], [1, 3]."""
        shape = [getattr(self, name) for name in DEGREES]
        k = DEGREES.index(axis)
        stride = prod(shape[k + 1:])
        return [[first + i * stride for i in range(shape[k])]
                for first in range(self.world_size) if (first // stride) % shape[k] == 0]

    def linked_pairs(self) -> list[tuple[int, int]]:
        """Every pair of ranks that share a group of some degree > 1: the links this layout's traffic uses."""
        return sorted({(a, b) for axis in DEGREES if getattr(self, axis) > 1 for group in self.rank_groups(axis)
                       for a in group for b in group if a < b})


class MemoryFit(NamedTuple):
    """What auto's sharding decision weighs, per rank (the memory model's estimate, memory_model.py)."""

    weight_bytes: int  # the model's weights one rank would hold unsharded (with PipeFusion: its stage's)
    free_bytes: int  # free memory of the tightest rank, less what the request's activations need


def needs_sharding(weight_bytes: int, free_bytes: int) -> bool:
    """Whether a rank's unsharded weights (bytes) exceed what it has free for them (bytes)."""
    return weight_bytes > free_bytes


def with_sharding_if_needed(config: ParallelConfig, why: str, memory: MemoryFit | None) -> tuple[ParallelConfig, str]:
    """``config`` with shard_weights on when the weights would not fit unsharded and there are ranks to
    share them; ``why`` says so. Without an estimate (``memory`` None), as it is."""
    if memory is None or config.shard_size == 1 or not needs_sharding(*memory):
        return config, why
    sharded = replace(config, shard_weights=True)
    return sharded, (f"{why}; weights sharded {config.shard_size} ways: {memory.weight_bytes / 2**30:.1f} GiB of "
                     f"weights per rank would not fit the {memory.free_bytes / 2**30:.1f} GiB free")


def _valid_layouts(world_size: int, model: ModelFacts, request: RequestFacts) -> list[ParallelConfig]:
    """Every layout without PipeFusion (approximate: asked for by name only) that passes validate."""
    layouts = []
    for cfg in (1, 2):
        for ulysses in _divisors(world_size):
            for ring in _divisors(world_size):
                dp, left = divmod(world_size, cfg * ulysses * ring)
                if left:
                    continue
                config = ParallelConfig(dp=dp, cfg=cfg, ring=ring, ulysses=ulysses)
                try:
                    config.validate(world_size, model, request)
                except ConfigError:
                    continue
                layouts.append(config)
    return layouts


class ModeledStep(NamedTuple):
    """One candidate layout as auto weighs it."""

    config: ParallelConfig
    seconds: float  # modeled per step (cost.predict)
    sent: float  # bytes a rank sends per step (cost.traffic_formula, in the request's dtype)
    link: Pair  # the slowest link the layout's groups span


def _modeled_step(config: ParallelConfig, model: ModelFacts, request: RequestFacts,
                  topology: Topology) -> ModeledStep | None:
    """One layout's modeled step over the measured links, or None when a link it uses was not probed."""
    link = topology.slowest(config.linked_pairs())
    if link is None:
        return None
    dims = {"attention_layers": model.blocks, "hidden": model.hidden, "text_tokens": request.text_tokens}
    fields = {"width": 16 * request.image_tokens, "height": 16,  # one row of N tokens: N = (W/16)·(H/16)
              "batch": request.batch, "cfg": request.cfg_scale if request.cfg_worth_splitting else 1.0,
              "steps": request.steps}
    degrees = {name: getattr(config, name) for name in DEGREES if getattr(config, name) > 1}
    measured = Link(topology.describe(link), link.bandwidth_gbps * 1e9, latency=0.0)  # latency was not timed
    t1 = serial_step(dims, fields, topology.compute_tflops)
    sent = traffic_formula(degrees, dims, fields, element_bytes=request.value_bytes)[0]
    return ModeledStep(config, predict(t1, degrees, measured, dims, fields, request.value_bytes), sent, link)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _one_degree_fix(config: ParallelConfig, world_size: int) -> tuple[str, int] | None:
    """(degree, value): the one degree whose change alone would make the product right, or None when none can."""
    for name in ("ulysses", "ring", "dp"):
        rest = config.world_size // getattr(config, name)
        if world_size % rest == 0:
            return name, world_size // rest
    return None
