"""The nodes' translation of ComfyUI values (CONDITIONING lists, LATENT dicts) into a request:
what is honoured, and what is refused by name rather than dropped (no ComfyUI needed)."""

import pytest
import torch
from conftest import load_node_module
from fake_family import EditSpec

from xdit_backend.models import registry
from xdit_backend.schema import MAX_REFERENCES

translate = load_node_module("translate")

FLUX, SD3, PIXART, WAN = (registry.spec(name) for name in ("flux-tiny", "sd3-tiny", "pixart-tiny", "wan-tiny"))
EDIT = EditSpec()  # declares an mT5-like second context, masks, an optional glyph text and references


def entry(dim=64, tokens=8, **options):
    return [torch.randn(1, tokens, dim), options]


def test_flux_takes_context_pooled_and_guidance_repeated_to_the_batch():
    side = translate.conditioning([entry(pooled_output=torch.randn(1, 32), guidance=2.5)], FLUX, 3, "positive")
    assert side.tensors["context"].shape == (3, 8, 64) and side.tensors["pooled"].shape == (3, 32)
    assert torch.equal(side.tensors["context"][0], side.tensors["context"][2]) and side.guidance == 2.5


def test_wan_takes_the_context_alone_and_ignores_a_missing_pooled_output():
    side = translate.conditioning([entry(pooled_output=None)], WAN, 1, "positive")
    assert set(side.tensors) == {"context"} and side.guidance is None


def test_guidance_is_dropped_for_a_model_without_a_guidance_embedding():
    side = translate.conditioning([entry(pooled_output=torch.randn(1, 32), guidance=3.5)], SD3, 1, "positive")
    assert side.guidance is None and set(side.tensors) == {"context", "pooled"}


@pytest.mark.parametrize(("options", "named"), [
    ({"area": (8, 8, 0, 0)}, "an area"),
    ({"mask": torch.ones(1, 8, 8)}, "a mask"),
    ({"start_percent": 0.2}, "a timestep range"),
    ({"end_percent": 0.5}, "a timestep range"),
    ({"something_new": 1}, "the option 'something_new'"),
])
def test_conditioning_the_backend_cannot_honour_is_refused_by_name(options, named):
    with pytest.raises(translate.TranslationError, match=f"negative conditioning carries {named}"):
        translate.conditioning([entry(pooled_output=torch.randn(1, 32), **options)], FLUX, 1, "negative")


def test_a_comfyui_controlnet_on_the_prompt_is_left_to_the_sampler_where_the_family_runs_one():
    """Apply ControlNet's control: for a family whose ControlNets run on the backend (Flux, Qwen-Image) the
    sampler sends it (comfy_controls, with the prompt graph), so the conditioning's translation takes it; for one
    whose do not (Wan 2.1) it is refused, saying so."""
    qwen = registry.spec("qwen-image-tiny")
    translate.conditioning([entry(dim=qwen.context_dim, control=object())], qwen, 1, "positive")
    translate.conditioning([entry(pooled_output=torch.randn(1, 32), control=object())], FLUX, 1, "positive")
    with pytest.raises(translate.TranslationError, match="a ControlNet") as refused:
        translate.conditioning([entry(control=object())], WAN, 1, "positive")
    assert "ControlNets for wan models do not run on the backend yet" in refused.value.hint


def test_a_full_timestep_range_is_the_default_and_accepted():
    translate.conditioning([entry(pooled_output=torch.randn(1, 32), start_percent=0.0, end_percent=1.0)],
                           FLUX, 1, "positive")


def test_several_entries_are_refused():
    with pytest.raises(translate.TranslationError, match="has 2 entries"):
        translate.conditioning([entry(), entry()], WAN, 1, "positive")


