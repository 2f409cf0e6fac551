"""Chroma (diffusers' ChromaTransformer2DModel run from the family's own loop): a file in the original layout (ComfyUI's
and lodestones') loads as the built-in it was written from, and the model equals ComfyUI's own Chroma — its 344
modulation vectors, their places and the final layer's — with guidance 0 (ComfyUI's default) and FluxGuidance's.
Every layout's parity with serial: test_parity.py's family rows."""

import math
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from backend.test_model_files import bfl_blocks
from xdit_backend.models import chroma, registry
from xdit_backend.selftest import models as selftest
from xdit_backend.service.reference import serial_latent

TINY = registry.BUILTINS["chroma-tiny"].config


def original_state_dict(transformer) -> dict[str, torch.Tensor]:
    """diffusers' Chroma → the original key layout (Flux's block names without their modulation layers, the
    approximator's own), written out here independently of the loader."""
    sd = transformer.state_dict()
    out = {}

    def linear(original, ours, bias=True):
        out[f"{original}.weight"] = sd[f"{ours}.weight"]
        if bias:
            out[f"{original}.bias"] = sd[f"{ours}.bias"]

    for original, ours in [("img_in", "x_embedder"), ("txt_in", "context_embedder"), ("final_layer.linear", "proj_out"),
                           ("distilled_guidance_layer.in_proj", "distilled_guidance_layer.in_proj"),
                           ("distilled_guidance_layer.out_proj", "distilled_guidance_layer.out_proj")]:
        linear(original, ours)
    for i in range(len(transformer.distilled_guidance_layer.layers)):
        linear(f"distilled_guidance_layer.layers.{i}.in_layer", f"distilled_guidance_layer.layers.{i}.linear_1")
        linear(f"distilled_guidance_layer.layers.{i}.out_layer", f"distilled_guidance_layer.layers.{i}.linear_2")
        out[f"distilled_guidance_layer.norms.{i}.scale"] = sd[f"distilled_guidance_layer.norms.{i}.weight"]
    out.update(bfl_blocks(transformer, modulated=False))  # Flux's block names, without the modulation layers
    return {key: value.contiguous() for key, value in out.items()}


