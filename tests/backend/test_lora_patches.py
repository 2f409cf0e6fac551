"""LoRAs without copies: the executor keeps one resident base and makes it carry each request's LoRAs.

Five strength changes leave one base resident, the bytes it holds flat to within the LoRA's own size,
and each latent equals the one a merged reference gives (W + s·(B·A)·(α/r), merged here into a
separately built model); removing the LoRA gives the base's latent exactly; a compiled base sees
LoRAs added, re-weighted and removed after it was compiled; and a LoRA works on an fp8-stored base.
"""

from datetime import timedelta

import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.utils import counters

from xdit_backend.distributed.runtime import Runtime
from xdit_backend.models import registry
from xdit_backend.models.lora import LoraFiles, LoraSpec
from xdit_backend.service.executor import Executor
from xdit_backend.service.reference import serial_latent
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

WIDTH, RANK, ALPHA = 64, 4, 2.0  # flux-tiny's width; the LoRA's rank and alpha
FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "seed": 5}


@pytest.fixture(scope="module")
def lora_file(tmp_path_factory):
    """A kohya LoRA on double block 0's fused img qkv (3·D rows) and a PEFT one on single block 1's
    proj_out: (path, {diffusers weight key: its B·A·α/r at strength 1})."""
    g = torch.Generator().manual_seed(3)
    qkv_up, qkv_down = torch.randn(3 * WIDTH, RANK, generator=g), torch.randn(RANK, WIDTH, generator=g)
    out_up, out_down = torch.randn(WIDTH, RANK, generator=g), torch.randn(RANK, 5 * WIDTH, generator=g)
    path = tmp_path_factory.mktemp("loras") / "style.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": qkv_down,
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": qkv_up,
               "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(ALPHA),
               "transformer.single_transformer_blocks.1.proj_out.lora_A.weight": out_down,
               "transformer.single_transformer_blocks.1.proj_out.lora_B.weight": out_up,
               "transformer.single_transformer_blocks.1.proj_out.alpha": torch.tensor(ALPHA)}, str(path))
    qkv = qkv_up @ qkv_down * (ALPHA / RANK)  # [3·D, D]: q, k, v rows
    deltas = {f"transformer_blocks.0.attn.{name}.weight": qkv[i * WIDTH:(i + 1) * WIDTH]
              for i, name in enumerate(("to_q", "to_k", "to_v"))}
    deltas["single_transformer_blocks.1.proj_out.weight"] = out_up @ out_down * (ALPHA / RANK)
    return str(path), deltas


def request(**fields) -> SampleRequest:
    spec = registry.spec("flux-tiny")
    positive, _ = registry.random_conditioning("flux-tiny", 1, FIELDS["seed"], spec)
    return SampleRequest.parse(Message("sample", {**FIELDS, **fields}, positive))


def executor() -> Executor:
    return Executor(Runtime(0, 1, 0, torch.device("cpu"), None, 0.0, timedelta(seconds=30)))


def merged_reference(deltas: dict, strength: float) -> torch.Tensor:
    """The latent of a flux-tiny whose weights are W + strength·ΔW, merged here."""
    model = registry.build("flux-tiny", torch.device("cpu"))
    weights = dict(model.transformer.named_parameters())
    with torch.no_grad():
        for key, delta in deltas.items():
            weights[key] += strength * delta
    positive, _ = registry.random_conditioning("flux-tiny", 1, FIELDS["seed"], model.spec)
    return serial_latent(FIELDS, positive, model=model)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_strength_changes_keep_one_base_and_equal_the_merged_references(lora_file):
    path, deltas = lora_file
    lora_bytes = sum(t.numel() * 4 for t in (torch.empty(3 * WIDTH, RANK), torch.empty(RANK, WIDTH),
                                             torch.empty(WIDTH, RANK), torch.empty(RANK, 5 * WIDTH)))
    ex = executor()
    base = ex.generate(request(), lambda done, total: True)
    base_bytes = ex.held_bytes()
    resident = ex.computing.transformer
    for strength in (0.5, 1.0, -0.7, 1.3, 0.2):
        latent = ex.generate(request(loras=[{"path": path, "strength": strength}]), lambda done, total: True)
        assert len(ex.cache.entries) == 1 and ex.computing.transformer is resident, "the base was loaded again"
        assert base_bytes <= ex.held_bytes() <= base_bytes + lora_bytes, (base_bytes, ex.held_bytes(), lora_bytes)
        assert relative(latent, merged_reference(deltas, strength)) <= 1e-4, strength
        assert (latent - base).abs().max() > 1e-3, "the LoRA changed nothing"
        report = ex.computing.lora_reports[0]
        assert report["merged_modules"] == 2 and report["unmatched_keys"] == 0 and report["strength"] == strength
    assert torch.equal(ex.generate(request(), lambda done, total: True), base), "removing the LoRA is not exact"
    assert ex.held_bytes() == base_bytes, "the LoRA's tensors outlived its last use"
    assert ex.describe_models()[0]["loras"] == [] and ex.loaded() == ["flux-tiny (float32)"]


