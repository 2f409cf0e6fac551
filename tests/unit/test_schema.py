"""One declaration (schema.SAMPLE): the wire, the request object, what rank 0 broadcasts and the CLI flags
agree on every field, each set away from its default."""

import argparse
import dataclasses

import pytest
import torch

from xdit_backend import cli, schema
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.errors import UsageError
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import Message


@pytest.fixture
def every_field(tmp_path) -> dict:
    """A sample request's wire fields with every schema field away from its default."""
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")  # parsing checks only that the file exists
    return {"model": "wan-tiny", "width": 96, "height": 80, "batch": 2, "steps": 6, "seed": 2**64 - 2, "cfg": 2.5,
            "guidance": 4.25, "shift": 2.75, "parallel": ParallelConfig(cfg=2).to_json(), "profile": True,
            "dtype": "bfloat16", "weight_dtype": "fp8_e5m2", "loras": [{"path": str(lora.resolve()), "strength": 0.5}],
            "controls": [{"path": "flux-controlnet-tiny", "strength": -0.25, "start": 0.25, "end": 0.75, "type": 3}],
            "frames": 5,
            "start_step": 1, "end_step": 4, "add_noise": False, "return_with_leftover_noise": True,
            "sampler": "heun", "scheduler": "karras", "denoise": 0.5, "compile": True,
            "cache": "teacache", "cache_threshold": 0.5, "cache_start": 1, "cache_end": 0,
            "audio_cfg": 6.5, "stg_scale": 1.25, "stg_blocks": "0, 1", "stg_start": 0.125, "stg_end": 0.75,
            "modality_scale": 2.5, "modality_start": 0.25, "modality_end": 0.875}


def through_the_wire(fields: dict) -> Message:
    """A sample message as the socket (and the ranks' broadcast) carries it: encoded, then checked and decoded."""
    return protocol.decode_bytes(protocol.encode_bytes(Message("sample", fields)))


def test_the_fixture_sets_every_field_away_from_its_default(every_field):
    """A new schema field must be added here (and so to every test below)."""
    assert list(every_field) == list(schema.FIELDS)
    assert [name for name, value in every_field.items() if value == schema.FIELDS[name].default] == []


def test_the_wire_accepts_exactly_the_schema():
    """protocol's types for a sample are the schema's, and a field outside it is refused by name."""
    assert protocol.REQUEST_FIELDS["sample"] == schema.wire_types()
    with pytest.raises(protocol.FrameError, match="unknown field 'sampler_name'"):
        through_the_wire({"model": "flux-tiny", "sampler_name": "euler"})


def test_the_request_object_has_the_schema_attributes():
    """SampleRequest writes its fields out: they are SAMPLE's attributes in SAMPLE's order, then the tensors."""
    assert [f.name for f in dataclasses.fields(SampleRequest)] == [f.attribute for f in schema.SAMPLE] + ["tensors"]
    assert SampleRequest.__dataclass_params__.frozen


def test_every_field_survives_parse_broadcast_parse(every_field):
    """wire → parse (rank 0) → to_fields → broadcast frame → parse (any other rank): nothing changes."""
    rank0 = SampleRequest.parse(through_the_wire(every_field))
    assert rank0.to_fields() == every_field
    other = SampleRequest.parse(through_the_wire(rank0.to_fields()))
    assert {f.attribute: getattr(other, f.attribute) for f in schema.SAMPLE} == \
        {f.attribute: getattr(rank0, f.attribute) for f in schema.SAMPLE}
    assert other.to_fields() == every_field


def test_absent_fields_take_the_schema_defaults():
    request = SampleRequest.parse(through_the_wire({"model": "flux-tiny"}))
    for field in schema.SAMPLE[1:]:
        expected = {"parallel": None, "loras": (), "controls": ()}.get(field.name, field.default)
        assert getattr(request, field.attribute) == expected, field.name
    assert request.to_fields() == {"model": "flux-tiny", **{f.name: f.default for f in schema.SAMPLE
                                                            if f.default is not None}}


def sample_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["sample"]


def test_every_field_has_a_cli_flag():
    options = {option for action in sample_parser()._actions for option in action.option_strings}
    assert [f.option for f in schema.SAMPLE if f.option not in options] == []


