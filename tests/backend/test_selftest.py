"""``xdit-backend selftest``, the GPU smoke suite: without CUDA it skips and says why; its CPU dry run
runs every section that can run on the CPU and none fails; a wrong kernel makes its sections FAIL.

The GPU sections themselves (compile, the full-size model, host syncs) run only on a GPU: these
tests make sure the suite's own code is sound before a GPU's time is spent on it.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xdit_backend.parallel import attention
from xdit_backend.selftest import runner


def test_without_cuda_it_skips_and_says_why(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert runner.run_selftest(tmp_path / "out") == 0
    said = capsys.readouterr().out
    assert said.startswith("SKIP  selftest — no CUDA device: torch ") and "--cpu" in said
    assert not (tmp_path / "out").exists()  # nothing ran


@pytest.mark.timeout(660)  # its own bound is the subprocess's 600 s: ~60 s alone, 190–300 s under the suite's load
def test_the_cpu_dry_run_runs_every_section_and_none_fails(tmp_path):
    done = subprocess.run([sys.executable, "-m", "xdit_backend.cli", "selftest", "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    results = {r["section"]: r for r in json.loads((tmp_path / "selftest.json").read_text())}
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(results) == list(runner.NAMES)
    skipped = {name for name, r in results.items() if r["verdict"] == "SKIP"}
    assert skipped == {"syncs", "compile", "shares", "full-size", "demo"}, {n: results[n]["reason"] for n in skipped}
    assert all(r["verdict"] == "PASS" for name, r in results.items() if name not in skipped)
    assert results["families"]["figures"]["wan-tiny_weights_max_diff"] == 0.0
    assert results["fault"]["figures"]["error_kind"] == "out_of_memory"
    stored = results["storage"]["figures"]
    for form, name in (("fp8", "float8_e4m3fn"), ("scaled_fp8", "float8_e4m3fn scaled"), ("gguf_q8_0", "gguf Q8_0"),
                       ("weight_dtype_fp8", "float8_e4m3fn")):
        assert stored[f"flux-tiny_{form}_storage"] == name
        assert stored[f"flux-tiny_{form}_held_mib"] < 0.6 * stored["flux-tiny_bf16_held_mib"]  # 1 byte, not 2
    assert stored["flux-tiny_gguf_q4_k_storage"] == "bfloat16+gguf Q4_K"  # flux-tiny's rows of 256 values and more
    memory = results["memory"]["figures"]
    assert memory["fp8_128_predicted_weights_mib"] < 0.6 * memory["bf16_128_predicted_weights_mib"]
    assert memory["lora_1_vs_base_rel"] > memory["lora_0.5_vs_base_rel"] > 0
    for name in runner.NAMES:
        assert f"  {name}" in done.stdout  # one line per section


def test_a_kernel_with_a_wrong_log_sum_exp_fails_the_kernel_sections(tmp_path, monkeypatch, capsys):
    right = attention.local_attention

    def shifted(device):
        kernel = right(device)
        return lambda q, k, v, **kw: (lambda out, lse: (out, lse + 0.5))(*kernel(q, k, v, **kw))

    monkeypatch.setattr(attention, "local_attention", shifted)
    assert runner.run_selftest(tmp_path, ("attention", "ring"), cpu=True) == 1
    results = {r["section"]: r for r in json.loads((tmp_path / "selftest.json").read_text())}
    assert results["attention"]["verdict"] == "FAIL" and "lse" in results["attention"]["reason"]
    assert results["ring"]["verdict"] == "FAIL"  # yunchang's merge weighs the chunks by the wrong LSE
    assert "FAILED: attention, ring" in capsys.readouterr().out


def test_an_unknown_section_is_refused_with_the_list(tmp_path, capsys):
    assert runner.run_selftest(tmp_path, ("attentoin",), cpu=True) == 2
    assert "unknown section(s) attentoin; the sections are: environment, attention" in capsys.readouterr().err


def test_a_section_planned_past_what_is_left_of_the_budget_is_not_started(tmp_path, capsys):
    """environment fits a budget of its plan + 4 s, attention's plan does not and is not started; lora's, after it,
    still fits and runs; the summary names what to run next."""
    plan = {section.name: section.gpu_s for section in runner.SECTIONS}
    budget = plan["environment"] + 4
    assert plan["attention"] > budget >= plan["environment"] + plan["lora"]
    assert runner.run_selftest(tmp_path, ("environment", "attention", "lora"), cpu=True, budget_s=budget) == 0
    results = {r["section"]: r for r in json.loads((tmp_path / "selftest.json").read_text())}
    assert [results[name]["verdict"] for name in ("environment", "attention", "lora")] == ["PASS", "SKIP", "PASS"]
    assert results["attention"]["cut"] and results["attention"]["seconds"] == 0
    assert results["attention"]["reason"].startswith(f"not started: planned {plan['attention']:.0f} s")
    assert all(results[name]["planned_s"] == plan[name] for name in results)
    said = capsys.readouterr().out
    assert "not started for the budget: attention; run them next: xdit-backend selftest --only attention" in said


def test_the_whole_plan_fits_the_gpu_scripts_budget():
    """The whole selftest is meant to run in one device call: the sections' planned seconds (H200 measurements)
    must fit in tools/gpu-selftest.sh's budget, allowing 30 s for what runs before the first section (the wheels'
    install, torch's import)."""
    script = (Path(__file__).parents[2] / "tools" / "gpu-selftest.sh").read_text()
    budget = int(re.search(r"XDIT_SELFTEST_BUDGET_S:-(\d+)", script)[1])
    assert sum(section.gpu_s for section in runner.SECTIONS) <= budget - 30


