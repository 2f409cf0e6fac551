"""A request's conditioning checked against what a family's spec declares (FamilySpec): shapes with
any-length dimensions, optional tensors and masks, reference latents; each refusal names the key,
the shape wanted, the shape got and the fix. A small fake spec stands for the new families."""

from dataclasses import dataclass

import pytest
import torch
from fake_family import EditSpec

from xdit_backend import schema
from xdit_backend.errors import UsageError
from xdit_backend.models import registry
from xdit_backend.service.request import RequestError, SampleRequest
from xdit_backend.wire import protocol
from xdit_backend.wire.protocol import Message

SPEC = EditSpec()
FIELDS = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 2, "batch": 2}


def side(prefix="", tokens=5, mt5=7, **extra):
    tensors = {"context": torch.randn(2, tokens, 8), "pooled": torch.randn(2, 4), "context_mt5": torch.randn(2, mt5, 6)}
    return {prefix + key: value for key, value in {**tensors, **extra}.items()}


def conditioning(tensors: dict, spec=SPEC):
    return SampleRequest.parse(Message("sample", FIELDS, tensors)).conditioning(spec)


def test_any_length_dimensions_and_optional_tensors_are_taken():
    positive, negative = conditioning({**side(mt5=7, glyph=torch.randn(2, 3, 3)), **side("negative_", mt5=11)})
    assert positive["context_mt5"].shape == (2, 7, 6) and negative["context_mt5"].shape == (2, 11, 6)
    assert "glyph" in positive and "glyph" not in negative


def test_a_required_tensor_of_the_wrong_shape_names_key_wanted_and_got():
    with pytest.raises(RequestError, match=r"negative_context_mt5: model flux-tiny needs shape \[2, any, 6\], "
                                           r"got shape \[2, 7, 5\]") as info:
        conditioning({**side(), **side("negative_"), "negative_context_mt5": torch.randn(2, 7, 5)})
    assert "text encoders" in info.value.hint
    with pytest.raises(RequestError, match=r"context_mt5: model flux-tiny needs shape \[2, any, 6\], got nothing"):
        conditioning({"context": torch.randn(2, 5, 8), "pooled": torch.randn(2, 4)})
    with pytest.raises(RequestError, match=r"needs shape \[2, any, 6\], got shape \[2, 0, 6\]"):
        conditioning(side(context_mt5=torch.randn(2, 0, 6)))


def test_masks_follow_the_tensor_they_mask_and_fill_the_other_side_with_ones():
    positive, negative = conditioning({**side(mt5=7, context_mt5_mask=torch.ones(2, 7)),
                                       **side("negative_", mt5=3, context_mask=torch.zeros(2, 5))})
    assert torch.equal(negative["context_mt5_mask"], torch.ones(2, 3))
    assert torch.equal(positive["context_mask"], torch.ones(2, 5))
    with pytest.raises(RequestError, match=r"context_mt5_mask has shape \[2, 5\]; it needs \[2, 7\], one value per "
                                           r"token of context_mt5"):
        conditioning(side(mt5=7, context_mt5_mask=torch.ones(2, 5)))


def test_a_mask_without_its_tensor_is_refused():
    tensors = {"context": torch.randn(2, 5, 8), "pooled": torch.randn(2, 4), "context_mt5": torch.randn(2, 7, 6),
               "glyph_mask": torch.ones(2, 3)}

    @dataclass(frozen=True)
    class GlyphMaskSpec(EditSpec):
        optional_conditioning = ("glyph", "glyph_mask")

    with pytest.raises(RequestError, match="glyph_mask was sent without glyph, the tensor it masks") as info:
        conditioning(tensors, GlyphMaskSpec())
    assert "send glyph with it, or leave both out" in info.value.hint


def test_a_key_the_family_does_not_declare_is_refused_with_what_it_takes():
    with pytest.raises(RequestError, match="negative_image_embeds: a fake-edit model takes no 'image_embeds'") as info:
        conditioning({**side(), **side("negative_", image_embeds=torch.randn(2, 4))})
    assert "context, pooled, context_mt5, glyph, context_mask, context_mt5_mask, reference_0" in info.value.hint