def test_a_missing_pooled_output_and_a_wrong_width_say_what_to_use():
    with pytest.raises(translate.TranslationError, match="no pooled output, which a sd3 model needs"):
        translate.conditioning([entry()], SD3, 1, "positive")
    with pytest.raises(translate.TranslationError, match=r"context has shape \[1, 8, 4096\]"):
        translate.conditioning([entry(dim=4096, pooled_output=torch.randn(1, 32))], SD3, 1, "positive")


def test_latent_geometry_for_images_and_video():
    geometry, samples = translate.latent({"samples": torch.zeros(2, 16, 8, 16)}, SD3)
    assert (geometry.width, geometry.height, geometry.frames, geometry.batch) == (128, 64, 1, 2) and samples is None
    video = torch.randn(1, 16, 3, 8, 8)
    geometry, samples = translate.latent({"samples": video}, WAN)
    assert (geometry.width, geometry.height, geometry.frames) == (64, 64, 9) and torch.equal(samples, video)


def test_qwen_image_latents_keep_comfyuis_frame_axis():
    """Qwen-Image's latent format is Wan 2.1's (a video format): ComfyUI samples and decodes its image
    latents as one frame [B, 16, 1, h, w] (KSampler's fix_empty_latent_channels). Both forms come in;
    the result goes back with the axis, as KSampler's would; a Flux latent stays 4-D."""
    qwen = registry.spec("qwen-image-tiny")
    image = torch.randn(2, 16, 8, 16)
    for given in (image, image[:, :, None]):
        geometry, samples = translate.latent({"samples": given}, qwen)
        assert (geometry.width, geometry.height, geometry.frames, geometry.batch) == (128, 64, 1, 2)
        assert torch.equal(samples, image)
    assert translate.to_comfyui({"samples": image}, qwen).shape == (2, 16, 1, 8, 16)
    assert translate.to_comfyui({"samples": image}, FLUX).shape == (2, 16, 8, 16)
    with pytest.raises(translate.TranslationError, match="image latent"):
        translate.latent({"samples": torch.randn(1, 16, 2, 8, 8)}, qwen)  # two frames: a video


@pytest.mark.parametrize(("value", "spec", "message"), [
    ({"samples": torch.zeros(1, 4, 8, 8)}, FLUX, "EmptySD3LatentImage"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, PIXART, "EmptyLatentImage"),
    ({"samples": torch.zeros(1, 16, 8, 8)}, WAN, "video latent"),
    ({"samples": torch.zeros(1, 16, 8, 8), "batch_index": [0]}, SD3, "batch indices"),
])
def test_latents_a_model_cannot_take_are_refused_with_the_node_to_use(value, spec, message):
    with pytest.raises(translate.TranslationError) as info:
        translate.latent(value, spec)
    assert message in info.value.message + info.value.hint


def test_a_noise_mask_travels_with_the_latent():
    mask = torch.rand(1, 1, 64, 64)
    value = {"samples": torch.randn(1, 16, 8, 8), "noise_mask": mask}
    assert translate.latent(value, SD3)[0].width == 64
    assert torch.equal(translate.noise_mask(value), mask) and translate.noise_mask({"samples": mask}) is None


def edit_entry(tokens=5, mt5=7, **options):
    """ComfyUI-shaped: a text encoder's [1, L, D] with its pooled output and a second encoder's
    tokens and masks as options (as HunyuanDiT's CLIP + mT5 encoder returns them)."""
    options = {"pooled_output": torch.randn(1, 4), "conditioning_mt5xl": torch.randn(1, mt5, 6),
               "attention_mask_mt5xl": torch.ones(1, mt5, dtype=torch.int64), **options}
    return [torch.randn(1, tokens, 8), options]


def test_the_options_a_family_names_become_its_tensors_batched_like_the_context():
    side = translate.conditioning([edit_entry(attention_mask=torch.ones(1, 5, dtype=torch.bool))], EDIT, 3, "positive")
    assert set(side.tensors) == {"context", "pooled", "context_mt5", "context_mt5_mask", "context_mask"}
    assert side.tensors["context_mt5"].shape == (3, 7, 6) and side.tensors["context_mt5_mask"].shape == (3, 7)
    assert side.tensors["context_mt5_mask"].dtype == torch.float32  # the request takes floating masks
    assert torch.equal(side.tensors["context_mt5"][0], side.tensors["context_mt5"][2])


