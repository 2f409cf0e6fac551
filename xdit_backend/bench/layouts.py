"""``xdit-backend bench``: measurements, printed as markdown. Timings live here, never in tests."""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from ..client import Client
from ..distributed.config import DEGREES
from ..distributed.cost import traffic_formula
from ..launch import launcher
from ..wire import protocol

FLUX_1024_LATENT = (1, 16, 128, 128)  # a 1024×1024 Flux latent, float32: 1 MiB


def _timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def _row(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"| {name} | {statistics.median(ms):.3f} | {p90:.3f} | {len(ms)} |"


def run_transport_bench(nproc: int = 2, repeats: int = 200) -> int:
    """Cold start of a backend, an empty request's round trip, and a 1024² Flux latent there and back."""
    latent = torch.randn(FLUX_1024_LATENT)
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=nproc, device="cpu")
        started = time.perf_counter()
        launcher.start(options)
        cold_start = time.perf_counter() - started
        try:
            client = Client(options.socket)
            client.hello()  # warm the path once
            rows = [
                _row("empty request round trip (hello, new connection each)", _timed(client.hello, repeats)),
                _row("status round trip", _timed(client.status, repeats)),
                _row("1×16×128×128 f32 latent to the backend and back (echo)",
                     _timed(lambda: client.echo({"latent": latent}), max(20, repeats // 4))),
            ]
        finally:
            launcher.stop(options.socket)
    frame = protocol.encode_bytes(protocol.Message("echo", {}, {"latent": latent}))
    rows += [
        _row("same latent: in-process copy (clone)", _timed(latent.clone, repeats)),
        _row("same latent: in-process encode + decode, no socket",
             _timed(lambda: protocol.decode_bytes(protocol.encode_bytes(
                 protocol.Message("echo", {}, {"latent": latent}))), repeats)),
    ]
    print(f"backend cold start, world {nproc} on cpu: {cold_start:.2f} s (until every rank answers)\n")
    print("| what | median ms | p90 ms | runs |\n|---|---|---|---|\n" + "\n".join(rows))
    print(f"\nframe size for the latent: {len(frame)} bytes")
    return 0


# --------------------------------------------------------------------------- parallel layouts

DEFAULT_LAYOUTS = ["serial", "ulysses=2", "ring=2", "cfg=2", "dp=2", "pipefusion=2", "pipefusion=2,patches=4",
                   "ulysses=2,ring=2", "ulysses=4", "ring=4", "cfg=2,ulysses=2", "cfg=2,ring=2", "dp=2,ulysses=2",
                   "pipefusion=4", "pipefusion=2,ulysses=2"]
_LAYOUT_KEYS = {"patches": "num_pipeline_patch", "warmup": "warmup_steps"}


def parse_layout(text: str) -> dict:
    """"cfg=2,ulysses=2" → {"cfg": 2, "ulysses": 2}; "pipefusion=2,patches=4,warmup=1"; "serial" → {};
    "ulysses=2,shard" → {"ulysses": 2, "shard_weights": True} (weight sharding, parallel/shard.py)."""
    if text == "serial":
        return {}
    parts = [part.strip() for part in text.split(",")]
    sharding = {"shard_weights": True} if "shard" in parts else {}
    try:
        pairs = (part.split("=") for part in parts if part != "shard")
        return {**{_LAYOUT_KEYS.get(name.strip(), name.strip()): int(value) for name, value in pairs}, **sharding}
    except ValueError:
        raise SystemExit(f"xdit-backend: layout {text!r} is not like ulysses=2,ring=2 (or serial)") from None


def world_of(degrees: dict) -> int:
    return math.prod(degrees.get(name, 1) for name in DEGREES)


def flux_dims(model: str) -> dict | None:
    """What traffic_formula needs of a built-in Flux model (None for another model: no formula). Its
    text tokens: the length of the stand-in prompt a request without embeddings gets (the bench
    sends none, so a model file cannot run in it)."""
    from ..models import registry

    builtin = registry.BUILTINS.get(model)
    if builtin is None or builtin.family != "flux":
        return None
    config = builtin.config
    return {"attention_layers": config["num_layers"] + config["num_single_layers"],
            "hidden": config["num_attention_heads"] * config["attention_head_dim"], "text_tokens": builtin.text_tokens}


def method_of(layout: str) -> str:
    """The method a layout uses, without its degrees: "cfg=2,ulysses=2" → "cfg×ulysses"."""
    degrees = parse_layout(layout)
    method = "×".join(name for name in DEGREES if degrees.get(name, 1) > 1) or "serial"
    return f"{method}+shard" if degrees.get("shard_weights") else method


def block_passes(degrees: dict, steps: int) -> int:
    """Passes of a rank through its blocks in a request: one per model call (the bench's sampler, euler,
    calls the model once a step); under PipeFusion one per chunk: the whole latent in each warm-up step,
    then each of the M patches."""
    if degrees.get("pipefusion", 1) == 1:
        return steps
    warmup = min(degrees.get("warmup_steps", 1), steps)
    return warmup + (steps - warmup) * degrees.get("num_pipeline_patch", degrees["pipefusion"])


def summarise(record: dict, fields: dict, serial_step: float | None) -> dict:
    """The figures of one layout's profiled request, from every rank's record."""
    ranks = record["profile"]
    steps = ranks[0]["step_s"][1:] or ranks[0]["step_s"]  # the first step is warm-up (when there are more)
    median = statistics.median(steps)
    speedup = serial_step / median if serial_step else None
    return {
        "layout": record["layout"], "method": method_of(record["layout"]), "world": record["world"],
        "described": record["described"],
        "step_median_s": median, "step_min_s": min(steps), "step_max_s": max(steps),
        "step_spread": (max(steps) - min(steps)) / median,
        "denoise_s": max(r["denoise_s"] for r in ranks),  # end to end on the slowest rank, no VAE anywhere
        "sent_bytes_per_rank_per_step": max(sum(v for k, v in r["sent_bytes"].items()
                                                if k not in ("control", "shard_all_gather"))
                                            for r in ranks) / fields["steps"],
        # weight sharding's gathers, counted, and their formula: parallel/shard.gathered_bytes per pass of a
        # rank through its blocks, times the passes per step (block_passes)
        "gathered_bytes_per_rank_per_step": max(r["sent_bytes"].get("shard_all_gather", 0)
                                                for r in ranks) / fields["steps"],
        "gathered_formula_bytes": max(r.get("shard_bytes_per_pass") or 0 for r in ranks)
                                  * block_passes(parse_layout(record["layout"]), fields["steps"]) / fields["steps"],
        "largest_rank_parameter_bytes": max(r["resident_parameter_bytes"] for r in ranks),
        "dtype": ranks[0]["dtype"], "attention": ranks[0]["attention"],
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "memory_kind": ranks[0]["memory_kind"],
        "largest_rank_parameters": max(r["parameters"] for r in ranks),
        "process_groups_created": max(r["process_groups_created"] for r in ranks),
        "speedup": speedup, "efficiency": speedup / record["world"] if speedup else None,
    }


@contextmanager
def _backend(world: int, device: str, running: Callable[[int], Client] | None):
    """A client of a backend of ``world`` ranks: ``running(world)``'s, or one started here and stopped after."""
    if running is not None:
        yield running(world)
        return
    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=world, device=device)
        launcher.start(options)
        try:
            yield Client(options.socket)
        finally:
            launcher.stop(options.socket)


def run_layout_bench(layouts: list[str], fields: dict, json_path: Path | None = None,
                     plot_path: Path | None = None, device: str = "cpu",
                     running: Callable[[int], Client] | None = None) -> int:
    """Each layout on a backend of its world size: per-step time (first step excluded), denoising
    time end to end, bytes sent per rank per step, peak memory, speed-up and efficiency vs serial.
    ``running(world)``: a running backend of that size to use (the tests' shared ones); without it each
    world's backend is started for the bench and stopped after."""
    import json

    wanted = [(text, parse_layout(text)) for text in layouts]
    if plot_path:
        _check_plotting()
    records = []
    by_world: dict[int, list] = {}
    for text, degrees in wanted:
        by_world.setdefault(world_of(degrees), []).append((text, degrees))
    for world, group in sorted(by_world.items()):
        with _backend(world, device, running) as client:
            for text, degrees in group:
                request = {**fields, "parallel": degrees or {}}
                client.sample({**request, "steps": 2})  # warm-up: model, mesh, first-touch allocations
                _, info = client.sample({**request, "profile": True})
                records.append({**info, "layout": text, "world": world, "described": info["layout"]})
    serial = next((statistics.median(r["profile"][0]["step_s"][1:] or r["profile"][0]["step_s"])
                   for r in records if r["world"] == 1), None)
    summaries = [summarise(record, fields, serial) for record in records]
    dims = flux_dims(fields["model"])
    frames = f" × {fields['frames']} frames" if fields.get("frames", 1) != 1 else ""
    print(f"{fields['model']}, {fields['width']}×{fields['height']}{frames}, batch {fields['batch']}, cfg {fields['cfg']}, "
          f"{fields['steps']} steps (step times: first excluded), {fields.get('dtype', 'auto')}, {device}\n")
    print("| layout | ranks | step median ms | min–max ms | denoise s (end to end) | speed-up | efficiency | "
          "sent/rank/step KiB | formula KiB | weights gathered/rank/step KiB | its formula KiB | "
          "largest rank's parameters MiB | peak memory/rank MiB | new groups | "
          "attention |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for summary in summaries:
        element_bytes = getattr(torch, summary["dtype"]).itemsize
        formula = (traffic_formula(parse_layout(summary["layout"]), dims, fields, element_bytes)[0] / 1024
                   if dims else None)
        print(f"| {summary['layout']} | {summary['world']} | {summary['step_median_s'] * 1e3:.1f} | "
              f"{summary['step_min_s'] * 1e3:.1f}–{summary['step_max_s'] * 1e3:.1f} | {summary['denoise_s']:.2f} | "
              f"{_ratio(summary['speedup'], '×')} | {_ratio(summary['efficiency'], '')} | "
              f"{summary['sent_bytes_per_rank_per_step'] / 1024:.1f} | "
              f"{'—' if formula is None else f'{formula:.1f}'} | "
              f"{summary['gathered_bytes_per_rank_per_step'] / 1024:.1f} | {summary['gathered_formula_bytes'] / 1024:.1f} | "
              f"{summary['largest_rank_parameter_bytes'] / 2**20:.2f} | "
              f"{summary['peak_memory_bytes'] / 2**20:.0f} | {summary['process_groups_created']} | "
              f"{summary['attention']} |")
    if serial is None:
        print("\n(no world-1 layout in the list: add `serial` for speed-up and efficiency)")
    audio_comparison(fields, summaries)
    if json_path:
        json_path.write_text(json.dumps({"fields": fields, "device": device, "layouts": summaries,
                                         "records": records}, indent=1))
    if plot_path:
        plot(summaries, plot_path, f"{fields['model']} {fields['width']}×{fields['height']}, {device}")
    return 0


# LTX-2.3 at 720p × 121 frames (1280 × 704): 16 × 22 × 40 video tokens, 121 audio tokens, 48 blocks, audio 32 × 64
LTX23_720P = {"layers": 48, "audio_width": 2048, "audio_heads": 32, "video_tokens": 14080, "audio_tokens": 121}
# MiniMax-H3 at 768p × 124 frames: 50 blocks, attention 56 × 128, 414 audio rows (207 stereo frames)
H3_768P = {"layers": 50, "attention_width": 7168, "audio_rows": 414}


def audio_comparison(fields: dict, summaries: list[dict]) -> None:
    """For a model with audio: each sequence-parallel layout's bytes per rank per step for the audio whole on every
    rank against split, at the bench's size and at full size (LTX-2: whole runs, measured above and by
    cost.audio_traffic, split modeled; MiniMax-H3: split runs, whole modeled by cost.packed_audio_traffic)."""
    from ..distributed.cost import audio_traffic, packed_audio_traffic
    from ..models import registry

    spec = registry.spec(fields["model"])
    if spec.audio_part is None or fields["model"] not in registry.BUILTINS:
        return
    config = registry.BUILTINS[fields["model"]].config
    frames = fields.get("frames", 1)
    if spec.family == "minimax_h3":
        here = {"layers": config["num_layers"], "audio_rows": 2 * spec.audio_frames(frames),
                "attention_width": config["num_attention_heads"] * config["attention_head_dim"]}
        _audio_table(fields, summaries, packed_audio_traffic, here, H3_768P, 1, ("split", "whole"),
                     "MiniMax-H3's audio rows, split with the sequence (what runs) or whole on every rank (MODELED), "
                     "bytes a rank sends per step for them: cost.packed_audio_traffic", "768p × 124, bf16, cfg 1")
        return
    here = {"layers": config["num_layers"], "audio_heads": config["audio_num_attention_heads"],
            "audio_width": config["audio_num_attention_heads"] * config["audio_attention_head_dim"],
            "video_tokens": spec.token_grid(fields["width"], fields["height"], frames)[0],
            "audio_tokens": spec.audio_frames(frames)}
    _audio_table(fields, summaries, audio_traffic, here, LTX23_720P, 2, ("whole", "split"),
                 "LTX-2's audio, whole on every rank (what runs) or split with the video (MODELED), bytes a rank "
                 "sends per step for the audio (the video's own attention the same both ways): cost.audio_traffic",
                 "720p × 121, LTX-2.3, bf16")


def _audio_table(fields: dict, summaries: list[dict], traffic, here: dict, full: dict, full_rows: int,
                 columns: tuple[str, str], title: str, full_size: str) -> None:
    """The audio's two placements' bytes per layout: ``traffic`` (a cost formula) at the bench's size (``here``) and at
    full size (``full``, ``full_rows`` rows a forward), in ``columns``' order (the one that runs first)."""
    rows = fields["batch"] * (2 if fields["cfg"] != 1.0 else 1)
    first, second = columns
    print(f"\n{title}\n")
    print(f"| layout | measured sent/rank/step KiB | audio {first} KiB | audio {second} KiB | at {full_size}: {first} "
          f"MiB | {second} MiB |\n|---|---|---|---|---|---|")
    for summary in summaries:
        degrees = parse_layout(summary["layout"])
        u, r, cfg = degrees.get("ulysses", 1), degrees.get("ring", 1), degrees.get("cfg", 1)
        if u * r == 1:
            continue
        element = getattr(torch, summary["dtype"]).itemsize
        small = traffic(rows=rows // cfg, ulysses=u, ring=r, element_bytes=element, **here)
        large = traffic(rows=full_rows // cfg, ulysses=u, ring=r, element_bytes=2, **full)
        print(f"| {summary['layout']} | {summary['sent_bytes_per_rank_per_step'] / 1024:.1f} | "
              f"{small[first] / 1024:.1f} | {small[second] / 1024:.1f} | {large[first] / 2**20:.1f} | "
              f"{large[second] / 2**20:.1f} |")


def _ratio(value: float | None, unit: str) -> str:
    return "—" if value is None else f"{value:.2f}{unit}"


def _check_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("xdit-backend: --plot needs matplotlib: pip install matplotlib") from None


def plot(summaries: list[dict], path: Path, title: str) -> None:
    """Step time and efficiency against the number of ranks, one line per method (serial in each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    serial = [s for s in summaries if s["world"] == 1]
    methods = sorted({s["method"] for s in summaries if s["world"] > 1})
    figure, (times, efficiency) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in methods:
        points = sorted(serial[:1] + [s for s in summaries if s["method"] == method], key=lambda s: s["world"])
        worlds = [s["world"] for s in points]
        times.plot(worlds, [s["step_median_s"] * 1e3 for s in points], marker="o", label=method)
        if serial:
            efficiency.plot(worlds, [s["efficiency"] for s in points], marker="o", label=method)
    for axis, label in ((times, "step time, median (ms)"), (efficiency, "efficiency (speed-up / ranks)")):
        axis.set_xticks(sorted({s["world"] for s in summaries}))
        axis.set_xlabel("ranks (GPUs)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    times.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run_pipefusion_error_bench(stages: int, width: int, height: int, models: tuple[str, ...] = ("flux-tiny",),
                               frames: int = 1) -> int:
    """Per model: relative L2 distance to serial for patches ∈ {N, 2N}, warm-up ∈ {0, 1, 2}, steps ∈ {4, 8, 20}."""
    import torch

    from ..models import registry
    from ..service.reference import serial_latent

    with tempfile.TemporaryDirectory(prefix="xdit-bench-") as tmp:
        options = launcher.LaunchOptions(socket=Path(tmp) / "backend.sock", nproc=stages, device="cpu")
        launcher.start(options)
        try:
            client = Client(options.socket)
            for model in models:
                spec = registry.spec(model)
                size = {"width": width, "height": height, "frames": frames if spec.video else 1}
                fields = {"model": model, **size, "seed": 3, "cfg": 3.5, "batch": 1}
                positive, negative = registry.random_conditioning(model, 1, 3, spec)
                tensors = {**positive, **{f"negative_{k}": v for k, v in negative.items()}}
                weights = registry.build(model, torch.device("cpu"))
                rows = []
                for steps in (4, 8, 20):
                    serial = serial_latent({**fields, "steps": steps}, tensors, model=weights)
                    cells = []
                    for patches in (stages, 2 * stages):
                        for warmup in (0, 1, 2):
                            layout = {"pipefusion": stages, "num_pipeline_patch": patches, "warmup_steps": warmup}
                            result, _ = client.sample({**fields, "steps": steps, "parallel": layout}, tensors)
                            error = (result["samples"] - serial).norm() / serial.norm()
                            cells.append(f"{error.item():.2e}")
                    rows.append(f"| {steps} | " + " | ".join(cells) + " |")
                head = " | ".join(f"M={m}, warm-up {w}" for m in (stages, 2 * stages) for w in (0, 1, 2))
                frames_text = f"×{size['frames']} frames" if spec.video else ""
                print(f"PipeFusion {stages} stages, {model} {width}×{height}{frames_text}, cfg 3.5: "
                      "relative L2 distance to serial\n")
                print(f"| steps | {head} |\n|---|" + "---|" * 6 + "\n" + "\n".join(rows) + "\n")
        finally:
            launcher.stop(options.socket)
    return 0


# --------------------------------------------------------------------------- step cache

def relative_distance(latent: torch.Tensor, reference: torch.Tensor) -> float:
    """‖latent − reference‖ / ‖reference‖, in float64."""
    reference = reference.double()
    return ((latent.double() - reference).norm() / reference.norm()).item()


def _denoise_s(info: dict) -> float:
    return max(rank["denoise_s"] for rank in info["profile"])  # end to end on the slowest rank


def run_cache_bench(fields: dict, methods: list[str], thresholds: list[float], layout: str = "serial",
                    device: str = "cpu", running: Callable[[int], Client] | None = None) -> int:
    """Each method × threshold against the uncached request, same layout and seed: steps computed and
    reused, denoising time and speed-up, and the relative L2 distance of the latent to the uncached
    one, printed beside the distance between two seeds (the scale of a different picture).
    ``running``: as run_layout_bench's."""
    degrees = parse_layout(layout)
    request = {**fields, "parallel": degrees, "profile": True}
    with _backend(world_of(degrees), device, running) as client:
        client.sample({**request, "steps": 2, "profile": False})  # warm-up: model, mesh, first-touch allocations
        uncached, uncached_info = client.sample(request)
        other_seed, _ = client.sample({**request, "seed": request["seed"] + 1})
        runs = [(method, threshold, *client.sample({**request, "cache": method, "cache_threshold": threshold}))
                for method in methods for threshold in thresholds]
    reference, baseline_s = uncached["samples"], _denoise_s(uncached_info)
    frames = f" × {fields['frames']} frames" if fields.get("frames", 1) != 1 else ""
    print(f"{fields['model']}, {fields['width']}×{fields['height']}{frames}, batch {fields['batch']}, "
          f"cfg {fields['cfg']}, {fields['steps']} steps, layout {layout}, {device}; cache_start "
          f"{fields.get('cache_start', 2)}, cache_end {fields.get('cache_end', 1)}\n")
    print(f"uncached: denoise {baseline_s:.2f} s; seed {fields['seed'] + 1} against seed {fields['seed']} "
          f"(a different picture): relative L2 {relative_distance(other_seed['samples'], reference):.3f}\n")
    print("| method | threshold | computed | reused | denoise s | speed-up | relative L2 to uncached |\n"
          "|---|---|---|---|---|---|---|")
    for method, threshold, result, info in runs:
        seconds = _denoise_s(info)
        print(f"| {method} | {threshold:g} | {info['cache']['computed']} | {info['cache']['reused']} | "
              f"{seconds:.2f} | {baseline_s / seconds:.2f}× | {relative_distance(result['samples'], reference):.2e} |")
    return 0