def test_a_tensor_name_that_is_no_conditioning_key_is_refused_at_parse():
    with pytest.raises(RequestError, match=r"unknown tensors \['Context'\]"):
        SampleRequest.parse(Message("sample", FIELDS, {"Context": torch.randn(2, 5, 8)}))


def test_references_are_taken_in_order_on_both_sides():
    references = {f"reference_{i}": torch.randn(2, 16, 4 + 2 * i, 6) for i in range(3)}
    positive, negative = conditioning({**side(**references), **side("negative_", **references)})
    assert [k for k in positive if k.startswith("reference_")] == ["reference_0", "reference_1", "reference_2"]
    assert torch.equal(negative["reference_2"], references["reference_2"])


@pytest.mark.parametrize(("shape", "why"), [
    ((2, 4, 4, 6), "channels"), ((1, 16, 4, 6), "batch"), ((2, 16, 5, 6), "odd rows"), ((2, 16, 4, 7), "odd columns"),
    ((2, 16, 1, 4, 6), "5-D"),
])
def test_a_reference_of_the_wrong_shape_says_what_a_reference_is(shape, why):
    with pytest.raises(RequestError, match=r"reference_0 has shape .*; a fake-edit reference latent is \[2, 16, h, w\] "
                                           "with h a multiple of 2 and w of 2") as info:
        conditioning(side(reference_0=torch.randn(shape)))
    assert "VAE" in info.value.hint


def test_references_are_numbered_without_gaps_and_counted():
    with pytest.raises(RequestError, match="reference_0 is missing: references are numbered from 0 without gaps"):
        conditioning(side(reference_1=torch.randn(2, 16, 4, 4)))
    many = {f"reference_{i}": torch.randn(2, 16, 2, 2) for i in range(schema.MAX_REFERENCES + 1)}
    with pytest.raises(RequestError, match=f"{schema.MAX_REFERENCES + 1} reference latents on the positive side; "
                                           f"at most {schema.MAX_REFERENCES}"):
        conditioning(side(**many))


def test_the_sides_may_carry_different_references():
    """As in ComfyUI, where a negative prompt without the reference image runs on its own."""
    reference = torch.randn(2, 16, 4, 4)
    positive, negative = conditioning({**side(reference_0=reference), **side("negative_")})
    assert torch.equal(positive["reference_0"], reference) and "reference_0" not in negative
    positive, negative = conditioning(side(reference_0=reference))  # no negative
    assert negative is None and torch.equal(positive["reference_0"], reference)


def test_a_family_without_references_refuses_them():
    sd3 = registry.spec("sd3-tiny")
    tensors = {"context": torch.randn(2, 8, 64), "pooled": torch.randn(2, 32), "reference_0": torch.randn(2, 16, 4, 4)}
    with pytest.raises(RequestError, match=r"reference_0: model flux-tiny \(sd3\) takes no reference latents") as info:
        conditioning(tensors, sd3)
    assert "edit model" in info.value.hint and "--reference-latent" in info.value.hint
    # in ComfyUI the fix names the nodes that made the reference, never the command line's flag (issue 30)
    assert "ReferenceLatent" in info.value.node_hint and "--" not in info.value.node_hint


def test_the_existing_families_take_what_they_took():
    flux, pixart = registry.spec("flux-tiny"), registry.spec("pixart-tiny")
    positive, negative = conditioning({"context": torch.randn(2, 8, 64), "pooled": torch.randn(2, 32)}, flux)
    assert set(positive) == {"context", "pooled"} and negative is None
    positive, negative = conditioning({"context": torch.randn(2, 8, 64), "context_mask": torch.ones(2, 8),
                                       "negative_context": torch.randn(2, 8, 64)}, pixart)
    assert set(negative) == {"context", "context_mask"}
    with pytest.raises(RequestError, match="negative_pooled: a pixart model takes no 'pooled'"):
        conditioning({"context": torch.randn(2, 8, 64), "negative_context": torch.randn(2, 8, 64),
                      "negative_pooled": torch.randn(2, 32)}, pixart)