def test_a_missing_option_is_named_and_an_optional_one_may_be_left_out():
    tensor, options = edit_entry()
    del options["conditioning_mt5xl"], options["attention_mask_mt5xl"]
    with pytest.raises(translate.TranslationError, match="positive conditioning has no 'conditioning_mt5xl', which a "
                                                         "fake-edit model needs"):
        translate.conditioning([[tensor, options]], EDIT, 1, "positive")
    side = translate.conditioning([edit_entry()], EDIT, 1, "positive")
    assert "glyph" not in side.tensors  # optional: absent without its option
    side = translate.conditioning([edit_entry(conditioning_glyph=torch.randn(1, 2, 3))], EDIT, 1, "positive")
    assert side.tensors["glyph"].shape == (1, 2, 3)
    with pytest.raises(translate.TranslationError, match=r"context_mt5 has shape \[1, 7, 5\], a fake-edit model needs "
                                                         r"\[1, any, 6\]"):
        translate.conditioning([edit_entry(conditioning_mt5xl=torch.randn(1, 7, 5))], EDIT, 1, "positive")


def test_an_option_a_family_does_not_name_is_still_refused():
    with pytest.raises(translate.TranslationError, match="the option 'conditioning_mt5xl'"):
        translate.conditioning([entry(conditioning_mt5xl=torch.randn(1, 7, 6))], WAN, 1, "positive")


def test_reference_latents_as_text_encode_qwen_image_edit_and_reference_latent_build_them():
    """TextEncodeQwenImageEdit encodes with Qwen-Image's video VAE, [1, 16, 1, h, w]; a chained
    ReferenceLatent appends an image VAE's [1, 16, h, w] (comfy_extras/nodes_qwen.py, nodes_edit_model.py)."""
    first, second = torch.randn(1, 16, 1, 6, 8), torch.randn(1, 16, 4, 4)
    side = translate.conditioning([edit_entry(reference_latents=[first, second])], EDIT, 2, "positive")
    assert side.tensors["reference_0"].shape == (2, 16, 6, 8) and side.tensors["reference_1"].shape == (2, 16, 4, 4)
    assert torch.equal(side.tensors["reference_0"][1], first[0, :, 0])
    assert torch.equal(side.tensors["reference_1"][0], second[0])


def test_a_reference_off_the_patch_grid_is_padded_circularly_as_comfyui_pads_it():
    """ComfyUI's models pad a reference to the patch with wrap-around (comfy/ldm/common_dit.py)."""
    odd = torch.arange(5 * 7, dtype=torch.float32).reshape(1, 1, 5, 7).repeat(1, 16, 1, 1)
    padded = translate.conditioning([edit_entry(reference_latents=[odd])], EDIT, 1, "positive").tensors["reference_0"]
    assert padded.shape == (1, 16, 6, 8)
    assert torch.equal(padded[:, :, :5, :7], odd)
    assert torch.equal(padded[:, :, 5, :7], odd[:, :, 0]) and torch.equal(padded[:, :, :5, 7], odd[:, :, :, 0])


@pytest.mark.parametrize(("latent", "why"), [(torch.randn(1, 4, 8, 8), "channels"),
                                             (torch.randn(1, 16, 2, 8, 8), "frames")])
def test_a_reference_another_vae_made_is_refused(latent, why):
    with pytest.raises(translate.TranslationError, match=r"reference latent 0 has shape .* takes image latents "
                                                         r"\[B, 16, h, w\]") as info:
        translate.conditioning([edit_entry(reference_latents=[latent])], EDIT, 1, "negative")
    assert "this model's VAE" in info.value.hint


