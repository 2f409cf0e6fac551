"""The local attention kernel (attention.py): which kernel the rules pick on each kind of device,
the flash-attn import test, the "auto" dtype on CUDA, what ``status`` reports, and the CPU kernel
against a float64 reference. CUDA devices are described to the rules (or faked through
monkeypatched torch.cuda queries): no GPU runs here."""

import sys

import pytest
import torch

from xdit_backend.device import compute_dtype
from xdit_backend.parallel import attention
from xdit_backend.parallel.attention import DeviceFacts, choose_kernel

CPU = DeviceFacts("cpu")
GPU = torch.device("cuda", 0)


def cuda(capability, flash_attn=False, cudnn_attention=False) -> DeviceFacts:
    return DeviceFacts("cuda", capability, flash_attn, cudnn_attention)


@pytest.fixture(autouse=True)
def fresh_caches():
    """The import test and the device facts are cached per process: each test asks afresh."""
    attention.flash_attn_imports.cache_clear()
    attention.device_facts.cache_clear()
    yield
    attention.flash_attn_imports.cache_clear()
    attention.device_facts.cache_clear()


# (device facts, dtype, head size) → kernel, as the rules say (review finding 7 and 16)
RULES = [
    (CPU, torch.float32, 64, "cpu-flash"),
    (CPU, torch.bfloat16, 256, "cpu-flash"),
    (CPU, torch.float32, 20, "cpu-flash"),  # no alignment rule on the CPU
    # flash-attn only when it imports, for 16-bit floats and D ≤ 256, from sm 8.0
    (cuda((8, 0), flash_attn=True), torch.bfloat16, 128, "flash-attn"),
    (cuda((8, 6), flash_attn=True), torch.float16, 256, "flash-attn"),
    (cuda((8, 0), flash_attn=True), torch.float32, 128, "sdpa-efficient"),  # was flash-attn: "only fp16 and bf16"
    (cuda((8, 0), flash_attn=True), torch.bfloat16, 264, "sdpa-efficient"),
    (cuda((7, 5), flash_attn=True), torch.float16, 64, "sdpa-efficient"),  # a T4: flash-attn needs Ampere
    # PyTorch's flash kernel: 16-bit floats from sm 8.0; the memory-efficient one otherwise
    (cuda((8, 0)), torch.bfloat16, 128, "sdpa-flash"),
    (cuda((8, 9)), torch.float16, 72, "sdpa-flash"),
    (cuda((8, 0)), torch.float32, 128, "sdpa-efficient"),
    (cuda((7, 0)), torch.float16, 128, "sdpa-efficient"),  # a V100: was aten flash, "needs Ampere or newer"
    (cuda((7, 5)), torch.float32, 72, "sdpa-efficient"),
    # cuDNN attention on Hopper only, for 16-bit floats and D ≤ 128 (unverified on a GPU)
    (cuda((9, 0), flash_attn=True, cudnn_attention=True), torch.bfloat16, 128, "cudnn-attention"),
    (cuda((9, 0), cudnn_attention=True), torch.float16, 64, "cudnn-attention"),
    (cuda((9, 0), flash_attn=True, cudnn_attention=True), torch.bfloat16, 256, "flash-attn"),
    (cuda((9, 0), cudnn_attention=True), torch.float32, 128, "sdpa-efficient"),
    (cuda((9, 0)), torch.bfloat16, 128, "sdpa-flash"),  # no cuDNN 9
    (cuda((8, 9), cudnn_attention=True), torch.bfloat16, 128, "sdpa-flash"),  # Ada: not Hopper
]


@pytest.mark.parametrize("facts, dtype, head_dim, kernel", RULES, ids=lambda v: str(v))
def test_the_rules_pick_the_kernel(facts, dtype, head_dim, kernel):
    assert choose_kernel(facts, dtype, head_dim) == kernel


@pytest.mark.parametrize("facts, dtype, head_dim, says", [
    (cuda((7, 5)), torch.bfloat16, 64, "needs a GPU of sm 8.0 or newer, and this one is sm 7.5; use dtype float16"),
    (cuda((8, 0)), torch.float16, 20, "head size 20 is not a multiple of 8"),
    (cuda((8, 0)), torch.float64, 64, "torch.float64 has no fused CUDA kernel"),
    (DeviceFacts("mps"), torch.float32, 64, "no local attention kernel for device type 'mps'"),
])
def test_what_no_kernel_can_run_is_refused_with_the_rule(facts, dtype, head_dim, says):
    with pytest.raises(ValueError, match=says):
        choose_kernel(facts, dtype, head_dim)


def fake_package(root, body: str) -> None:
    (root / "flash_attn").mkdir()
    (root / "flash_attn" / "__init__.py").write_text(body)