def test_random_conditioning_fills_any_length_and_draws_references_only_when_asked():
    positive, negative = registry.random_conditioning("flux-tiny", 2, 5, SPEC)
    assert positive["context_mt5"].shape == (2, 8, 6) and not any(k.startswith("reference") for k in positive)
    with_references, _ = registry.random_conditioning("flux-tiny", 2, 5, SPEC, references=((4, 6),))
    assert with_references["reference_0"].shape == (2, 16, 4, 6)
    assert torch.equal(with_references["context"], positive["context"])  # the text does not change with them
    with pytest.raises(registry.ModelError, match="sd3-tiny takes no reference latents"):
        registry.random_conditioning("sd3-tiny", 1, 5, registry.spec("sd3-tiny"), references=((4, 4),))


def test_two_sides_of_every_key_and_the_most_references_fit_the_protocol():
    """The protocol's tensor limit holds latent, sigmas and both sides of a rich family at the most references."""
    per_side = len(SPEC.conditioning_shapes(1, 1)) + len(SPEC.optional_conditioning) + schema.MAX_REFERENCES
    assert 2 + 2 * per_side <= protocol.DEFAULT_LIMITS.max_tensors


def test_stand_in_text_keeps_the_references_sent():
    """A built-in without embeddings (the leader's stand-ins) still gets the request's references:
    the positive's on both sides unless the negative's are sent."""
    first, second = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 2, 6)
    request = SampleRequest.parse(Message("sample", FIELDS, {"reference_0": first, "reference_1": second}))
    assert request.conditioning(SPEC) == (None, None)
    positive, negative = request.with_references(SPEC, *registry.random_conditioning("flux-tiny", 2, 1, SPEC))
    assert torch.equal(positive["reference_1"], second) and torch.equal(negative["reference_0"], first)
    assert "context_mt5" in negative
    own = SampleRequest.parse(Message("sample", FIELDS, {"reference_0": first, "negative_reference_0": second}))
    positive, negative = own.with_references(SPEC, *registry.random_conditioning("flux-tiny", 2, 1, SPEC))
    assert torch.equal(positive["reference_0"], first) and torch.equal(negative["reference_0"], second)


def test_the_cli_sends_each_reference_latent_file_in_order(tmp_path):
    """xdit-backend sample --reference-latent A --reference-latent B: the request's reference_0, reference_1,
    on the negative side too when the embeds have one."""
    from safetensors.torch import save_file

    from xdit_backend import cli

    first, second = torch.randn(2, 16, 4, 4), torch.randn(2, 16, 2, 6)
    save_file({"samples": first}, str(tmp_path / "a.safetensors"))
    save_file({"samples": second}, str(tmp_path / "b.safetensors"))
    save_file({**side(), **side("negative_")}, str(tmp_path / "embeds.safetensors"))
    argv = ["sample", "--model", "flux-tiny", "--out", "o.safetensors", "--batch", "2", "--width", "64",
            "--height", "64", "--reference-latent", str(tmp_path / "a.safetensors"),
            "--reference-latent", str(tmp_path / "b.safetensors")]
    args = cli.build_parser().parse_args(argv)
    assert set(cli.sample_tensors(args)) == {"reference_0", "reference_1"}
    args = cli.build_parser().parse_args([*argv, "--embeds", str(tmp_path / "embeds.safetensors")])
    request = SampleRequest.parse(Message("sample", cli.sample_fields(args), cli.sample_tensors(args)))
    positive, negative = request.conditioning(SPEC)
    assert torch.equal(positive["reference_0"], first) and torch.equal(negative["reference_1"], second)
    save_file({"other": first}, str(tmp_path / "c.safetensors"))
    args = cli.build_parser().parse_args([*argv, "--reference-latent", str(tmp_path / "c.safetensors")])
    with pytest.raises(UsageError, match="c.safetensors holds neither 'samples' nor 'latent'"):
        cli.sample_tensors(args)


def test_the_references_tokens_are_counted_for_the_fit_check():
    """Issue 25 (7): a reference latent's tokens join the sequence, so the fit check counts them (the side with
    the most; a negative side without its own has the positive's)."""
    from xdit_backend.memory.fit import request_shape

    rows, columns = SPEC.patch[1], SPEC.patch[2]
    plain = SampleRequest.parse(Message("sample", FIELDS, side()))
    with_references = SampleRequest.parse(Message("sample", FIELDS, side(
        reference_0=torch.randn(2, 16, 4 * rows, 2 * columns), reference_1=torch.randn(2, 16, rows, columns))))
    assert plain.reference_tokens(SPEC) == 0 and with_references.reference_tokens(SPEC) == 8 + 1
    assert request_shape(with_references, SPEC, 5)[0] == request_shape(plain, SPEC, 5)[0] + 9
    negative_only = SampleRequest.parse(Message("sample", FIELDS, {
        **side(), **side("negative_", reference_0=torch.randn(2, 16, 6 * rows, 2 * columns))}))
    assert negative_only.reference_tokens(SPEC) == 12


