"""The benchmark harness in smoke mode (tiny model, 2 steps, world 1 and 2): every figure is
reported, in the table, the JSON and the plot. No timing is asserted: timings live in the bench."""

import json

import pytest

from xdit_backend.bench.layouts import flux_dims, method_of, run_cache_bench, run_layout_bench

FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "batch": 1, "cfg": 3.5, "seed": 1,
          "dtype": "auto"}
SUMMARY_FIELDS = {"layout", "method", "world", "described", "step_median_s", "step_min_s", "step_max_s",
                  "step_spread", "denoise_s", "sent_bytes_per_rank_per_step", "peak_memory_bytes", "memory_kind",
                  "largest_rank_parameters", "process_groups_created", "speedup", "efficiency", "dtype", "attention",
                  "gathered_bytes_per_rank_per_step", "gathered_formula_bytes", "largest_rank_parameter_bytes"}


def test_bench_reports_every_figure_as_table_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    assert run_layout_bench(["serial", "ulysses=2", "cfg=2"], FIELDS, json_path, plot_path) == 0
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


def test_methods_are_named_without_their_degrees():
    assert [method_of(t) for t in ("serial", "ulysses=4", "cfg=2,ring=2", "pipefusion=2,patches=4", "cfg=2,shard")] == [
        "serial", "ulysses", "cfg×ring", "pipefusion", "cfg+shard"]


def test_the_scaling_model_is_labelled_and_follows_its_formulas(capsys):
    from xdit_backend.distributed.scaling import NVLINK, PCIE, predict, run_scaling_model

    t1 = 0.24
    assert predict(t1, {}, NVLINK) == t1
    for degrees in ({"ulysses": 2}, {"ulysses": 4}, {"ring": 4}, {"ulysses": 2, "ring": 2}):
        world = degrees.get("ulysses", 1) * degrees.get("ring", 1)
        fast, slow = predict(t1, degrees, NVLINK), predict(t1, degrees, PCIE)
        assert t1 / world < fast < slow  # never better than the ideal share; PCIe never beats NVLink
    assert predict(t1, {"ulysses": 4}, NVLINK) < predict(t1, {"ulysses": 2}, NVLINK)
    run_scaling_model()
    assert "MODELED" in capsys.readouterr().out


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """The bench's markdown table: {layout: {column name: cell}}."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    names = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(names, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["layout"]: row for row in rows}


def test_the_formula_counts_bytes_in_the_request_dtype(capsys):
    """In bfloat16 the model's traffic (all-to-all, ring, velocity) is 2 bytes a value and CFG's x0
    stays float32: the counted bytes equal the formula's, layout by layout; so do weight sharding's
    gathers (bf16 weights), in their own columns."""
    fields = {**FIELDS, "dtype": "bfloat16"}
    assert run_layout_bench(["ulysses=2", "ring=2", "cfg=2", "ulysses=2,shard"], fields) == 0
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


@pytest.mark.parametrize("model", ["flux-tiny", "flux-dev-random"])
def test_the_formula_takes_the_text_tokens_of_the_prompt_the_model_gets(model):
    from xdit_backend.models import registry

    positive, _ = registry.random_conditioning(model, 1, 1, registry.spec(model))  # what a bench request gets
    assert flux_dims(model)["text_tokens"] == positive["context"].shape[1]


def test_the_cache_bench_reports_consistent_counts_and_distances(capsys):
    """Every step is computed or reused; threshold 0 reuses nothing and is the uncached latent exactly;
    a reused step moves the latent, by less than another seed does."""
    steps, start, end = 6, 2, 1
    fields = {**FIELDS, "steps": steps, "cfg": 1.0, "cache_start": start, "cache_end": end}
    assert run_cache_bench(fields, ["fbcache", "teacache"], [0.0, 0.5]) == 0
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


def test_the_cli_passes_the_cache_bench_its_request(monkeypatch):
    import xdit_backend.bench.layouts as bench
    from xdit_backend import cli

    calls = []
    monkeypatch.setattr(bench, "run_cache_bench", lambda *args: calls.append(args) or 0)
    assert cli.main(["bench", "cache", "--model", "wan-tiny", "--width", "256", "--height", "128", "--frames", "9",
                     "--steps", "12", "--methods", "teacache", "--thresholds", "0.1", "0.4",
                     "--layout", "ulysses=2"]) == 0
    (fields, methods, thresholds, layout, device), = calls
    assert fields == {"model": "wan-tiny", "width": 256, "height": 128, "steps": 12, "batch": 1, "cfg": 1.0,
                      "seed": 1, "dtype": "auto", "frames": 9}
    assert (methods, thresholds, layout, device) == (["teacache"], [0.1, 0.4], "ulysses=2", "cpu")
