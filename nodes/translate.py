"""ComfyUI values → a backend request, and back. No ComfyUI import here: the nodes call these
functions with ComfyUI's plain values (CONDITIONING lists, LATENT dicts), so the rules are
testable without ComfyUI.

ComfyUI's CONDITIONING is a list of ``[tensor [B, L, D], {options}]`` entries. The backend runs
one text conditioning per side with no regional or timed parts, so anything more is refused
with its name rather than silently dropped. Besides the context and the pooled output, the
options a family names in its spec's ``comfy_conditioning`` (a second text encoder's tokens, their
masks) and, for a family that takes references, ``reference_latents`` become request tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from xdit_backend.errors import UserError
from xdit_backend.models.base import shape_fits, shape_text
from xdit_backend.models.patch_embed import pad_to_patch
from xdit_backend.schema import MAX_REFERENCES

log = logging.getLogger("comfyui-xdit")

# Options a conditioning entry may carry that the backend honours (or that are inert).
HONOURED = {"pooled_output", "guidance", "width", "height", "crop_w", "crop_h", "target_width", "target_height"}
# What the refused options are, for the message.
REFUSED = {
    "area": "an area (ConditioningSetArea)", "strength": "a strength (ConditioningSetArea…)",
    "mask": "a mask (ConditioningSetMask)", "set_area_to_bounds": "a mask's bounds",
    "control": "a ControlNet (Apply ControlNet)", "start_percent": "a timestep range (ConditioningSetTimestepRange)",
    "end_percent": "a timestep range (ConditioningSetTimestepRange)", "gligen": "GLIGEN boxes",
    "hooks": "hooks (LoRA/model hooks on the conditioning)",
    "reference_latents": "reference latents (ReferenceLatent, TextEncodeQwenImageEdit's image)",
    "reference_latents_method": "a reference latents method (FluxKontextMultiReferenceLatentMethod)",
    "concat_latent_image": "an image to condition on (image-to-video)", "concat_mask": "an image's frame mask",
    "clip_vision_output": "a CLIP vision output",
    "keyframe_idxs": "LTXVAddGuide's guide frames (keyframes)",
    "guide_attention_entries": "LTXVAddGuide's guide frames (keyframes)",
    "ref_audio": "a reference voice (LTXVReferenceAudio)",
    "minimax_keyframes": "MiniMax-H3 keyframes (MiniMaxH3ImageToVideo, MiniMaxH3AddGuide)",
    "minimax_refs": "MiniMax-H3 references (MiniMaxH3ReferenceToVideo)",
}


class TranslationError(UserError):
    """Conditioning or a latent the backend cannot honour; the message names it, the hint the way out."""


@dataclass
class Side:
    """One side of the guidance, as the backend takes it."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    guidance: float | None = None


