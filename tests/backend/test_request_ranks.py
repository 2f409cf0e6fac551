"""Every field set on rank 0 arrives unchanged on every rank: a world-2 backend runs requests with every
schema field away from its default, and each rank's profile record reports the request it parsed.

No single request can pass the model checks with every field set (guidance is Flux.1-dev's, frames
are Wan's), so two requests share the fields; ``test_the_two_requests_set_every_field`` keeps them
complete. denoise 0 makes both end before the first step (ComfyUI returns the input latent), so
the test costs model loading only, compile=True included (the blocks compile at their first call).
"""

import pytest
from safetensors.torch import save_file

from xdit_backend import schema
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.service.load_progress import INTERVAL_ENV
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message


def common(lora: str) -> dict:
    """The fields both requests set away from their defaults."""
    return {"width": 64, "height": 48, "batch": 2, "steps": 5, "seed": 2**63 + 11, "cfg": 2.5, "shift": 2.75,
            "profile": True, "dtype": "float32", "loras": [{"path": lora, "strength": 0.5}], "start_step": 1,
            "end_step": 4, "add_noise": False, "return_with_leftover_noise": True, "sampler": "heun",
            "scheduler": "karras", "denoise": 0.0, "compile": True, "cache": "fbcache", "cache_threshold": 0.3,
            "cache_start": 0, "cache_end": 0}


@pytest.fixture
def requests(tmp_path) -> list[dict]:
    """Flux (guidance, ulysses), Wan (frames, cfg parallel), Qwen-Image (a model patch and a ControlNet, ring; not
    compiled: the others compile) and LTX-2 (its guidance passes): together, every field away from its default."""
    lora = tmp_path / "empty-lora.safetensors"
    save_file({}, str(lora))  # a LoRA file that matches nothing: merged as zero modules
    path = str(lora.resolve())
    flux = {"model": "flux-tiny", **common(path), "guidance": 4.25, "parallel": ParallelConfig(ulysses=2).to_json()}
    wan = {"model": "wan-tiny", **common(path), "frames": 5, "weight_dtype": "fp8_e4m3fn",
           "parallel": ParallelConfig(cfg=2).to_json()}
    # controls refuse the step cache; a ControlNet's range and union type (ignored by a net without types, as
    # ComfyUI ignores it) reach every rank
    qwen = {"model": "qwen-image-tiny", **common(path), "compile": False, "cache": "none",
            "parallel": ParallelConfig(ring=2).to_json(),
            "controls": [{"path": "qwen-image-diffsynth-tiny", "strength": 0.5},
                         {"path": "qwen-image-controlnet-tiny", "strength": 0.3, "start": 0.1, "end": 0.9, "type": 2}]}
    # LTX-2's guidance beyond CFG (no step cache on LTX-2)
    ltx2 = {"model": "ltx2-tiny", **common(path), "width": 64, "height": 64, "frames": 9, "compile": False,
            "cache": "none", "parallel": ParallelConfig(ulysses=2).to_json(), "audio_cfg": 6.5, "stg_scale": 1.25,
            "stg_blocks": "0, 1", "stg_start": 0.125, "stg_end": 0.75, "modality_scale": 2.5, "modality_start": 0.25,
            "modality_end": 0.875}
    return [flux, wan, qwen, ltx2]


def test_the_requests_set_every_field(requests):
    """A new schema field must be set in one of them (and then reach every rank)."""
    away = {name for fields in requests for name, value in fields.items() if value != schema.FIELDS[name].default}
    assert sorted(set(schema.FIELDS) - away) == []


@pytest.mark.timeout(600)
def test_every_rank_parses_what_rank_0_was_sent(backend2, requests):
    client = backend2
    for sent in requests:
        _, info = client.sample(sent)
        expected = SampleRequest.parse(Message("sample", sent)).to_fields()  # the sent fields, defaults filled in
        assert {name: expected[name] for name in sent} == sent  # nothing sent is changed by parsing it
        ran = [record["request"] for record in info["profile"]]
        assert [record["rank"] for record in info["profile"]] == [0, 1]
        for rank, fields in enumerate(ran):
            assert fields == expected, f"{sent['model']}: rank {rank} ran {fields}, not {expected}"


def test_the_wait_before_the_first_step_is_told_a_model_to_load_once(backend):
    """Issue 30: a model's first run sat at 0 % while it loaded. The backend tells the client what it waits for (a
    "note" before the steps): the model loading, on its first run only."""
    client = backend(2)
    fields = {"model": "pixart-tiny", "width": 64, "height": 64, "steps": 1, "seed": 1}
    client.unload("pixart-tiny")
    first, again = [], []
    client.sample(fields, on_note=first.append)
    client.sample(fields, on_note=again.append)
    assert [note for note in first if note.startswith("loading pixart-tiny on 2 ranks")] and not again


def test_a_loading_model_is_told_as_it_is_read(backends):
    """Issue 30: while the weights are read, the client gets how far (a line at each new tenth; the one-second spacing
    between lines is lifted here, a tiny model loading in less), ending at 100 %, and a model already loaded gets none."""
    client = backends.start(1, environment={INTERVAL_ENV: "0"})
    fields = {"model": "pixart-tiny", "width": 64, "height": 64, "steps": 1, "seed": 1}
    first, again = [], []
    client.sample(fields, on_note=first.append)
    client.sample(fields, on_note=again.append)
    told = [int(note.split(": ")[1].split(" %")[0]) for note in first if note.startswith("loading pixart-tiny: ")]
    assert len(told) >= 5 and told == sorted(set(told)) and told[-1] == 100
    assert not [note for note in again if note.startswith("loading")]
