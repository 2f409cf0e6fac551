"""Building models for a device: a built-in is the same model on every device and in every
PipeFusion stage (drawn on the CPU, module by module), files are read one tensor at a time onto the
device, and half-precision models keep the modules diffusers keeps in float32.

There is no GPU here: a build for ``cuda:0`` runs under FakeTensorMode, which gives tensors a CUDA
device without allocating anything and raises the same device-mismatch errors CUDA does."""

import weakref

import pytest
import torch
from safetensors.torch import save_file
from torch._subclasses.fake_tensor import FakeTensorMode
from backend.test_model_files import bfl_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

from xdit_backend.models import registry, scaled_fp8
from xdit_backend.models.resolved import resolve_model
from xdit_backend.parallel.pipefusion import keep_stage

CUDA = torch.device("cuda", 0)  # a rank's device, as runtime.py pins it
TINY = ["flux-tiny", "sd3-tiny", "pixart-tiny", "wan-tiny", "cogvideox-tiny"]


class RandomDraws(TorchDispatchMode):
    """Records the device and dtype of every random draw (an op tagged nondeterministic_seeded) that
    fills real memory; draws into meta tensors (a constructor's init on meta) allocate nothing."""

    def __init__(self):
        super().__init__()
        self.draws: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags and out.device.type != "meta":
            self.draws.append((out.device.type, out.dtype))
        return out


@pytest.mark.parametrize("name", TINY)
def test_a_builtin_built_for_cuda_is_drawn_on_the_cpu_in_float32(name):
    """Every random number of a cuda:0 build comes from the CPU generator, in float32 (so it is the
    CPU model's, rounded); the weights end on cuda:0 in the compute dtype."""
    with FakeTensorMode(allow_non_fake_inputs=True), RandomDraws() as recorded:
        model = registry.build(name, CUDA, torch.bfloat16)
    assert recorded.draws and set(recorded.draws) == {("cpu", torch.float32)}
    assert {p.device for p in model.transformer.parameters()} == {CUDA}
    assert {b.device for b in model.transformer.buffers()} <= {CUDA}
    assert torch.bfloat16 in {p.dtype for p in model.transformer.parameters()}


@pytest.mark.parametrize("on_device", [False, True])
def test_a_builtin_marked_drawn_on_device_is_drawn_on_the_device_it_is_built_for(monkeypatch, on_device):
    """flux-dev-random (12 B parameters) is drawn on its GPU: seconds, where the CPU's one-threaded uniform_ takes
    a minute or more. This torch has no CUDA generator, so the draws are recorded and made on the CPU: every
    module of a marked built-in is drawn for cuda:0, an unmarked one's on the CPU."""
    from dataclasses import replace

    from xdit_backend.models import builtins, weights

    assert builtins.BUILTINS["flux-dev-random"].drawn_on_device
    marked = replace(builtins.BUILTINS["flux-tiny"], drawn_on_device=on_device)
    monkeypatch.setitem(builtins.BUILTINS, "flux-tiny", marked)
    devices, redraw = [], weights._redraw
    monkeypatch.setattr(weights, "_redraw", lambda module, seed, device: (devices.append(device),
                                                                         redraw(module, seed, torch.device("cpu"))))
    with FakeTensorMode(allow_non_fake_inputs=True):
        registry.build("flux-tiny", CUDA, torch.bfloat16)
    assert devices and set(devices) == {CUDA if on_device else torch.device("cpu")}


@pytest.mark.parametrize("name", TINY)
def test_a_lower_precision_builtin_is_the_same_model_rounded(name):
    full = registry.build(name, torch.device("cpu")).transformer.state_dict()
    half = registry.build(name, torch.device("cpu"), torch.bfloat16).transformer.state_dict()
    assert full.keys() == half.keys()
    assert [k for k in full if not torch.equal(full[k].to(half[k].dtype), half[k])] == []


@pytest.mark.parametrize("name", TINY)
def test_a_pipefusion_stage_of_a_builtin_is_the_whole_models_blocks(name):
    """A stage draws only its own blocks (the others stay on meta, never drawn) and they, with the
    layers outside every block, equal the whole model's."""
    whole = registry.build(name, torch.device("cpu")).transformer
    plan = registry.spec(name).stage_plan
    total = len(resolve_model(name).block_sizes)
    start, end = 1, total - 1  # a middle stage: blocks on both sides are someone else's
    stage = registry.build(name, torch.device("cpu"), blocks=(start, end)).transformer
    assert sum(p.is_meta for p in stage.parameters()) > 0
    kept = keep_stage(stage, plan, start, end)
    assert not any(p.is_meta for p in stage.parameters())
    whole_blocks = [b for list_name in plan.block_lists for b in getattr(whole, list_name)][start:end]
    assert len(kept) == len(whole_blocks) == end - start
    for mine, theirs in zip(kept, whole_blocks):
        expected = theirs.state_dict()
        assert all(torch.equal(v, expected[k]) for k, v in mine.state_dict().items())
    in_blocks = {f"{list_name}." for list_name in plan.block_lists}
    outside = {k: v for k, v in whole.state_dict().items() if not any(k.startswith(p) for p in in_blocks)}
    staged = stage.state_dict()
    assert outside and all(torch.equal(staged[k], v) for k, v in outside.items())


def test_a_half_precision_wan_keeps_diffusers_float32_modules():
    """diffusers' WanTransformer3DModel._keep_in_fp32_modules (time embedder, modulation tables, norms,
    RoPE) stay float32 in a bfloat16 model, as from_pretrained keeps them; everything else is bf16."""
    transformer = registry.build("wan-tiny", torch.device("cpu"), torch.bfloat16).transformer
    dtypes = {k: v.dtype for k, v in transformer.state_dict().items()}
    for key in ("scale_shift_table", "blocks.0.scale_shift_table", "blocks.0.norm2.weight",
                "condition_embedder.time_embedder.linear_1.weight"):
        assert dtypes[key] == torch.float32, key
    for key in ("blocks.0.attn1.to_q.weight", "blocks.0.ffn.net.0.proj.weight", "proj_out.weight",
                "condition_embedder.time_proj.weight", "patch_embedding.weight"):
        assert dtypes[key] == torch.bfloat16, key
    assert transformer.rope.freqs_cos.dtype == torch.float32  # a computed table: never rounded
    assert transformer.dtype == torch.bfloat16  # what the model computes in (diffusers skips the float32 ones)


def test_a_file_is_read_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Loading onto another device, the host holds one read tensor at a time, never the state dict
    (the meta device stands in for a GPU: a tensor moved there frees its CPU copy)."""
    path = tmp_path / "flux.safetensors"
    tensors = bfl_state_dict(registry.build("flux-tiny", torch.device("cpu")).transformer)
    save_file(tensors, str(path))
    live, peak = [0], [0]
    read_tensor = scaled_fp8.read_tensor  # every single-file tensor is read there (with its scale, if any)

    def watched(*args):
        tensor = read_tensor(*args)
        size = tensor.numel() * tensor.element_size()
        live[0] += size
        peak[0] = max(peak[0], live[0])
        weakref.finalize(tensor, lambda: live.__setitem__(0, live[0] - size))
        return tensor

    monkeypatch.setattr(scaled_fp8, "read_tensor", watched)
    model = registry.build(str(path), torch.device("meta"), torch.bfloat16)
    assert all(p.is_meta for p in model.transformer.parameters())
    largest = max(t.numel() * t.element_size() for t in tensors.values())
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert 0 < peak[0] <= largest < total / 10