def conditioning(entries, spec, batch: int, which: str) -> Side:
    """A CONDITIONING list → the tensors ``spec`` (the model family's spec) takes, repeated to ``batch``."""
    if not entries:
        raise TranslationError(f"the {which} conditioning is empty", "connect a text encoder's output")
    if len(entries) > 1:
        raise TranslationError(
            f"the {which} conditioning has {len(entries)} entries (combined or concatenated conditioning); "
            "the xDiT sampler takes one", "encode one prompt per side (or use KSampler for combined conditioning)")
    tensor, options = entries[0]
    shapes = spec.conditioning_shapes(batch, tensor.shape[1])
    # option → (the attribute of its value that holds the tensor, or "", request key), for the keys this model takes
    family_options = {path.partition(".")[0]: (path.partition(".")[2], key)
                      for path, key in spec.comfy_conditioning.items()
                      if key in shapes or key in spec.optional_conditioning}
    for flag, (why, fix) in spec.comfy_flags.items():
        if options.get(flag) is not True:
            raise TranslationError(f"the {which} conditioning {why}", fix)
    takes = HONOURED | set(family_options) | set(spec.comfy_flags) | (
        {"reference_latents"} if spec.takes_references else set())
    if "keyframe_idxs" in family_options:  # LTX-2's guides: taken where their attention runs as any token's
        _check_plain_guides(options, which)
        takes.add("guide_attention_entries")
    placement = (spec.comfy_model_inputs or {}).get("ref_latents_method")  # how the family places references
    for key, value in options.items():
        if key in takes or (key in ("start_percent",) and value == 0.0) or (key == "end_percent" and value == 1.0):
            continue
        if key == "reference_latents_method" and spec.takes_references and value == placement:
            continue  # the family's own placement (Flux's "offset", FluxKontextMultiReferenceLatentMethod)
        if value is None or _nothing(value):
            continue  # an option set to nothing (MiniMaxH3ImageToVideo's keyframes without a frame)
        what = REFUSED.get(key, f"the option {key!r}")
        if key in (path.partition(".")[0] for path in spec.comfy_conditioning):  # the family's, not this model's
            # as ComfyUI's own model of this file: its concat_cond / extra_conds take nothing for it (a text-to-video
            # Wan given WanImageToVideo's image, a plain Flux given InpaintModelConditioning's, whose noise mask
            # still inpaints); said, not silently
            log.warning("xDiT: the %s conditioning carries %s, which this %s model does not take; it is left out, as "
                        "ComfyUI's own model leaves it out (load an image-to-video / Fill file to use it)",
                        which, what, spec.family)
            continue
        if key == "control" and spec.takes_controlnets:
            continue  # Apply ControlNet's: the sampler sends it (comfy_controls.choices, with the prompt graph)
        if key == "control":
            runs = spec.takes_model_patches  # Qwen-Image's patches run on the backend
            raise TranslationError(
                f"the {which} conditioning carries {what}: Apply ControlNet attaches it in ComfyUI's process, where "
                "the xDiT sampler cannot run it",
                "use xDiT DiffSynth ControlNet between the xDiT loader and the sampler instead: the control then "
                "runs on the backend's GPUs" if runs else
                f"remove Apply ControlNet from the prompt's path: ControlNets for {spec.family} models do not run "
                "on the backend yet (Flux.1's, SD3.5's, HunyuanDiT's and Qwen-Image's do), or use KSampler for this "
                "workflow")
        if key == "reference_latents":
            raise TranslationError(f"the {which} conditioning carries {what}, which a {spec.family} model does "
                                   "not take",
                                   "remove ReferenceLatent (or TextEncodeQwenImageEdit's image) from the prompt's "
                                   "path, or load an edit model")
        raise TranslationError(f"the {which} conditioning carries {what}, which the xDiT sampler cannot honour",
                               "remove that node from the prompt's path, or use KSampler for this workflow")
    side = Side()
    side.tensors["context"] = _to_batch(tensor, batch, "context", which)
    if "pooled" in shapes:
        pooled = options.get("pooled_output")
        if pooled is None:
            raise TranslationError(f"the {which} conditioning has no pooled output, which a {spec.family} model needs",
                                   "encode the prompt with this model's text encoders (CLIPTextEncode with its CLIP)")
        side.tensors["pooled"] = _to_batch(pooled, batch, "pooled", which)
    for option, (attribute, key) in family_options.items():
        if option in STRUCTURED and options.get(option):
            side.tensors.update({name: _to_batch(tensor, batch, name, which)
                                 for name, tensor in STRUCTURED[option](options[option], which).items()})
        elif options.get(option) is not None and option not in STRUCTURED and not _nothing(options[option]):
            value = getattr(options[option], attribute) if attribute else options[option]
            side.tensors[key] = _to_batch(_entries(value), batch, key, which)
    if spec.takes_references and options.get("reference_latents"):
        side.tensors.update(references(options["reference_latents"], spec, batch, which))
    for key, shape in shapes.items():
        if key not in side.tensors:
            if key in spec.optional_conditioning:
                continue
            option = next((o for o, (_, k) in family_options.items() if k == key), key)
            raise TranslationError(f"the {which} conditioning has no {option!r}, which a {spec.family} model needs",
                                   "encode the prompt with the text encoders that belong to this model")
        got = tuple(side.tensors[key].shape)
        if not shape_fits(got, shape):
            raise TranslationError(
                f"the {which} conditioning's {key} has shape {list(got)}, a {spec.family} model needs "
                f"{shape_text(shape)}",
                "encode the prompt with the text encoders that belong to this model")
    if options.get("guidance") is not None and spec.default_guidance is not None:
        side.guidance = float(options["guidance"])
    return side


def _check_plain_guides(options: dict, which: str) -> None:
    """LTXVAddGuide's guides only at full strength without an attention mask: their attention runs as any token's
    (ComfyUI builds no guide attention mask then: LTXVModel._build_guide_self_attention_mask)."""
    entries = options.get("guide_attention_entries") or []
    weighted = [entry for entry in entries if entry.get("strength", 1.0) != 1.0 or entry.get("pixel_mask") is not None]
    if weighted:
        raise TranslationError(f"the {which} conditioning carries LTXVAddGuide guides with a strength other than 1 or "
                               "an attention mask (their attention weighted), which the xDiT sampler does not run yet",
                               "set the guides' strength to 1 and leave their attention mask out, or use KSampler")