def test_the_full_size_sections_measurements_run_on_a_small_flux(tmp_path, zygote_launches):
    """The shares and full-size sections' code (shard compute three ways, the backend against the plain loop at
    two sizes with one backend) on flux-tiny on the CPU: the same functions the GPU run calls on Flux.1-dev."""
    from xdit_backend.models import registry
    from xdit_backend.selftest.scale import SHARDS, full_size_figures, shard_figures

    checks = runner.Checks()
    model = registry.build("flux-tiny", torch.device("cpu"))
    shard_figures(checks, model, 128, text=8)
    full_size_figures(checks, model, ((128, 3), (64, 3)))
    figures = checks.figures
    assert sorted(figures["shard_compute_s"]) == ["proxy", "ring", "ulysses"]
    for by_degree in figures["shard_compute_s"].values():
        assert sorted(by_degree) == sorted(str(p) for p in SHARDS) and all(t > 0 for t in by_degree.values())
    for side in (128, 64):
        run = figures[f"overhead_{side}"]
        assert run["width"] == side and run["plain_step_s"] > 0 and run["backend_step_s"] > 0
        assert run["dtype"] == "torch.float32" and run["device"] == "cpu"


def test_a_wrong_upcast_fails_the_storage_section(tmp_path, monkeypatch):
    """Stored weights upcast 5 % too large: every form's latent leaves the dequantised model's."""
    from xdit_backend.models.storage import StoredLinear

    right = StoredLinear.upcast
    monkeypatch.setattr(StoredLinear, "upcast", lambda self, dtype: right(self, dtype) * 1.05)
    assert runner.run_selftest(tmp_path, ("storage",), cpu=True) == 1
    reason = json.loads((tmp_path / "selftest.json").read_text())[0]["reason"]
    for form in ("fp8", "scaled_fp8", "gguf_q8_0", "weight_dtype_fp8"):  # (in flux-tiny only the wide layers are
        assert f"flux-tiny_{form}: latent" in reason                 # Q4_K: 5 % on them stays within tolerance)


def test_a_lora_patch_that_adds_nothing_fails_the_memory_section(tmp_path, monkeypatch):
    from xdit_backend.models import lora

    monkeypatch.setattr(lora, "_low_rank_addition", lambda pairs: lambda module, args, output: output)
    assert runner.run_selftest(tmp_path, ("memory",), cpu=True) == 1
    reason = json.loads((tmp_path / "selftest.json").read_text())[0]["reason"]
    assert "lora_0.5: patched" in reason and "the LoRA moved the latent" in reason


def test_the_samplers_section_draws_the_device_runs_noise_from_the_cpu_generator(monkeypatch):
    """Review B6: a CUDA generator draws other ancestral noise than the CPU reference's for the same seed,
    so the device run of every sampler draws from the CPU generator (the run on the device's own
    generator is only recorded)."""
    from xdit_backend.selftest import models

    calls = []

    def run(name, device, dtype, request, loras=(), after_step=None, cpu_noise=False):
        calls.append(cpu_noise)
        return torch.zeros(1)

    monkeypatch.setattr(models, "run", run)
    models.samplers(runner.Context(torch.device("cpu"), None, quick=True), runner.Checks())
    references, device_runs = calls[0::2], calls[1::2]
    assert len(device_runs) == len(models.SAMPLERS) and all(device_runs) and not any(references)
