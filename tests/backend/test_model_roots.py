"""With --model-root, model, LoRA and model patch files come only from inside the roots: '..' and symlinks are
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


def test_a_model_patch_outside_the_root_is_refused(confined, files):
    root, outside = files
    patch = outside / "patch.safetensors"
    patch.write_bytes(b"")  # refused before it is read
    with pytest.raises(BackendError, match="model patch .* is outside the model roots"):
        confined.sample({**FIELDS, "model": "qwen-image-tiny", "controls": [{"path": str(patch)}]})


def test_without_roots_every_path_is_allowed(files):
    assert paths.inside_roots(str(files[1] / "flux.safetensors"), ())
    assert not paths.inside_roots(str(files[0] / "escape.safetensors"), (str(files[0]),))


@pytest.mark.parametrize("kind", ["fifo", "loop"])
def test_a_model_or_lora_path_that_is_no_file_is_refused_without_blocking(confined, files, kind):
    """Issue 25 (4, 11): a FIFO would block rank 0's loop at its first read (the client's timeout and cancel with
    it); a symlink loop came back as a RuntimeError. Both are refused by what they are, before any read."""
    import os
    import re

    root = files[0]
    path = root / f"odd-{kind}.safetensors"
    if not path.exists() and not path.is_symlink():
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to(root / f"odd-{kind}-2.safetensors")
            (root / f"odd-{kind}-2.safetensors").symlink_to(path)
    said = "a FIFO (named pipe)" if kind == "fifo" else "a symlink loop"
    with pytest.raises(BackendError, match=re.escape(f"model {path} is {said}, not a file or folder")) as info:
        confined.sample({**FIELDS, "model": str(path)}, conditioning(), timeout=30)
    assert info.value.kind == "bad_request"
    lora = {**FIELDS, "model": str(root / "flux.safetensors"), "loras": [{"path": str(path), "strength": 1.0}]}
    with pytest.raises(BackendError, match=re.escape(f"LoRA {path} is {said}")):
        confined.sample(lora, conditioning(), timeout=30)
    result, _ = confined.sample({**FIELDS, "model": str(root / "flux.safetensors")}, conditioning())  # still serving
    assert torch.isfinite(result["samples"]).all()