def test_more_references_than_the_request_takes_are_refused_here():
    latents = [torch.randn(1, 16, 2, 2)] * (MAX_REFERENCES + 1)
    with pytest.raises(translate.TranslationError, match=f"carries {MAX_REFERENCES + 1} reference latents"):
        translate.conditioning([edit_entry(reference_latents=latents)], EDIT, 1, "positive")


def test_reference_latents_for_a_family_without_references_are_refused_by_name():
    with pytest.raises(translate.TranslationError, match="carries reference latents .*which a sd3 model does not "
                                                         "take") as info:
        translate.conditioning([entry(pooled_output=torch.randn(1, 32), reference_latents=[torch.randn(1, 16, 4, 4)])],
                               SD3, 1, "positive")
    assert "ReferenceLatent" in info.value.hint and "edit model" in info.value.hint
    with pytest.raises(translate.TranslationError, match="a reference latents method"):
        translate.conditioning([edit_entry(reference_latents_method="offset")], EDIT, 1, "positive")


def test_flux_takes_references_placed_its_own_way_and_refuses_another_placement():
    """Flux.1 Kontext: ReferenceLatent's latents go as reference_<i>; FluxKontextMultiReferenceLatentMethod's
    "offset" is Flux's own placement, any other is refused by name."""
    reference = torch.randn(1, 16, 4, 6)
    side = translate.conditioning([entry(pooled_output=torch.randn(1, 32), reference_latents=[reference],
                                         reference_latents_method="offset")], FLUX, 2, "positive")
    assert torch.equal(side.tensors["reference_0"], reference.repeat(2, 1, 1, 1))
    with pytest.raises(translate.TranslationError, match="a reference latents method"):
        translate.conditioning([entry(pooled_output=torch.randn(1, 32), reference_latents=[reference],
                                      reference_latents_method="index")], FLUX, 1, "positive")


def test_what_the_nodes_send_the_request_takes():
    """The sampler node's path: both sides translated, prefixed, and checked by the backend's request."""
    from xdit_backend.service.request import SampleRequest
    from xdit_backend.wire.protocol import Message

    reference = torch.randn(1, 16, 1, 5, 8)
    tensors = {}
    for which, prefix, tokens in (("positive", "", 5), ("negative", "negative_", 3)):
        entries = [edit_entry(tokens=tokens, attention_mask=torch.ones(1, tokens), reference_latents=[reference])]
        tensors.update({prefix + k: v for k, v in translate.conditioning(entries, EDIT, 2, which).tensors.items()})
    request = SampleRequest.parse(Message("sample", {"model": "flux-tiny", "width": 64, "height": 64, "batch": 2},
                                          tensors))
    positive, negative = request.conditioning(EDIT)
    assert positive["reference_0"].shape == negative["reference_0"].shape == (2, 16, 6, 8)
    assert negative["context_mask"].shape == (2, 3) and positive["context_mt5_mask"].shape == (2, 7)


def test_hunyuan_video15_takes_the_glyph_text_only_when_the_prompt_quotes_some():
    """ComfyUI's HunyuanVideo 1.5 encoder adds conditioning_byt5small only for quoted text (Comfy-Org/ComfyUI
    comfy/text_encoders/hunyuan_video.py): a prompt without it is a whole conditioning, one with it carries it."""
    spec = registry.spec("hunyuan-video-1.5-tiny")
    context = torch.randn(1, 5, spec.context_dim)
    assert set(translate.conditioning([[context, {}]], spec, 1, "positive").tensors) == {"context"}
    glyphs = torch.randn(1, 3, spec.byt5_dim)
    side = translate.conditioning([[context, {"conditioning_byt5small": glyphs}]], spec, 1, "positive")
    assert set(side.tensors) == {"context", "context_byt5"} and torch.equal(side.tensors["context_byt5"], glyphs)