@pytest.mark.parametrize("error", ["ImportError", "OSError"])
def test_a_flash_attn_that_fails_to_import_counts_as_absent(tmp_path, monkeypatch, error):
    """Built for another torch, flash-attn is found on the path but its import raises: not used."""
    import importlib.util

    fake_package(tmp_path, f"raise {error}('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert importlib.util.find_spec("flash_attn") is not None  # what the old check went by
    assert attention.flash_attn_imports() is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose_kernel(attention.device_facts(GPU), torch.bfloat16, 128) == "sdpa-flash"


def test_a_flash_attn_that_imports_is_used(tmp_path, monkeypatch):
    fake_package(tmp_path, "def flash_attn_func(*args, **kwargs):\n    raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    assert attention.flash_attn_imports() is True
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert choose_kernel(attention.device_facts(GPU), torch.bfloat16, 128) == "flash-attn"


def test_each_call_runs_the_kernel_for_its_own_dtype_and_head_size(monkeypatch):
    """One backend, one kernel function: a float32 request and a bfloat16 one get different kernels."""
    monkeypatch.setattr(attention, "device_facts", lambda device: cuda((8, 0)))
    ran = []
    fakes = {name: (lambda q, k, v, scale, name=name: ran.append((name, q.shape[-1])) or (q, q[..., 0]))
             for name in attention.KERNELS}
    monkeypatch.setattr(attention, "KERNELS", fakes)
    attend = attention.local_attention(GPU)
    for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 264)):
        q = torch.zeros(1, 4, 2, head_dim, dtype=dtype)
        attend(q, q, q)
    assert ran == [("sdpa-efficient", 64), ("sdpa-flash", 64), ("sdpa-efficient", 264)]


def fake_gpu(monkeypatch, capability: tuple[int, int]) -> None:
    """torch.cuda's answers for a GPU of ``capability``: bfloat16 native from sm 8.0, emulated before."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: capability >= (8, 0) or including_emulation)
    monkeypatch.setattr(attention, "flash_attn_imports", lambda: False)


@pytest.mark.parametrize("capability, dtype", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_is_bfloat16_only_where_the_gpu_computes_in_it(monkeypatch, capability, dtype):
    fake_gpu(monkeypatch, capability)
    assert compute_dtype("auto", GPU) == dtype
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bfloat16", GPU) == torch.bfloat16  # asked for: as asked


def test_status_names_the_kernel_the_rules_pick_for_the_default_dtype(monkeypatch):
    fake_gpu(monkeypatch, (7, 5))
    line = attention.status_line(GPU, compute_dtype("auto", GPU))
    assert line == "sdpa-efficient (float16, head dim 128, sm 7.5)"


SMALL_CASES = ((8, 8, 2, 0, 16), (5, 11, 3, 1, 24))  # (queries, keys, heads, zero heads, D): an odd key count


def test_the_cudnn_check_passes_a_kernel_that_agrees_with_the_reference():
    cpu = torch.device("cpu")
    assert attention.cudnn_check(attention._cpu_flash, attention._cpu_flash, cpu, torch.float32, SMALL_CASES) is None


def test_the_cudnn_check_names_the_shape_a_kernel_refuses_or_miscomputes():
    cpu, flash = torch.device("cpu"), attention._cpu_flash

    def refuses_odd_keys(q, k, v, scale):
        if k.shape[1] % 2:
            raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")
        return flash(q, k, v, scale)

    said = attention.cudnn_check(refuses_odd_keys, flash, cpu, torch.float32, SMALL_CASES)
    assert said == ("it refused 5 queries × 11 keys, 3 heads (1 zero), D=24 (cuDNN Frontend error: No valid "
                    "execution plans built.)")
    off = attention.cudnn_check(lambda q, k, v, scale: (flash(q, k, v, scale)[0] * 1.1, flash(q, k, v, scale)[1]),
                                flash, cpu, torch.float32, SMALL_CASES)
    assert off.startswith("it computed 8 queries × 8 keys, 2 heads (0 zero), D=16 wrong (out rel 1.00e-01")


def test_a_cudnn_that_fails_its_check_is_not_chosen_and_status_says_why(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    checked = []
    monkeypatch.setattr(attention, "cudnn_check", lambda *args: checked.append(args) or "it refused X")
    facts = attention.device_facts(GPU)
    assert checked and not facts.cudnn_attention
    assert choose_kernel(facts, torch.bfloat16, 128) == "sdpa-flash"
    assert attention.status_line(GPU, torch.bfloat16) == \
        "sdpa-flash (bfloat16, head dim 128, sm 9.0; cuDNN attention off: it refused X)"
    attention.device_facts.cache_clear()
    monkeypatch.setattr(attention, "cudnn_check", lambda *args: None)  # it passes: used
    assert choose_kernel(attention.device_facts(GPU), torch.bfloat16, 128) == "cudnn-attention"


def test_the_backend_status_reports_the_rules_choice(backend1):
    assert backend1.status()["attention_kernel"] == "cpu-flash (float32, head dim 128, cpu)"


@pytest.mark.parametrize("head_dim", [16, 32, 64, 72, 128, 256])
def test_the_cpu_kernel_matches_a_float64_reference(head_dim):
    """out [B, Sq, H, D] and lse [B, H, Sq] float32, against softmax attention computed in float64."""
    g = torch.Generator().manual_seed(head_dim)
    q = torch.randn(2, 77, 3, head_dim, generator=g)
    k, v = torch.randn(2, 300, 3, head_dim, generator=g), torch.randn(2, 300, 3, head_dim, generator=g)
    scale = head_dim ** -0.5
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * scale  # [B, H, Sq, Sk]
    expected_lse = scores.logsumexp(-1)  # [B, H, Sq]
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())  # [B, Sq, H, D]
    out, lse = attention.local_attention(torch.device("cpu"))(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 3, 77) and lse.dtype == torch.float32
    assert (out.double() - expected).abs().max() <= 1e-5
    assert (lse.double() - expected_lse).abs().max() <= 1e-5