@pytest.mark.timeout(900)  # inductor on one core: a few minutes
def test_a_compiled_base_sees_loras_added_changed_and_removed_after_compiling(lora_file):
    """One base, compiled on its first request; then a LoRA added, its strength changed and removed.
    Each compiled latent equals the eager one on the same base; a strength change compiles nothing."""
    path, _ = lora_file
    ex = executor()
    run = lambda compiled, loras=(): ex.generate(request(compile=compiled, loras=list(loras)),  # noqa: E731
                                                 lambda done, total: True)
    base = run(False)
    assert (run(True) - base).abs().max() <= 1e-4
    for strength in (0.5, 1.5):
        lora = [{"path": path, "strength": strength}]
        before = counters["stats"]["unique_graphs"]
        compiled = run(True, lora)
        if strength == 1.5:
            assert counters["stats"]["unique_graphs"] == before, "a strength change compiled again"
        eager = run(False, lora)
        assert (eager - base).abs().max() > 1e-3
        assert (compiled - eager).abs().max() <= 1e-4, f"strength {strength}: the compiled blocks missed the LoRA"
    assert (run(True) - base).abs().max() <= 1e-4, "the compiled blocks kept a removed LoRA"
    assert len(ex.cache.entries) == 1


def test_a_lora_on_an_fp8_base_adds_its_low_rank_term_and_leaves_the_fp8_weight(lora_file):
    """An fp8-stored base (diffusers' layerwise casting: the weight stays float8 and is upcast at each
    call): the patched output is the fp8 base's output plus s·(α/r)·(x·Aᵀ)·Bᵀ, and the weight stays fp8."""
    path, deltas = lora_file
    model = registry.build("flux-tiny", torch.device("cpu"))
    model.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    proj_out = model.transformer.single_transformer_blocks[1].proj_out
    x = torch.randn(3, 5 * WIDTH, generator=torch.Generator().manual_seed(4))  # [tokens, 5·D]: attention + MLP
    with torch.no_grad():
        base = proj_out(x)
        model.lora_reports = model.patches.carry([LoraSpec(path, 0.8)], LoraFiles(torch.device("cpu")))
        patched = proj_out(x)
    expected = base + 0.8 * x @ deltas["single_transformer_blocks.1.proj_out.weight"].T
    assert relative(patched, expected) <= 1e-5 and proj_out.weight.dtype == torch.float8_e4m3fn
    assert model.lora_reports[0]["merged_modules"] == 2


def test_a_lora_on_an_fsdp2_sharded_base_equals_it_on_the_whole_base(backend2, lora_file):
    """The hooks see a Linear's input and output only, so a LoRA works the same on blocks FSDP2 shards
    (gathered just before they run): sharded ulysses=2 + LoRA equals unsharded ulysses=2 + LoRA, and
    status shows the sharded model's smaller bytes per rank."""
    path, _ = lora_file
    backend2.unload()  # the session's backend: only this test's two models are listed below
    fields = {**FIELDS, "loras": [{"path": path, "strength": 0.8}]}
    whole, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}})
    sharded, info = backend2.sample({**fields, "parallel": {"ulysses": 2, "shard_weights": True}})
    assert info["loras"][0]["merged_modules"] == 2
    assert (sharded["samples"] - whole["samples"]).abs().max() <= 1e-4
    models = {m["sharded"]: m for m in backend2.status()["models"]}
    assert all(s < w for s, w in zip(models[True]["bytes_per_rank"], models[False]["bytes_per_rank"]))
    assert models[True]["loras"] == [{"path": path, "strength": 0.8}]