def test_a_hunyuan_dit_prompt_as_comfyui_encodes_it_reaches_the_model():
    """CLIPTextEncode with HunyuanDiT's CLIP: BERT tokens as the tensor, mT5 tokens and both integer
    masks as options (comfy/text_encoders/hydit.py) → request tensors the model's checks accept → a
    forward (hunyuan-dit-tiny's widths: BERT 32, mT5 16; prompts longer than its 8 + 8 padded tokens)."""
    from xdit_backend.service.request import SampleRequest
    from xdit_backend.wire.protocol import Message

    spec = registry.spec("hunyuan-dit-tiny")
    options = {"pooled_output": None, "conditioning_mt5xl": torch.randn(1, 11, 16),
               "attention_mask": torch.tensor([[1] * 7 + [0] * 3]), "attention_mask_mt5xl": torch.ones(1, 11, dtype=torch.int64)}
    sides = [translate.conditioning([[torch.randn(1, 10, 32), options]], spec, 2, which) for which in ("positive", "negative")]
    tensors = {**sides[0].tensors, **{f"negative_{k}": v for k, v in sides[1].tensors.items()}}
    assert set(sides[0].tensors) == {"context", "context_mt5", "context_mask", "context_mt5_mask"}
    fields = {"model": "hunyuan-dit-tiny", "width": 64, "height": 64, "steps": 1, "seed": 1, "cfg": 4.0, "batch": 2}
    request = SampleRequest.parse(Message("sample", fields, tensors))
    positive, negative = request.conditioning(spec)
    model = registry.build("hunyuan-dit-tiny", torch.device("cpu"))
    with torch.no_grad():
        out = model.output(torch.randn(2, 4, 8, 8), torch.tensor([500.0, 500.0]), positive, None)
    assert out.shape == (2, 4, 8, 8) and torch.isfinite(out).all()


def test_qwen_image_edit_2511_takes_index_timestep_zero_and_2509_refuses_it():
    """FluxKontextMultiReferenceLatentMethod's "index_timestep_zero" (ComfyUI's 2511 template) is a 2511 file's own
    placement; on a plain Qwen-Image-Edit file (its "index") it is refused by name, and the reverse too."""
    from xdit_backend.models.qwen_image import QwenImageSpec

    edit_2509, edit_2511 = (QwenImageSpec(64, 4, 2, (4, 6, 6), timestep_zero) for timestep_zero in (False, True))
    reference = torch.randn(1, 16, 4, 6)
    for spec, own, other in ((edit_2511, "index_timestep_zero", "index"), (edit_2509, "index", "index_timestep_zero")):
        side = translate.conditioning([entry(reference_latents=[reference], reference_latents_method=own)], spec, 1,
                                      "positive")
        assert torch.equal(side.tensors["reference_0"], reference)
        with pytest.raises(translate.TranslationError, match="a reference latents method"):
            translate.conditioning([entry(reference_latents=[reference], reference_latents_method=other)], spec, 1,
                                   "positive")


def test_image_to_video_conditioning_becomes_each_familys_inputs_and_a_text_to_video_file_leaves_it_out():
    """HunyuanVideo15ImageToVideo's options (the start latent, its mask, the CLIP vision output, whose *last* hidden
    state SigLIP gives ComfyUI's clip_fea) and CogVideoX's start latent become their request tensors; a CogVideoX
    text-to-video file takes none of them, as ComfyUI's concat_cond returns nothing for it."""
    from types import SimpleNamespace

    hunyuan = registry.spec("hunyuan-video-1.5-tiny")
    clip = SimpleNamespace(last_hidden_state=torch.randn(1, 9, hunyuan.image_dim),
                           penultimate_hidden_states=torch.randn(1, 9, hunyuan.image_dim))
    image, mask = torch.randn(1, 32, 2, 4, 4), torch.ones(1, 1, 2, 4, 4)
    side = translate.conditioning([entry(concat_latent_image=image, concat_mask=mask, clip_vision_output=clip)],
                                  hunyuan, 1, "positive")
    assert torch.equal(side.tensors["clip_vision_output"], clip.last_hidden_state)
    assert torch.equal(side.tensors["concat_latent_image"], image) and torch.equal(side.tensors["concat_mask"], mask)
    start = torch.randn(1, 16, 1, 8, 8)
    i2v = translate.conditioning([entry(concat_latent_image=start)], registry.spec("cogvideox-1.5-i2v-tiny"), 1,
                                 "positive")
    assert torch.equal(i2v.tensors["concat_latent_image"], start)
    t2v = translate.conditioning([entry(concat_latent_image=start)], registry.spec("cogvideox-tiny"), 1, "positive")
    assert set(t2v.tensors) == {"context"}


