"""The ``evaluate`` request (one model call of ComfyUI's sampler: the xDiT MODEL) on a running backend: every
layout equals the serial model call computed here, the conditioning travels once and is then referenced by its
content hash, and what the backend does not hold is sent again."""

import pytest
import torch

from xdit_backend.client import BackendError
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.models.resolved import resolve_model
from xdit_backend.wire.content_hash import content_hash


def call(rows: int = 2, h: int = 8, w: int = 8, seed: int = 0, guidance: bool = True):
    """A flux-tiny model call: x [rows, 16, h, w], timestep [rows], guidance [rows]; context, pooled."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"x": torch.randn(rows, 16, h, w, generator=generator),
               "timestep": torch.rand(rows, generator=generator)}
    if guidance:
        tensors["guidance"] = torch.tensor([3.5, 2.0, 5.0, 1.0][:rows] + [3.5] * max(0, rows - 4))
    inputs = {"context": torch.randn(rows, 8, 64, generator=generator),
              "pooled": torch.randn(rows, 32, generator=generator)}
    return tensors, inputs


_SERIAL = {}


def serial(tensors: dict, inputs: dict) -> torch.Tensor:
    """The model call computed in this process, at world 1, without the backend."""
    from xdit_backend.parallel.evaluation import Evaluation

    if "flux-tiny" not in _SERIAL:
        _SERIAL["flux-tiny"] = resolve_model("flux-tiny").build(torch.device("cpu"), torch.float32)
    return Evaluation(_SERIAL["flux-tiny"]).run(tensors["x"], tensors["timestep"], inputs, tensors.get("guidance"))


FIELDS = {"model": "flux-tiny", "dtype": "float32"}


def test_a_call_at_world_1_equals_the_serial_call_and_sends_the_conditioning_once(backend1):
    tensors, inputs = call()
    backend1.inputs_sent.clear()
    out, info = backend1.evaluate(FIELDS, tensors, inputs)
    assert out.shape == tensors["x"].shape
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5
    assert set(backend1.inputs_sent) == {content_hash(t) for t in inputs.values()}
    # the next call names the inputs only; an unknown hash is refused, and the client sends them again
    sent = []
    original = backend1._request
    def recorded(kind, fields, tensors, *rest):
        sent.append(sorted(tensors))
        return original(kind, fields, tensors, *rest)

    backend1._request = recorded
    try:
        again, _ = backend1.evaluate(FIELDS, tensors, inputs)
        backend1.inputs_sent.add("h" + "0" * 32)
        fresh = {"context": inputs["context"] + 1, "pooled": inputs["pooled"]}
        backend1.inputs_sent.add(content_hash(fresh["context"]))  # the client believes it sent it; it did not
        third, _ = backend1.evaluate(FIELDS, tensors, fresh)
    finally:
        backend1._request = original
    assert torch.equal(again, out)
    assert sent[0] == ["guidance", "timestep", "x"]  # no conditioning: held by the backend
    assert len(sent) == 3 and len(sent[2]) == 5  # refused as missing, then sent with both inputs inline
    assert (third - serial(tensors, fresh)).abs().max() <= 1e-5


def test_an_area_crop_of_odd_size_is_padded_to_the_patch_as_comfyui_pads_it(backend1):
    tensors, inputs = call(rows=1, h=7, w=5)
    out, _ = backend1.evaluate(FIELDS, tensors, inputs)
    assert out.shape == (1, 16, 7, 5)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}, {"dp": 2},
                                    {"ulysses": 2, "shard_weights": True}])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_every_layout_equals_the_serial_call(backend2, layout, rows):
    tensors, inputs = call(rows=rows, seed=rows)
    fields = {**FIELDS, "parallel": ParallelConfig(**layout).to_json()}
    out, info = backend2.evaluate(fields, tensors, inputs)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5, info["layout"]
    assert info["rows"] == rows and info["world_size"] == 2


def test_pipefusion_and_a_tampered_input_are_refused_with_the_reason(backend2):
    tensors, inputs = call()
    with pytest.raises(BackendError, match="PipeFusion overlaps the steps"):
        backend2.evaluate({**FIELDS, "parallel": ParallelConfig(pipefusion=2).to_json()}, tensors, inputs)
    name = content_hash(inputs["context"])
    request = {**FIELDS, "inputs": {"context": name, "pooled": content_hash(inputs["pooled"])}}
    tampered = {**tensors, name: inputs["context"] + 1, content_hash(inputs["pooled"]): inputs["pooled"]}
    with pytest.raises(BackendError, match="does not hash to its name"):
        backend2._request("evaluate", request, tampered, None, None, None)


def test_status_counts_the_calls_per_model(backend1):
    tensors, inputs = call(rows=1)
    backend1.evaluate(FIELDS, tensors, inputs)
    before = backend1.status()["evaluations"].get("flux-tiny", 0)
    backend1.evaluate(FIELDS, tensors, inputs)
    status = backend1.status()
    assert status["evaluations"]["flux-tiny"] == before + 1
    assert "flux-tiny" in {m["name"] for m in status["models"]}
