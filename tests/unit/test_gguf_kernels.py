"""The GGUF block kernels of models/gguf_blocks.py: each equals the gguf package's own numpy dequantisation
(an implementation independent of ours) on random blocks, and none makes the host wait for the device
(review gpu-paths-2 B8: diffusers' kernels copy a shift table from the host in every call, which
bench/sync_audit.py counts on ``meta`` as a GPU would sync)."""

import pytest
import torch

from xdit_backend.bench.sync_audit import count_syncs
from xdit_backend.models import gguf_blocks
from xdit_backend.models.storage import StoredLinear

gguf = pytest.importorskip("gguf")  # the optional extra "gguf" (installed in CI)
GGML = gguf.GGMLQuantizationType

SCALES_AT = {"Q6_K": (208,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}  # float16 fields


def random_blocks(name: str, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` blocks of type ``name`` with random bits, their float16 scales finite (d at byte 0 but where
    SCALES_AT says otherwise)."""
    values, size = gguf.GGML_QUANT_SIZES[GGML[name]]
    generator = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (count, size), generator=generator, dtype=torch.uint8)
    for start in SCALES_AT.get(name, (0,)):
        scale = torch.rand(count, generator=generator) * 1e-2 + 1e-3
        blocks[:, start:start + 2] = scale.half().view(torch.uint8).reshape(count, 2)
    return blocks


@pytest.mark.parametrize("name", list(gguf_blocks.KERNELS))
def test_each_kernel_equals_the_gguf_packages_dequantisation(name):
    blocks = random_blocks(name, 96)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), GGML[name]).copy()).reshape(96, -1)
    values = gguf_blocks.KERNELS[name](blocks)
    assert values.dtype == torch.float32 and values.shape == expected.shape
    torch.testing.assert_close(values, expected, rtol=1e-6, atol=0)


def gguf_linear(name: str, rows: int = 4, columns: int = 256) -> StoredLinear:
    """A StoredLinear holding ``name`` blocks on ``meta`` (the accelerator stand-in of the sync audit)."""
    values, size = gguf.GGML_QUANT_SIZES[GGML[name]]
    with torch.device("meta"):
        linear = torch.nn.Linear(columns, rows)
    linear.weight = torch.nn.Parameter(torch.empty(rows, columns // values * size, dtype=torch.uint8,
                                                   device="meta"), requires_grad=False)
    linear.__class__, linear.gguf_type = StoredLinear, int(GGML[name])
    return linear


@pytest.mark.parametrize("name", list(gguf_blocks.KERNELS))
def test_a_gguf_linear_makes_no_host_sync(name):
    linear = gguf_linear(name)
    with torch.no_grad(), count_syncs("meta") as syncs:
        out = linear(torch.empty(2, 256, device="meta"))
    assert out.shape == (2, 4) and syncs.total == 0, f"{name}: {syncs.total} host syncs per forward"


def test_the_audit_sees_diffusers_k_quant_kernels_sync():
    """Why ours: the kernel diffusers has for Q4_K, counted the same way, syncs (if it stops, this says so)."""
    blocks = torch.empty(4, gguf.GGML_QUANT_SIZES[GGML.Q4_K][1], dtype=torch.uint8, device="meta")
    with torch.no_grad(), count_syncs("meta") as syncs:
        gguf_blocks.dequantizers()[int(GGML.Q4_K)](blocks, 256, 144, torch.float32)
    assert syncs.total > 0