LTX2 = registry.spec("ltx2-tiny")


class Nested:
    """ComfyUI's NestedTensor as the nodes read it (comfy/nested_tensor.py: is_nested, unbind); v0.3.64 has none."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)

    def unbind(self):
        return self.tensors


def test_ltx2_takes_its_text_features_and_the_frame_rate_and_refuses_connected_ones():
    """CLIP Text Encode with LTX-2's Gemma gives the features before the connectors (unprocessed_ltxav_embeds);
    LTXVConditioning adds the frame rate, LTXVAddGuide its guides' positions. An older text encoder's connected
    features, and guides whose attention is weighted, are refused by name."""
    side = translate.conditioning([entry(dim=96, unprocessed_ltxav_embeds=True, frame_rate=24.0)], LTX2, 2, "positive")
    assert side.tensors["context"].shape == (2, 8, 96) and side.tensors["frame_rate"].tolist() == [24.0, 24.0]
    with pytest.raises(translate.TranslationError, match="already through the text connectors"):
        translate.conditioning([entry(dim=96)], LTX2, 1, "positive")
    guides = {"keyframe_idxs": torch.zeros(1, 3, 4, 2), "unprocessed_ltxav_embeds": True}
    side = translate.conditioning([entry(dim=96, guide_attention_entries=[{"strength": 1.0, "pixel_mask": None}],
                                         **guides)], LTX2, 1, "positive")
    assert side.tensors["keyframe_idxs"].shape == (1, 3, 4, 2)  # LTXVAddGuide's positions, at full strength
    with pytest.raises(translate.TranslationError, match="strength other than 1"):
        translate.conditioning([entry(dim=96, guide_attention_entries=[{"strength": 0.5}], **guides)], LTX2, 1,
                               "positive")
    with pytest.raises(translate.TranslationError, match="LTXVAddGuide's guide frames"):
        translate.conditioning([entry(dim=64, keyframe_idxs=torch.zeros(1, 3, 4, 2))], WAN, 1, "positive")


def test_an_audio_video_latent_sends_both_parts_and_comes_back_nested(monkeypatch):
    """LTXVConcatAVLatent's NestedTensor: the video as the latent, the audio as audio_latent, the video's noise mask
    (the audio's all ones); the result as a NestedTensor again. A video latent alone asks for no audio (T = 0)."""
    import sys
    import types

    video, audio = torch.randn(1, 128, 3, 4, 5), torch.randn(1, 8, 17, 16)
    mask = Nested([torch.zeros(1, 1, 3, 1, 1), torch.ones(1, 8, 17, 16)])
    value = {"samples": Nested([video, audio]), "noise_mask": mask}
    geometry, samples = translate.latent(value, LTX2)
    assert (geometry.width, geometry.height, geometry.frames) == (160, 128, 17) and torch.equal(samples, video)
    assert torch.equal(translate.audio_latent(value, LTX2), audio)
    assert translate.noise_mask(value).shape == (1, 1, 3, 1, 1)
    assert translate.audio_latent({"samples": video}, LTX2).shape == (1, 8, 0, 16)
    with pytest.raises(translate.TranslationError, match="audio part has a noise mask"):
        translate.noise_mask({"samples": value["samples"], "noise_mask": Nested([mask.tensors[0], audio * 0])})
    with pytest.raises(translate.TranslationError, match="a video and its audio"):
        translate.latent({"samples": Nested([torch.zeros(1, 16, 2, 8, 8), audio])}, WAN)
    monkeypatch.setitem(sys.modules, "comfy.nested_tensor", types.SimpleNamespace(NestedTensor=Nested))
    back = translate.to_comfyui({"samples": video, "audio_samples": audio}, LTX2)
    assert isinstance(back, Nested) and back.tensors[0] is video and back.tensors[1] is audio
    assert translate.to_comfyui({"samples": video, "audio_samples": audio[:, :, :0]}, LTX2) is video


def test_a_minimax_h3_latent_and_its_token_tags_reach_the_request():
    """EmptyMiniMaxH3LatentAV's NestedTensor (video [B, 24, T, h, w], stereo audio [B, 32, 2, Ta]) and the text
    encoder's per-token modality tags, MiniMaxH3ImageToVideo's first and last frame (their latents and frame indices);
    MiniMaxH3AddGuide's clips and audio anchors refused by name."""
    h3 = registry.spec("minimax-h3-tiny")
    video, audio = torch.zeros(1, 24, 7, 4, 8), torch.zeros(1, 32, 2, 37)
    geometry, _ = translate.latent({"samples": Nested([video, audio])}, h3)
    assert (geometry.width, geometry.height, geometry.frames) == (128, 64, 22)  # 7 latent frames: 5 + 17
    assert torch.equal(translate.audio_latent({"samples": Nested([video, audio])}, h3), audio)
    with pytest.raises(translate.TranslationError, match=r"takes \[1, 32, 2, T\]"):
        translate.audio_latent({"samples": Nested([video, torch.zeros(1, 8, 37, 16)])}, h3)
    tags = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    side = translate.conditioning([entry(dim=48, minimax_token_tags=tags)], h3, 1, "positive")
    assert torch.equal(side.tensors["text_token_tags"], tags)
    first, last = torch.randn(1, 24, 1, 4, 8), torch.randn(1, 24, 1, 4, 8)
    keyframes = [{"resolved_frame_index": 0, "latent": first}, {"resolved_frame_index": 21, "latent": last}]
    side = translate.conditioning([entry(dim=48, minimax_keyframes=keyframes)], h3, 2, "positive")
    assert torch.equal(side.tensors["keyframe_latents"][1], torch.cat([first, last], dim=2)[0])
    assert side.tensors["keyframe_frames"].tolist() == [[0.0, 21.0], [0.0, 21.0]]
    assert "keyframe_latents" not in translate.conditioning([entry(dim=48, minimax_keyframes=[])], h3, 1, "x").tensors
    with pytest.raises(translate.TranslationError, match="keyframe other than one image"):
        translate.conditioning([entry(dim=48, minimax_keyframes=[{"resolved_frame_index": 0, "audio": first}])], h3, 1,
                               "positive")


def test_a_qwen_image21_prompt_and_its_reference_images_reach_the_request():
    """Text Encode Qwen Image 2.1's conditioning: Qwen3-VL's states; with images (an edit) the images' places in the
    text (its image_slots) and their latents as references; an empty slot list is a prompt without images."""
    q21 = registry.spec("qwen-image-2.1-tiny")
    side = translate.conditioning([entry(dim=32, image_slots=[])], q21, 1, "positive")
    assert set(side.tensors) == {"context"}
    reference = torch.randn(1, 64, 4, 6)
    side = translate.conditioning([entry(dim=32, image_slots=[0, 3], reference_latents=[reference, reference])], q21,
                                  2, "positive")
    assert side.tensors["image_slots"].tolist() == [[0.0, 3.0], [0.0, 3.0]]
    assert torch.equal(side.tensors["reference_1"][1], reference[0])