def references(latents: list, spec, batch: int, which: str) -> dict[str, torch.Tensor]:
    """ComfyUI's ``reference_latents`` (a list of VAE latents [B, C, h, w], or a video VAE's one frame
    [B, C, 1, h, w]) → ``reference_0``, … [batch, C, h', w'] in raw latent space: repeated to the batch
    as ComfyUI's CONDList does, and padded circularly to a multiple of the patch as ComfyUI's models
    pad them before patchifying (comfy/ldm/common_dit.py, pad_to_patch_size; the padding commutes
    with the latent format's per-channel process_in, which the model wrapper applies)."""
    if len(latents) > MAX_REFERENCES:
        raise TranslationError(f"the {which} conditioning carries {len(latents)} reference latents; the xDiT sampler "
                               f"takes at most {MAX_REFERENCES}",
                               f"chain at most {MAX_REFERENCES} ReferenceLatent nodes")
    channels = spec.latent_format.channels
    out = {}
    for i, latent in enumerate(latents):
        if latent.dim() == 5 and latent.shape[2] == 1:
            latent = latent[:, :, 0]  # a video VAE's (Wan's, Qwen-Image's) single frame
        if latent.dim() != 4 or latent.shape[1] != channels:
            raise TranslationError(f"the {which} conditioning's reference latent {i} has shape {list(latent.shape)}; "
                                   f"a {spec.family} model takes image latents [B, {channels}, h, w]",
                                   "encode the reference image with this model's VAE (VAE Encode, "
                                   "TextEncodeQwenImageEdit's vae input)")
        latent = pad_to_patch(latent.detach().to("cpu", torch.float32), spec.patch)
        out[f"reference_{i}"] = _to_batch(latent, batch, f"reference latent {i}", which)
    return out


def _minimax_keyframes(entries: list, which: str) -> dict[str, torch.Tensor]:
    """MiniMaxH3ImageToVideo's ``minimax_keyframes`` ([{resolved_frame_index, latent [1, 24, 1, h, w]}, …]: a first
    and a last frame) → ``keyframe_latents`` [1, 24, K, h, w] and ``keyframe_frames`` [1, K]. MiniMaxH3AddGuide's clips
    and audio anchors are refused by name."""
    latents, frames = [], []
    for entry in entries:
        latent = entry.get("latent") if isinstance(entry, dict) else None
        one_image = latent is not None and latent.dim() == 5 and latent.shape[2] == 1
        if not one_image or set(entry) - {"resolved_frame_index", "latent"}:
            raise TranslationError(f"the {which} conditioning carries a MiniMax-H3 keyframe other than one image "
                                   "(MiniMaxH3AddGuide's clip or audio anchor), which the xDiT sampler does not run "
                                   "yet", "anchor a first or last frame with MiniMaxH3ImageToVideo, or use KSampler")
        latents.append(latent.detach().to("cpu", torch.float32))
        frames.append(float(entry["resolved_frame_index"]))
    return {"keyframe_latents": torch.cat(latents, dim=2), "keyframe_frames": torch.tensor([frames])}


# ComfyUI options that are structures, not tensors: option → converter to request tensors
STRUCTURED = {"minimax_keyframes": _minimax_keyframes}


def _nothing(value) -> bool:
    """An option set to an empty list (Text Encode Qwen Image 2.1's image_slots without images)."""
    return isinstance(value, (list, tuple)) and not value


def _entries(value) -> torch.Tensor:
    """An option as a tensor: ComfyUI's list-valued ones (WanVaceToVideo's vace_frames, vace_mask, vace_strength:
    an entry per control video, several when it is chained) side by side, tensors in their channels [1, C·E, …],
    numbers as [1, E]; a number as [1]."""
    if isinstance(value, (list, tuple)):
        if all(isinstance(entry, (int, float)) for entry in value):
            return torch.tensor([[float(entry) for entry in value]])  # [1, E]
        return torch.cat([entry.detach().to("cpu", torch.float32) for entry in value], dim=1)  # [B, C·E, …]
    return torch.tensor([float(value)]) if isinstance(value, (int, float)) else value


def _to_batch(tensor: torch.Tensor, batch: int, name: str, which: str) -> torch.Tensor:
    """ComfyUI repeats a one-prompt conditioning over the latent's batch; so do we."""
    tensor = tensor.detach().to("cpu", torch.float32)
    if tensor.shape[0] == batch:
        return tensor.contiguous()
    if tensor.shape[0] == 1:
        return tensor.repeat(batch, *(1,) * (tensor.dim() - 1))
    raise TranslationError(f"the {which} {name} has batch {tensor.shape[0]}, the latent {batch}",
                           "use one prompt, or a latent batch of the same size")


@dataclass(frozen=True)
class Geometry:
    width: int
    height: int
    frames: int
    batch: int


def parts(samples) -> list[torch.Tensor]:
    """A LATENT's samples as its parts: ComfyUI's NestedTensor (LTXVConcatAVLatent: video, audio) or one tensor."""
    return list(samples.unbind()) if getattr(samples, "is_nested", False) else [samples]


