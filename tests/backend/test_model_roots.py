"""With --model-root, model and LoRA files come only from inside the roots: '..' and symlinks are
resolved before the check, so neither traversal nor a symlink escapes."""

import pytest
import torch
from safetensors.torch import save_file
from backend.test_model_files import bfl_state_dict

from xdit_backend.client import BackendError
from xdit_backend.models import registry
from xdit_backend.wire import paths

FIELDS = {"width": 64, "height": 64, "steps": 1, "seed": 1}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    base = tmp_path_factory.mktemp("roots")
    root, outside = base / "models", base / "elsewhere"
    root.mkdir()
    outside.mkdir()
    weights = bfl_state_dict(registry.build("flux-tiny", torch.device("cpu")).transformer)
    save_file(weights, str(root / "flux.safetensors"))
    save_file(weights, str(outside / "flux.safetensors"))
    (root / "escape.safetensors").symlink_to(outside / "flux.safetensors")
    save_file({"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 64),
               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(64, 2)}, str(outside / "lora.safetensors"))
    return root, outside


@pytest.fixture(scope="module")
def confined(files):
    from conftest import Backends

    manager = Backends()
    yield manager.start(1, model_roots=(str(files[0]),))
    manager.cleanup()


def conditioning():
    g = torch.Generator().manual_seed(1)
    return {"context": torch.randn(1, 8, 64, generator=g), "pooled": torch.randn(1, 32, generator=g)}


def test_a_file_inside_the_root_loads(confined, files):
    result, _ = confined.sample({**FIELDS, "model": str(files[0] / "flux.safetensors")}, conditioning())
    assert torch.isfinite(result["samples"]).all()


@pytest.mark.parametrize("how", ["absolute", "dot-dot", "symlink"])
def test_a_model_outside_the_root_is_refused(confined, files, how):
    root, outside = files
    path = {"absolute": outside / "flux.safetensors", "dot-dot": root / ".." / "elsewhere" / "flux.safetensors",
            "symlink": root / "escape.safetensors"}[how]
    with pytest.raises(BackendError, match="outside the model roots") as info:
        confined.sample({**FIELDS, "model": str(path)}, conditioning())
    assert info.value.kind == "bad_request" and "--model-root" in info.value.hint


def test_a_lora_outside_the_root_is_refused(confined, files):
    root, outside = files
    with pytest.raises(BackendError, match="LoRA .* is outside the model roots"):
        confined.sample({**FIELDS, "model": str(root / "flux.safetensors"),
                         "loras": [{"path": str(outside / "lora.safetensors")}]}, conditioning())


def test_without_roots_every_path_is_allowed(files):
    assert paths.inside_roots(str(files[1] / "flux.safetensors"), ())
    assert not paths.inside_roots(str(files[0] / "escape.safetensors"), (str(files[0]),))
