"""The benchmark harness in-process: method names, the scaling model, the formulas' inputs, the cache bench's
command line (the benches themselves run backends: tests/backend/test_bench.py)."""

import pytest

from xdit_backend.bench.layouts import flux_dims, method_of

FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "batch": 1, "cfg": 3.5, "seed": 1,
          "dtype": "auto"}
def test_methods_are_named_without_their_degrees():
    assert [method_of(t) for t in ("serial", "ulysses=4", "cfg=2,ring=2", "pipefusion=2,patches=4", "cfg=2,shard")] == [
        "serial", "ulysses", "cfg×ring", "pipefusion", "cfg+shard"]


def test_the_scaling_model_is_labelled_and_follows_its_formulas(capsys):
    from xdit_backend.bench.scaling import run_scaling_model
    from xdit_backend.distributed.cost import NVLINK, PCIE, predict

    t1 = 0.24
    assert predict(t1, {}, NVLINK) == t1
    for degrees in ({"ulysses": 2}, {"ulysses": 4}, {"ring": 4}, {"ulysses": 2, "ring": 2}):
        world = degrees.get("ulysses", 1) * degrees.get("ring", 1)
        fast, slow = predict(t1, degrees, NVLINK), predict(t1, degrees, PCIE)
        assert t1 / world < fast < slow  # never better than the ideal share; PCIe never beats NVLink
    assert predict(t1, {"ulysses": 4}, NVLINK) < predict(t1, {"ulysses": 2}, NVLINK)
    run_scaling_model()
    assert "MODELED" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["flux-tiny", "flux-dev-random"])
def test_the_formula_takes_the_text_tokens_of_the_prompt_the_model_gets(model):
    from xdit_backend.models import registry

    positive, _ = registry.random_conditioning(model, 1, 1, registry.spec(model))  # what a bench request gets
    assert flux_dims(model)["text_tokens"] == positive["context"].shape[1]


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


def test_the_control_bench_times_our_share_and_the_peers_whole(capsys):
    """bench control's table at a narrow width (2 heads of 128): a row per degree, its share of the tokens, and no
    bytes sent for the patch (per token: nothing to exchange)."""
    from xdit_backend.bench.control import run_control_bench

    assert run_control_bench(side=64, ranks=(1, 2), repeats=1, heads=2) == 0
    table = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    patch, controlnet = [row for row in table if len(row) == 8], [row for row in table if len(row) == 5]
    assert [row[0].strip() for row in patch[1:]] == ["1", "2"]
    assert [int(row[1]) for row in patch[1:]] == [16, 8]  # 64 px: 4 × 4 tokens, halved
    assert all(float(row[3]) > 0 and float(row[5]) > 0 and row[7].strip() == "0" for row in patch[1:])
    # the ControlNet's 5 blocks, derived: split as the model, 5 / 65 of the step at any degree; at one rank the same
    # either way (the timings themselves are the bench's, not asserted)
    ours, theirs = ([int(row[column].strip(" %")) for row in controlnet[1:]] for column in (2, 4))
    assert ours == [8, 8] and theirs[0] == 8


def test_the_flux_controlnet_bench_derives_its_share_and_counts_its_bytes(capsys):
    """bench control --family flux at a narrow width (2 heads of 128), 64 px: a row per degree; no residual bytes;
    the Ulysses bytes as the shapes give them (15 blocks × q, k, v, out × this rank's tokens × width × 4 bytes, the
    half that leaves at 2 ranks; none at 1)."""
    from xdit_backend.bench.control import run_flux_controlnet_bench

    assert run_flux_controlnet_bench(side=64, ranks=(1, 2), repeats=1, heads=2) == 0
    table = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert [(row[0].strip(), int(row[1])) for row in table] == [("1", 16), ("2", 8)]
    assert [float(row[7]) for row in table] == [0.0, round(15 * 4 * (8 + 257) * 256 * 4 / 2 / 1e6, 1)]
    assert all(row[8].strip() == "0" and float(row[3]) > 0 for row in table)