def argv_for(fields: dict) -> list[str]:
    """The ``xdit-backend sample`` flags that ask for ``fields``."""
    argv = ["--out", "o.safetensors", "--cfg-parallel"]  # the layout: ParallelConfig(cfg=2)
    for field in schema.SAMPLE:
        value = fields[field.name]
        if not field.cli:
            continue
        if field.kind == "bool":
            argv += [field.option] if value != field.default else []
        elif field.kind == "controls":
            argv += [arg for entry in value for arg in (field.option, entry["path"], *(
                arg for key in ("strength", "start", "end", "type") for arg in (f"--control-{key}", str(entry[key]))))]
        elif field.kind == "loras":
            argv += [arg for entry in value for arg in (field.option, f"{entry['path']}:{entry['strength']}")]
        else:
            argv += [field.option, str(value)]
    return argv


def test_cli_flags_give_the_fields_that_survive_the_wire(every_field):
    """flags → cli.sample_fields → wire → parse: the request the fields describe."""
    fields = cli.sample_fields(sample_parser().parse_args(argv_for(every_field)))
    assert ParallelConfig.from_json(fields.pop("parallel")) == ParallelConfig(cfg=2)
    assert fields == {name: value for name, value in every_field.items() if name != "parallel"}
    request = SampleRequest.parse(through_the_wire({**fields, "parallel": {"cfg": 2}}))
    assert request.to_fields() == every_field


def test_absent_flags_send_nothing_but_the_layout():
    """The CLI has no defaults of its own: the backend applies the schema's."""
    args = sample_parser().parse_args(["--model", "flux-tiny", "--out", "o.safetensors"])
    assert cli.sample_fields(args) == {"model": "flux-tiny", "parallel": "auto"}


def test_fields_refuses_a_name_outside_the_schema():
    """The nodes build their fields with schema.fields: a misspelt name fails at the node, naming the fields."""
    assert schema.fields(seed=3, guidance=None) == {"seed": 3}
    with pytest.raises(KeyError, match="sampler_name: not a field of a sample request"):
        schema.fields(sampler_name="euler")


def test_control_options_belong_to_the_control_before_them(tmp_path, capsys):
    """--control-* set the --control before them; its --control-image (a latent file, SaveLatent's too) travels as
    control_<i>, never in the fields; an option with no --control before it, or an image file, is refused saying
    what to do."""
    from safetensors.torch import save_file

    latent = torch.randn(1, 16, 6, 8)
    save_file({"latent_tensor": latent, "latent_format_version_0": torch.tensor([])}, str(tmp_path / "hint.latent"))
    flags = ["--model", "flux-tiny", "--out", "o.safetensors"]
    args = sample_parser().parse_args([*flags, "--control", "a.safetensors", "--control", "b", "--control-image",
                                       str(tmp_path / "hint.latent"), "--control-strength", "0.5",
                                       "--control-type", "6"])
    assert cli.sample_fields(args)["controls"] == [{"path": "a.safetensors", "strength": 1.0},
                                                   {"path": "b", "strength": 0.5, "type": 6}]
    tensors = cli.sample_tensors(args)
    assert list(tensors) == ["control_1"] and torch.equal(tensors["control_1"], latent)
    with pytest.raises(SystemExit):
        sample_parser().parse_args([*flags, "--control-strength", "0.5", "--control", "a"])
    assert "--control-strength comes after the --control it belongs to" in capsys.readouterr().err
    args = sample_parser().parse_args([*flags, "--control", "a", "--control-image", "canny.png"])
    with pytest.raises(UsageError, match="a takes the image's VAE latent, and the backend has no VAE"):
        cli.sample_tensors(args)


def test_an_image_file_goes_to_a_control_that_takes_pixels(tmp_path):
    """--control-image PNG for an XLabs ControlNet (a file with input_hint_block): the picture as [1, 3, H, W] in
    [0, 1], its pixels as the file holds them."""
    from PIL import Image
    from safetensors.torch import save_file

    save_file({"input_hint_block.0.weight": torch.zeros(16, 3, 3, 3)}, str(tmp_path / "xlabs.safetensors"))
    picture = (torch.rand(12, 20, 3, generator=torch.Generator().manual_seed(2)) * 255).to(torch.uint8)
    Image.fromarray(picture.numpy()).save(tmp_path / "canny.png")
    args = sample_parser().parse_args(["--model", "flux-tiny", "--out", "o.safetensors", "--control",
                                       str(tmp_path / "xlabs.safetensors"), "--control-image",
                                       str(tmp_path / "canny.png")])
    sent = cli.sample_tensors(args)["control_0"]
    assert sent.shape == (1, 3, 12, 20)
    assert torch.equal(sent, picture.permute(2, 0, 1)[None].float() / 255)
