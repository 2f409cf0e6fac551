"""The layout and cache benchmarks in smoke mode (tiny model, 2 steps, world 1 and 2): every figure is reported, in the
table, the JSON and the plot, and the counted bytes equal the formulas. No timing is asserted: timings live in the bench.
The layout benches run on the session's backends; the cache bench starts and stops its own, as the CLI does."""

import json

from xdit_backend.bench.layouts import run_cache_bench, run_layout_bench

from unit.test_bench import FIELDS

SUMMARY_FIELDS = {"layout", "method", "world", "described", "step_median_s", "step_min_s", "step_max_s",
                  "step_spread", "denoise_s", "sent_bytes_per_rank_per_step", "peak_memory_bytes", "memory_kind",
                  "largest_rank_parameters", "process_groups_created", "speedup", "efficiency", "dtype", "attention",
                  "gathered_bytes_per_rank_per_step", "gathered_formula_bytes", "largest_rank_parameter_bytes"}


def test_bench_reports_every_figure_as_table_json_and_plot(tmp_path, capsys, backend):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert run_layout_bench(["serial", "ulysses=2", "cfg=2"], FIELDS, json_path, plot_path, running=backend) == 0
    table = capsys.readouterr().out
    assert table.count("\n| ") == 4 and "| ulysses=2 | 2 |" in table  # header + three layouts
    report = json.loads(json_path.read_text())
    assert [s["layout"] for s in report["layouts"]] == ["serial", "ulysses=2", "cfg=2"]
    for summary in report["layouts"]:
        assert set(summary) == SUMMARY_FIELDS, summary
        assert summary["step_median_s"] > 0 and summary["denoise_s"] >= summary["step_median_s"]
        assert summary["peak_memory_bytes"] > 0 and summary["speedup"] > 0
        assert summary["efficiency"] == summary["speedup"] / summary["world"]
        assert summary["process_groups_created"] == 0  # the warm-up request built the mesh: none per request
    serial, ulysses, cfg = report["layouts"]
    assert serial["sent_bytes_per_rank_per_step"] == 0 and ulysses["sent_bytes_per_rank_per_step"] > 0
    # which attention ran: diffusers' processors (PyTorch's SDPA backend) in the serial baseline and
    # under cfg, our kernel under sequence parallelism
    assert serial["attention"].startswith("sdpa ") and cfg["attention"].startswith("sdpa ")
    assert ulysses["attention"] == "cpu-flash" and {s["dtype"] for s in report["layouts"]} == {"float32"}
    assert serial["speedup"] == 1.0 and len(report["records"][1]["profile"]) == 2  # one record per rank
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """The bench's markdown table: {layout: {column name: cell}}."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    names = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["layout"]: row for row in rows}


def test_the_formula_counts_bytes_in_the_request_dtype(capsys, backend):
    """In bfloat16 the model's traffic (all-to-all, ring, velocity) is 2 bytes a value and CFG's x0
    stays float32: the counted bytes equal the formula's, layout by layout; so do weight sharding's
    gathers (bf16 weights), in their own columns."""
    fields = {**FIELDS, "dtype": "bfloat16"}
    assert run_layout_bench(["ulysses=2", "ring=2", "cfg=2", "ulysses=2,shard"], fields, running=backend) == 0
    rows = table_rows(capsys.readouterr().out)
    assert set(rows) == {"ulysses=2", "ring=2", "cfg=2", "ulysses=2,shard"}
    for layout, row in rows.items():
        assert float(row["sent/rank/step KiB"]) > 0
        assert row["sent/rank/step KiB"] == row["formula KiB"], (layout, row)
        assert row["weights gathered/rank/step KiB"] == row["its formula KiB"], (layout, row)
    assert float(rows["ulysses=2,shard"]["weights gathered/rank/step KiB"]) > 0
    assert float(rows["ulysses=2"]["weights gathered/rank/step KiB"]) == 0
    sharded, whole = (float(rows[k]["largest rank's parameters MiB"]) for k in ("ulysses=2,shard", "ulysses=2"))
    assert sharded < whole


def test_the_cache_bench_reports_consistent_counts_and_distances(capsys, zygote_launches):
    """Every step is computed or reused; threshold 0 reuses nothing and is the uncached latent exactly;
    a reused step moves the latent, by less than another seed does."""
    steps, start, end = 6, 2, 1
    fields = {**FIELDS, "steps": steps, "cfg": 1.0, "cache_start": start, "cache_end": end}
    assert run_cache_bench(fields, ["fbcache", "teacache"], [0.0, 0.5]) == 0  # on a backend it starts and stops
    out = capsys.readouterr().out
    seeds = float(out.split("(a different picture): relative L2 ")[1].split()[0])
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    names = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    assert [(row["method"], row["threshold"]) for row in rows] == [
        ("fbcache", "0"), ("fbcache", "0.5"), ("teacache", "0"), ("teacache", "0.5")]
    assert seeds > 0.5  # two seeds: a different picture
    assert any(int(row["reused"]) for row in rows)  # the threshold 0.5 reuses on this model
    for row in rows:
        computed, reused, distance = int(row["computed"]), int(row["reused"]), float(row["relative L2 to uncached"])
        assert computed + reused == steps and reused <= steps - start - end, row
        assert float(row["denoise s"]) > 0 and row["speed-up"].endswith("×")
        if row["threshold"] == "0":
            assert reused == 0 and distance == 0, row
        assert (distance > 0) == (reused > 0) and distance < seeds, row


def test_the_model_call_bench_runs_both_ways_in_and_gets_the_same_latent(capsys, zygote_launches):
    """``bench model-call`` in smoke mode: the xDiT MODEL's Euler (one evaluate request per step) and the xDiT
    Sampler's give the same latent bit for bit; a step sends the latent and gets the output back, the
    conditioning only once."""
    from xdit_backend.bench.model_call import run_model_call_bench

    assert run_model_call_bench("flux-tiny", (1,), 64, 64, 3, 1) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 | serial |")]
    assert len(row) == 1, row
    cells = [cell.strip() for cell in row[0].strip("|").split("|")]
    assert cells[5] == f"{16 * 8 * 8 * 4 + 2 * 4} + {16 * 8 * 8 * 4}"  # x, timestep, guidance out; output back
    assert cells[6] == str((8 * 64 + 32) * 4)  # flux-tiny's context [1, 8, 64] and pooled [1, 32], once
    assert cells[7] == "0"