def test_a_reference_larger_than_the_largest_image_is_refused():
    largest = schema.MAX_SIDE // SPEC.vae_factor
    step = SPEC.patch[1]
    with pytest.raises(RequestError, match=rf"reference_0 is {largest + step}×{step} latent pixels .*; a reference may "
                                           rf"be at most {largest}×{largest}") as info:
        conditioning(side(reference_0=torch.randn(2, 16, largest + step, step)))
    assert "scale the reference image down" in info.value.hint


def test_the_cli_sends_a_noise_mask_and_the_request_checks_it(tmp_path):
    """xdit-backend sample --latent L --noise-mask M: the request's noise_mask, checked with the model (a mask is 0 to
    1, image masks at most 4-D); a file without 'mask' is named."""
    from safetensors.torch import save_file

    from xdit_backend import cli

    mask = torch.rand(1, 1, 64, 64)
    save_file({"samples": torch.randn(2, 16, 8, 8)}, str(tmp_path / "latent.safetensors"))
    save_file({"mask": mask}, str(tmp_path / "mask.safetensors"))
    argv = ["sample", "--model", "flux-tiny", "--out", "o.safetensors", "--batch", "2", "--width", "64",
            "--height", "64", "--latent", str(tmp_path / "latent.safetensors")]
    args = cli.build_parser().parse_args([*argv, "--noise-mask", str(tmp_path / "mask.safetensors")])
    tensors = cli.sample_tensors(args)
    assert torch.equal(tensors["noise_mask"], mask)
    flux = registry.spec("flux-tiny")
    request = SampleRequest.parse(Message("sample", cli.sample_fields(args), tensors))
    request.check_model(flux)
    assert torch.equal(request.generation(flux, *registry.random_conditioning("flux-tiny", 2, 1, flux)).noise_mask,
                       mask)
    for bad, words in ((mask * 2, "values from"), (mask[None, None], "noise_mask has shape")):
        with pytest.raises(RequestError, match=words):
            SampleRequest.parse(Message("sample", cli.sample_fields(args), {**tensors, "noise_mask": bad})).check_model(
                flux)
    save_file({"other": mask}, str(tmp_path / "other.safetensors"))
    args = cli.build_parser().parse_args([*argv, "--noise-mask", str(tmp_path / "other.safetensors")])
    with pytest.raises(UsageError, match="holds neither 'mask' nor 'noise_mask'"):
        cli.sample_tensors(args)


def test_a_noise_mask_on_wan_22_ti2v_makes_the_mask_condition_the_model():
    """Wan22ImageToVideoLatent's fixed first frame: ComfyUI's WAN22 then takes a timestep per frame from the mask
    and keeps the fixed frame clean; the generation says so (and the memory model counts a timestep per token).
    Wan 2.1's 16-channel model takes the mask as any model does."""
    from xdit_backend.models.wan import WanSpec

    ti2v, t2v = WanSpec(64, 2, 2, 48, 48), WanSpec(64, 2, 2, 16, 16)  # TI2V-5B's 48-channel latent; Wan 2.1's
    fields = {"model": "wan-tiny", "width": 64, "height": 64, "frames": 5, "steps": 2}
    request = SampleRequest.parse(Message("sample", fields, {"noise_mask": torch.ones(1, 1, 64, 64)}))
    for spec, conditions in ((ti2v, True), (t2v, False)):
        request.check_model(spec)
        context = {"context": torch.zeros(1, 8, 64)}
        gen = request.generation(spec, context, None)
        assert gen.model_reads_mask is conditions and gen.kept_clean is conditions
        assert request.modulates_per_token(spec) is conditions
    plain = SampleRequest.parse(Message("sample", fields, {}))
    assert not plain.modulates_per_token(ti2v)