def test_building_the_model_prints_no_deprecation_warning():
    """diffusers 0.42's ChromaTransformer2DModel builds the FluxPosEmbed it deprecates; a load must not say so."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        registry.build("chroma-tiny", torch.device("cpu"))


def sinusoid_frequencies_moved(values: torch.Tensor, channels: int, ulps: int) -> torch.Tensor:
    """ComfyUI's timestep_embedding ([cos, sin] of 1000·values at 10000^(−k/half), float32) written out, each
    frequency ``ulps`` float32 ulps up: what a device whose exp rounds otherwise may compute."""
    half = channels // 2
    frequencies = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)  # [half]
    for _ in range(ulps):
        frequencies = torch.nextafter(frequencies, torch.full_like(frequencies, 2.0))
    angles = (values.float() * 1000)[:, None] * frequencies[None]  # [len, half]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)  # [len, channels]


def test_the_selftests_chroma_bound_covers_one_ulp_of_the_devices_exp(monkeypatch):
    """The modulation index is sin/cos of up to 344 000 rad in float32, made on the device as ComfyUI makes it:
    one ulp more in each frequency moves the latent past the selftest's general float32 bound (device against
    CPU), and within the bound it holds chroma to (selftest/models.py; the H200 measured 1.8e-4)."""
    index = torch.arange(344)
    assert torch.equal(sinusoid_frequencies_moved(index, 32, ulps=0), chroma.sinusoid(index, 32))
    request = selftest.fields("chroma-tiny", SimpleNamespace(quick=False))
    reference = selftest.run("chroma-tiny", torch.device("cpu"), torch.float32, request)
    monkeypatch.setattr(chroma, "sinusoid", lambda values, channels: sinusoid_frequencies_moved(values, channels, 1))
    moved, _ = selftest.distance(selftest.run("chroma-tiny", torch.device("cpu"), torch.float32, request), reference)
    assert selftest.FLOAT32_TOLERANCE < moved <= selftest.FLOAT32_TOLERANCE_OF["chroma-tiny"]


@pytest.fixture(scope="module")
def chroma_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chroma") / "chroma-tiny.safetensors"
    save_file(original_state_dict(registry.build("chroma-tiny", torch.device("cpu")).transformer), str(path))
    return str(path)


def test_a_file_in_the_original_layout_loads_as_the_built_in(chroma_file):
    """Told from a Flux file by its approximator; its config read off the shapes."""
    source = registry.resolve(chroma_file)
    assert source.family == "chroma"
    assert {k: source.config[k] for k in TINY if k != "axes_dims_rope"} == {k: v for k, v in TINY.items()
                                                                         if k != "axes_dims_rope"}
    fields = {"model": "chroma-tiny", "width": 64, "height": 48, "steps": 3, "seed": 4, "cfg": 3.0,
              "dtype": "float32"}
    g = torch.Generator().manual_seed(2)
    tensors = {"context": torch.randn(1, 8, 64, generator=g), "negative_context": torch.randn(1, 8, 64, generator=g)}
    assert torch.equal(serial_latent({**fields, "model": chroma_file}, tensors), serial_latent(fields, tensors))


needs_comfyui = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                   reason="needs a ComfyUI checkout: set COMFYUI_DIR to compare with ComfyUI's Chroma")


@needs_comfyui
@pytest.mark.parametrize("guidance", [0.0, 4.0], ids=["default", "flux-guidance"])
def test_the_model_equals_comfyuis_chroma(chroma_file, guidance):
    """ComfyUI's own Chroma of the same file (comfy/ldm/chroma/model.py, the tiny sizes given), its forward with the
    guidance ComfyUI's Chroma.extra_conds puts on the call: our velocity within 1e-5."""
    sys.path.insert(0, os.environ["COMFYUI_DIR"])
    from comfy.cli_args import args

    args.cpu = True
    import comfy.ldm.chroma.model
    import comfy.ops
    from safetensors.torch import load_file

    width = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    theirs = comfy.ldm.chroma.model.Chroma(
        operations=comfy.ops.disable_weight_init, in_channels=64, out_channels=64, context_in_dim=64,
        hidden_size=width, mlp_ratio=4.0, num_heads=TINY["num_attention_heads"], depth=TINY["num_layers"],
        depth_single_blocks=TINY["num_single_layers"], axes_dim=list(TINY["axes_dims_rope"]), theta=10000,
        patch_size=2, qkv_bias=True, in_dim=64, out_dim=width, hidden_dim=TINY["approximator_hidden_dim"],
        n_layers=TINY["approximator_layers"])
    missing, unexpected = theirs.load_state_dict(load_file(chroma_file), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    model = registry.build(chroma_file, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    x, context = torch.randn(2, 16, 6, 8, generator=g), torch.randn(2, 7, 64, generator=g)
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        expected = theirs(x, sigma, context, torch.full((2,), guidance))
        ours = model.output(x, sigma, {"context": context}, guidance)
    assert (ours - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())


def test_a_lora_in_the_original_names_patches_blocks_and_approximator(tmp_path):
    """ComfyUI-named LoRA keys (a fused qkv band, a single block's linear1, an approximator layer) all land through
    the converter's table, and move the model's output."""
    from xdit_backend.models import lora

    g = torch.Generator().manual_seed(0)
    pairs = {"double_blocks.0.img_attn.qkv": (64, 192), "single_blocks.1.linear1": (64, 448),
             "distilled_guidance_layer.layers.0.in_layer": (64, 64)}
    state = {}
    for module, (inputs, outputs) in pairs.items():
        state[f"diffusion_model.{module}.lora_A.weight"] = torch.randn(4, inputs, generator=g) * 0.1
        state[f"diffusion_model.{module}.lora_B.weight"] = torch.randn(outputs, 4, generator=g) * 0.1
    path = tmp_path / "chroma-lora.safetensors"
    save_file(state, str(path))
    patched = registry.build("chroma-tiny", torch.device("cpu"), loras=lora.parse([{"path": str(path),
                                                                                    "strength": 1.0}]))
    assert [(r["merged_modules"], r["unmatched_keys"]) for r in patched.lora_reports] == [(3, 0)]
    plain = registry.build("chroma-tiny", torch.device("cpu"))
    x, context = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 5, 64, generator=g)
    with torch.no_grad():
        moved = patched.output(x, torch.tensor([0.5]), {"context": context}, 0.0) - \
            plain.output(x, torch.tensor([0.5]), {"context": context}, 0.0)
    assert moved.abs().max() > 1e-3


def test_a_gguf_file_keeps_its_blocks_quantized_and_matches_the_dequantized_model(tmp_path):
    """A Q8_0 GGUF in city96's layout (the original names; 1-D tensors, embedders, final layer and the approximator's
    input F32): its block matrices stay quantized, and it computes what the same values dequantized do."""
    pytest.importorskip("gguf")  # the optional extra "gguf" (installed in CI)
    from xdit_backend.models.storage import StoredLinear
    from xdit_backend.selftest.files import gguf_file

    plain = ("img_in.", "txt_in.", "final_layer.", "distilled_guidance_layer.in_proj.")
    original = original_state_dict(registry.build("chroma-tiny", torch.device("cpu")).transformer)
    reference = gguf_file(original, tmp_path / "chroma-q8_0.gguf", "Q8_0",
                          plain=lambda key, value: value.dim() == 1 or key.startswith(plain))
    save_file(reference, str(tmp_path / "reference.safetensors"))
    loaded = registry.build(str(tmp_path / "chroma-q8_0.gguf"), torch.device("cpu"))
    expected = registry.build(str(tmp_path / "reference.safetensors"), torch.device("cpu"))
    stored = [m for m in loaded.transformer.transformer_blocks.modules() if isinstance(m, StoredLinear)]
    assert loaded.spec.family == "chroma" and stored and all(m.weight.dtype == torch.uint8 for m in stored)
    g = torch.Generator().manual_seed(1)
    x, context = torch.randn(1, 16, 4, 6, generator=g), torch.randn(1, 5, 64, generator=g)
    with torch.no_grad():
        out = loaded.output(x, torch.tensor([0.5]), {"context": context}, 0.0)
        want = expected.output(x, torch.tensor([0.5]), {"context": context}, 0.0)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()


def test_prompts_of_different_lengths_under_ulysses_equal_serial(backend):
    """T5's text is unpadded, so the two sides often differ in length and run one after the other; Chroma runs its
    blocks from its own loop (never the transformer's forward), so the sequence split must forget the first side's
    lengths before the second's call."""
    g = torch.Generator().manual_seed(4)
    tensors = {"context": torch.randn(1, 8, 64, generator=g), "negative_context": torch.randn(1, 5, 64, generator=g)}
    fields = {"model": "chroma-tiny", "width": 128, "height": 64, "steps": 2, "seed": 3, "cfg": 3.0}
    expected = serial_latent(fields, tensors)
    result, _ = backend(2).sample({**fields, "parallel": {"ulysses": 2}}, tensors)
    assert (result["samples"] - expected).abs().max().item() <= 1e-4 * max(1.0, expected.abs().max().item())
