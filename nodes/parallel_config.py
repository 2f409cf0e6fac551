"""xDiT Parallel Config: which GPUs and how they share a generation (or auto)."""

from __future__ import annotations

from comfy_api.latest import io

from .choices import ParallelChoice
from .comfy_types import CATEGORY, XDiTParallel


class XDiTParallelConfig(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        from xdit_backend.models.registry import family_names

        return io.Schema(
            node_id="XDiTParallelConfig",
            display_name="xDiT Parallel Config",
            category=CATEGORY,
            description="How the backend's GPUs share one generation. dp × cfg × pipefusion × ring × ulysses "
                        "must equal the number of GPUs; 'auto' picks CFG, then Ulysses, then Ring, then dp.",
            inputs=[
                io.String.Input("gpus", default="", tooltip="GPU indices for the backend, e.g. 0,1,2,3; empty: all. "
                                "Takes effect when the backend starts (stop it with the xDiT Backend node)."),
                io.Boolean.Input("auto", default=True, tooltip="let the backend choose the layout"),
                io.Int.Input("ulysses", default=1, min=1, max=64, tooltip="sequence parallel: heads exchanged all-to-all"),
                io.Int.Input("ring", default=1, min=1, max=64, tooltip="sequence parallel: K/V passed around a ring"),
                io.Int.Input("pipefusion", default=1, min=1, max=64,
                             tooltip="pipeline stages over the blocks (" + ", ".join(family_names("pipefusion")) + ")"),
                io.Int.Input("num_pipeline_patch", default=0, min=0, max=64,
                             tooltip="PipeFusion patches per step; 0: as many as stages (more overlaps better)"),
                io.Int.Input("warmup_steps", default=1, min=0, max=1000, tooltip="PipeFusion's exact first steps"),
                io.Boolean.Input("cfg_parallel", default=False, tooltip="cond and uncond on two halves of the GPUs"),
                io.Int.Input("dp", default=1, min=1, max=64, tooltip="data parallel: the batch split across groups"),
                io.Boolean.Input("shard_weights", default=False, optional=True,
                                 tooltip="each GPU keeps 1/N of every transformer block (FSDP2), N = the GPUs that "
                                         "run the same blocks; with auto on, the backend shards by itself when the "
                                         "model would not fit"),
            ],
            outputs=[XDiTParallel.Output(display_name="XDIT_PARALLEL")],
        )

    @classmethod
    def validate_inputs(cls, gpus, **_):
        try:
            parse_gpus(gpus)
        except ValueError as exc:
            return str(exc)
        return True

    @classmethod
    def execute(cls, gpus, auto, ulysses, ring, pipefusion, num_pipeline_patch, warmup_steps, cfg_parallel,
                dp, shard_weights=False) -> io.NodeOutput:
        from xdit_backend.distributed.config import ParallelConfig

        degrees = None
        if auto and shard_weights:
            raise ValueError("shard_weights goes with degrees: turn auto off and set them (auto shards the "
                             "weights by itself when the model would not fit)")
        if not auto:
            degrees = {"ulysses": ulysses, "ring": ring, "pipefusion": pipefusion, "cfg": 2 if cfg_parallel else 1,
                       "dp": dp, "warmup_steps": warmup_steps}
            if num_pipeline_patch:
                degrees["num_pipeline_patch"] = num_pipeline_patch
            if shard_weights:
                degrees["shard_weights"] = True
            ParallelConfig.from_json(degrees)  # the per-layout rules, before anything runs (ConfigError)
        set_anyway = [f"{name}={value}" for name, value in (("ulysses", ulysses), ("ring", ring),
                                                            ("pipefusion", pipefusion), ("dp", dp)) if value > 1]
        ignored = ", ".join(set_anyway + (["cfg_parallel"] if cfg_parallel else [])) if auto else ""
        return io.NodeOutput(ParallelChoice(degrees, parse_gpus(gpus), unused_with_auto=ignored))


def parse_gpus(text: str) -> tuple[int, ...] | None:
    text = text.strip()
    if not text or text == "all":
        return None
    try:
        gpus = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"gpus {text!r} is not a list of GPU indices such as 0,1,2,3 (empty: all)") from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise ValueError(f"gpus {text!r} must list distinct GPU indices ≥ 0")
    return gpus