def latent(value: dict, spec) -> tuple[Geometry, torch.Tensor | None]:
    """A LATENT dict → its size in pixels and the tensor to send (None for an all-zero latent): the video's of a
    latent with audio (``audio_latent`` sends the audio's). Its noise mask travels too (``noise_mask``)."""
    if "batch_index" in value:
        raise TranslationError("the latent carries batch indices (Latent From Batch), which the xDiT sampler cannot "
                               "honour", "use a plain latent (Empty Latent, VAE Encode)")
    samples, *others = parts(value["samples"])
    if others and spec.audio_part is None:
        raise TranslationError(f"the latent has {len(others) + 1} parts (a video and its audio); a {spec.family} "
                               "model takes one", "connect the video latent alone")
    if has_frame_axis(spec) and samples.dim() == 5 and samples.shape[2] == 1:
        samples = samples[:, :, 0]  # [B, C, 1, h, w] → [B, C, h, w]
    want = 5 if spec.video else 4
    channels = spec.latent_format.channels
    if samples.dim() != want or samples.shape[1] != channels:
        kind = "a video latent [B, C, T, H, W]" if spec.video else "an image latent [B, C, H, W]"
        raise TranslationError(f"the latent has shape {list(samples.shape)}; a {spec.family} model takes {kind} "
                               f"with {channels} channels",
                               _empty_latent_hint(spec))
    h, w = samples.shape[-2:]
    frames = spec.pixel_frames(samples.shape[2]) if spec.video else 1
    geometry = Geometry(w * spec.vae_factor, h * spec.vae_factor, frames, samples.shape[0])
    samples = samples.detach().to("cpu", torch.float32)
    return geometry, (samples.contiguous() if torch.count_nonzero(samples) else None)


def audio_latent(value: dict, spec) -> torch.Tensor | None:
    """A family with audio: the LATENT's audio part (LTXVConcatAVLatent's [B, 8, T, 16], MiniMax-H3's [B, 32, 2, T]),
    or an empty one (T = 0) for a video latent alone (ComfyUI's LTX-2 model then makes the video without audio)."""
    if spec.audio_part is None:
        return None
    video, *audio = parts(value["samples"])
    if not audio:
        return torch.zeros(spec.audio_shape(video.shape[0], 0))
    audio = audio[0].detach().to("cpu", torch.float32)
    if spec.audio_length(tuple(audio.shape)) is None:
        wanted = ", ".join("T" if d is None else str(d) for d in spec.audio_shape(audio.shape[0], None))
        raise TranslationError(f"the latent's audio part has shape {list(audio.shape)}; a {spec.family} model takes "
                               f"[{wanted}]", "make it with the model's empty-latent node or its audio VAE")
    return audio.contiguous()


def noise_mask(value: dict) -> torch.Tensor | None:
    """A LATENT's noise mask (Set Latent Noise Mask, VAE Encode for Inpainting, InpaintModelConditioning,
    LTXVImgToVideo), as ComfyUI's sampler takes it: the backend resizes it to the latent and blends each step as
    KSampler does. A latent with audio carries the video's and the audio's (LTXVConcatAVLatent): the audio is made
    whole."""
    mask = value.get("noise_mask")
    if mask is None:
        return None
    video, *audio = parts(mask)
    if audio and bool((audio[0] != 1).any()):
        raise TranslationError("the latent's audio part has a noise mask (audio kept in part), which the xDiT sampler "
                               "does not run yet", "make the audio whole (no mask on LTXVConcatAVLatent's audio)")
    return video.detach().to("cpu", torch.float32).contiguous()


def has_frame_axis(spec) -> bool:
    """ComfyUI carries this image family's latents as one frame, [B, C, 1, h, w]: its latent format is a
    video one (Qwen-Image's is Wan 2.1's, latent_dimensions 3, so comfy/sample.py's
    fix_empty_latent_channels adds the axis to an empty image latent, and the Wan VAE decodes 5-D)."""
    return spec.latent_format.video and not spec.video


def to_comfyui(result: dict, spec):
    """The backend's result as ComfyUI's LATENT carries it for this family: [B, C, 1, h, w] where it has a frame
    axis (``has_frame_axis``); video and audio as ComfyUI's NestedTensor (a latent with audio: LTX-2's, unless the
    audio was empty); else the latent unchanged."""
    samples = result["samples"]
    audio = result.get("audio_samples")
    if audio is not None and audio.numel() > 0:
        from comfy.nested_tensor import NestedTensor

        return NestedTensor((samples, audio))
    return samples[:, :, None] if has_frame_axis(spec) else samples


def _empty_latent_hint(spec) -> str:
    if spec.video:
        return "make it with the Wan latent node (EmptyHunyuanLatentVideo / Wan22ImageToVideoLatent) or a video VAE Encode"
    if spec.latent_format.channels == 16:
        return "make it with EmptySD3LatentImage (16 channels), or VAE Encode with this model's VAE"
    return "make it with EmptyLatentImage (4 channels), or VAE Encode with this model's VAE"
