"""What the pack's nodes pass between them (nodes/choices.py) and the request fields it gives.
The nodes themselves, in the real ComfyUI: tests/host/test_comfyui_host.py."""

import pytest
from conftest import load_node_module

from xdit_backend import schema
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

ModelChoice = load_node_module("choices").ModelChoice


def backend_request(choice) -> SampleRequest:
    """The request the backend reads from a choice's fields (with the size a sampler adds)."""
    return SampleRequest.parse(Message("sample", {**choice.request_fields(), "width": 64, "height": 64}, {}))


def test_a_model_without_the_step_cache_node_asks_for_the_schemas_defaults():
    fields = ModelChoice("flux-tiny").request_fields()
    for name in ("cache", "cache_start", "cache_end"):
        assert fields[name] == schema.FIELDS[name].default
    assert "cache_threshold" not in fields  # absent: the method's default
    assert backend_request(ModelChoice("flux-tiny")).cache_options() is None


@pytest.mark.parametrize("method", [m for m in schema.CACHE_METHODS if m != "none"])
def test_the_cache_settings_reach_the_request(method, tmp_path):
    lora = tmp_path / "a.safetensors"
    lora.touch()  # the request checks that the file is there; nothing reads it
    choice = ModelChoice("flux-tiny").with_lora(str(lora), 0.5).with_cache(method, 0.3, 3, 2)
    fields = choice.request_fields()
    assert (fields["cache"], fields["cache_threshold"], fields["cache_start"], fields["cache_end"]) == (method, 0.3, 3, 2)
    assert fields["loras"] == [{"path": str(lora), "strength": 0.5}]  # kept alongside
    options = backend_request(choice).cache_options()
    assert (options.method, options.threshold, options.start, options.end) == (method, 0.3, 3, 2)


@pytest.mark.parametrize("method", [m for m in schema.CACHE_METHODS if m != "none"])
def test_no_threshold_is_the_methods_default_from_the_schema(method):
    choice = ModelChoice("flux-tiny").with_cache(method, None, 2, 1)
    assert "cache_threshold" not in choice.request_fields()
    assert backend_request(choice).cache_options().threshold == schema.CACHE_THRESHOLDS[method]


def test_each_cache_setting_changes_the_fingerprint():
    """ComfyUI runs the sampler again when the fingerprint changes."""
    base = ModelChoice("flux-tiny").with_cache("fbcache", None, 2, 1)
    changed = [base.with_cache("teacache", None, 2, 1), base.with_cache("fbcache", 0.2, 2, 1),
               base.with_cache("fbcache", None, 3, 1), base.with_cache("fbcache", None, 2, 0),
               ModelChoice("flux-tiny")]
    prints = {choice.fingerprint() for choice in [base, *changed]}
    assert len(prints) == 1 + len(changed)
    assert base.with_cache("fbcache", None, 2, 1).fingerprint() == base.fingerprint()


def test_the_ltx2_guidance_node_settings_reach_the_request():
    """The xDiT LTX-2 Guidance node's values (its choice: the node's own test is in the real ComfyUI) become the
    request's, and the backend's passes (the σ ranges from the percents by the model's sampling)."""
    from xdit_backend.models import registry

    choice = ModelChoice("ltx2-tiny").with_guidance(audio_cfg=None, stg_scale=1.5, stg_blocks="0, 1", stg_start=0.0,
                                                    stg_end=0.5, modality_scale=3.0, modality_start=0.0,
                                                    modality_end=1.0)
    request = SampleRequest.parse(Message("sample", {**choice.request_fields(), "width": 64, "height": 64,
                                                     "frames": 9}, {}))
    spec = registry.spec("ltx2-tiny")
    passes = request.passes(spec.model_sampling(None))
    assert (passes.audio_cfg, passes.stg_scale, passes.stg_blocks, passes.modality_scale) == (
        None, 1.5, frozenset({0, 1}), 3.0)
    assert passes.stg_sigmas == (1.0, spec.model_sampling(None).percent_to_sigma(0.5))
    assert ModelChoice("ltx2-tiny").fingerprint() != choice.fingerprint()
