"""The ComfyUI nodes (and combo values) the example workflows use that are newer than the ComfyUI
snapshot the tests start (v0.3.64), with their inputs as ComfyUI's current source declares them.

tests/host/test_workflows.py checks every node the snapshot has against its real /object_info, and the
nodes below against these entries, written in /object_info's own format. When the snapshot is
updated and has one of them, test_workflows fails until the entry is deleted here, so that node is
then checked against the real thing.

Read 2026-11-23 from Comfy-Org/ComfyUI's source (through the search index: the repository is too
large to fetch whole here; the "ver" ComfyUI's templates record for each node is the release that
brought it): comfy_extras/nodes_flux.py (EmptyFlux2LatentImage, Flux2Scheduler: ComfyUI 0.3.71, as
Comfy-Org/workflow_templates templates/image_flux2.json @ 0aa43fd4 records them),
comfy_extras/nodes_hunyuan.py (EmptyHunyuanVideo15Latent: ComfyUI 0.3.68, as
templates/video_hunyuan_video_1.5_720p_t2v.json @ 0025b3f8 records it), nodes.py (CLIPLoader and
DualCLIPLoader's type lists). Read 2026-11-27: comfy_extras/nodes_hunyuan.py HunyuanVideo15ImageToVideo (the same
release as EmptyHunyuanVideo15Latent), comfy_extras/nodes_flux.py's reference method index_timestep_zero (the
Qwen-Image-Edit-2511 workflows in the index set it), and LTX-2's audio nodes (below); comfy_extras/nodes_qwen.py's
TextEncodeQwenImage21 (Qwen-Image 2.1).
"""

MAX_RESOLUTION = 16384  # nodes.MAX_RESOLUTION

NEWER_NODES = {
    "EmptyFlux2LatentImage": {
        "source": "comfy_extras/nodes_flux.py: class EmptyFlux2LatentImage (ComfyUI 0.3.71)",
        "input": {"required": {
            "width": ["INT", {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "height": ["INT", {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "batch_size": ["INT", {"default": 1, "min": 1, "max": 4096}],
        }},
        "output": ["LATENT"],
    },
    "Flux2Scheduler": {
        "source": "comfy_extras/nodes_flux.py: class Flux2Scheduler (ComfyUI 0.3.71)",
        "input": {"required": {
            "steps": ["INT", {"default": 20, "min": 1, "max": 4096}],
            "width": ["INT", {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 1}],
            "height": ["INT", {"default": 1024, "min": 16, "max": MAX_RESOLUTION, "step": 1}],
        }},
        "output": ["SIGMAS"],
    },
    "EmptyHunyuanVideo15Latent": {  # EmptyHunyuanLatentVideo's inputs, a 32-channel latent at 1/16
        "source": "comfy_extras/nodes_hunyuan.py: class EmptyHunyuanVideo15Latent(EmptyHunyuanLatentVideo) "
                  "(ComfyUI 0.3.68)",
        "input": {"required": {
            "width": ["INT", {"default": 848, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "height": ["INT", {"default": 480, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "length": ["INT", {"default": 25, "min": 1, "max": MAX_RESOLUTION, "step": 4}],
            "batch_size": ["INT", {"default": 1, "min": 1, "max": 4096}],
        }},
        "output": ["LATENT"],
    },
    "HunyuanVideo15ImageToVideo": {  # the start image's latent and mask on both prompts, its CLIP vision output
        "source": "comfy_extras/nodes_hunyuan.py: class HunyuanVideo15ImageToVideo (ComfyUI 0.3.68)",
        "input": {"required": {
            "positive": ["CONDITIONING", {}],
            "negative": ["CONDITIONING", {}],
            "vae": ["VAE", {}],
            "width": ["INT", {"default": 848, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "height": ["INT", {"default": 480, "min": 16, "max": MAX_RESOLUTION, "step": 16}],
            "length": ["INT", {"default": 33, "min": 1, "max": MAX_RESOLUTION, "step": 4}],
            "batch_size": ["INT", {"default": 1, "min": 1, "max": 4096}],
        }, "optional": {
            "start_image": ["IMAGE", {}],
            "clip_vision_output": ["CLIP_VISION_OUTPUT", {}],
        }},
        "output": ["CONDITIONING", "CONDITIONING", "LATENT"],
        "output_name": ["positive", "negative", "latent"],
    },
    # LTX-2 (video with audio): ComfyUI 0.7.0 (January 2026; PR #11632), as Comfy-Org/workflow_templates
    # video_ltx2_3_t2v.json and video_ltx2_3_i2v.json record them. Read 2026-11-27 from comfy_extras/nodes_lt.py
    # @8258cfe4 and comfy_extras/nodes_lt_audio.py (@57a6f193: LTXVAudioVAELoader lists models/checkpoints; a later
    # version lists models/vae too, and a checkpoint file passes either).
    "LTXVEmptyLatentAudio": {  # [B, 8, round(frames / frame_rate · 25), 16]; frame_rate: io.MultiType FLOAT or INT
        "source": "comfy_extras/nodes_lt_audio.py: class LTXVEmptyLatentAudio (ComfyUI 0.7.0)",
        "input": {"required": {
            "frames_number": ["INT", {"default": 97, "min": 1, "max": 1000, "step": 1}],
            "frame_rate": ["FLOAT,INT", {"default": 25.0, "min": 1.0, "max": 1000.0, "step": 0.01,
                                         "widgetType": "FLOAT"}],
            "batch_size": ["INT", {"default": 1, "min": 1, "max": 4096}],
            "audio_vae": ["VAE", {}],
        }},
        "output": ["LATENT"],
        "output_name": ["Latent"],
    },
    "LTXVConcatAVLatent": {  # samples = NestedTensor((video, audio)), their noise masks likewise
        "source": "comfy_extras/nodes_lt.py: class LTXVConcatAVLatent (ComfyUI 0.7.0)",
        "input": {"required": {
            "video_latent": ["LATENT", {}],
            "audio_latent": ["LATENT", {}],
        }},
        "output": ["LATENT"],
        "output_name": ["latent"],
    },
    "LTXVSeparateAVLatent": {
        "source": "comfy_extras/nodes_lt.py: class LTXVSeparateAVLatent (ComfyUI 0.7.0)",
        "input": {"required": {
            "av_latent": ["LATENT", {}],
        }},
        "output": ["LATENT", "LATENT"],
        "output_name": ["video_latent", "audio_latent"],
    },
    "LTXVAudioVAELoader": {
        "source": "comfy_extras/nodes_lt_audio.py: class LTXVAudioVAELoader (ComfyUI 0.7.0)",
        "input": {"required": {
            "ckpt_name": ["COMBO", {"options": ["xdit-probe-checkpoints.safetensors"]}],
        }},
        "output": ["VAE"],
        "output_name": ["Audio VAE"],
    },
    "LTXVAudioVAEDecode": {
        "source": "comfy_extras/nodes_lt_audio.py: class LTXVAudioVAEDecode (ComfyUI 0.7.0)",
        "input": {"required": {
            "samples": ["LATENT", {}],
            "audio_vae": ["VAE", {}],
        }},
        "output": ["AUDIO"],
        "output_name": ["Audio"],
    },
    "LTXAVTextEncoderLoader": {  # Gemma 3 12B, and the text projection from the LTX-2 checkpoint
        "source": "comfy_extras/nodes_lt_audio.py: class LTXAVTextEncoderLoader (ComfyUI 0.7.0)",
        "input": {"required": {
            "text_encoder": ["COMBO", {"options": ["xdit-probe-text_encoders.safetensors"]}],
            "ckpt_name": ["COMBO", {"options": ["xdit-probe-checkpoints.safetensors"]}],
            "device": ["COMBO", {"options": ["default", "cpu"]}],
        }},
        "output": ["CLIP"],
    },
    # MiniMax-H3 (video with stereo audio; ComfyUI PR #15224): comfy_extras/nodes_minimax_h3.py @13a83ce7 and @542de101
    # (these two nodes alike in both), read 2026-11-27
    "MiniMaxH3ImageToVideo": {  # the prompt (and optional first / last frame) → positive conditioning + the AV latent
        "source": "comfy_extras/nodes_minimax_h3.py: class MiniMaxH3ImageToVideo (ComfyUI PR #15224)",
        "input": {"required": {
            "clip": ["CLIP", {}],
            "vae": ["VAE", {}],
            "prompt": ["STRING", {"multiline": True, "dynamicPrompts": True}],
            "width": ["INT", {"default": 1344, "min": 32, "max": MAX_RESOLUTION, "step": 32}],
            "height": ["INT", {"default": 768, "min": 32, "max": MAX_RESOLUTION, "step": 32}],
            "length": ["INT", {"default": 124, "min": 5, "max": 3600, "step": 17}],
        }, "optional": {
            "first_frame": ["IMAGE", {}],
            "last_frame": ["IMAGE", {}],
        }},
        "output": ["CONDITIONING", "LATENT"],
        "output_name": ["positive", "LATENT"],
    },
    # not newer, but out of the tests' ComfyUI: comfy_extras/nodes_audio.py imports torchaudio, which the tests install
    # without (only the pinned torch's wheels are installed); its inputs are the snapshot's own
    "VAEDecodeAudio": {  # current ComfyUI decodes a NestedTensor's last part (the audio: MiniMax-H3's, at 32 kHz)
        "source": "comfy_extras/nodes_audio.py: class VAEDecodeAudio (the snapshot's, whose module needs torchaudio)",
        "input": {"required": {
            "samples": ["LATENT", {}],
            "vae": ["VAE", {}],
        }},
        "output": ["AUDIO"],
    },
    # Qwen-Image 2.1: comfy_extras/nodes_qwen.py @ed26919d. Its autogrow "images" (image_1 … image_16, references for
    # an edit) is left out: the snapshot's /object_info has no such input type, and the text-to-image workflow sets none
    "TextEncodeQwenImage21": {  # both prompts through Qwen3-VL, and the empty 64-channel latent at 1/16
        "source": "comfy_extras/nodes_qwen.py: class TextEncodeQwenImage21 (@ed26919d)",
        "input": {"required": {
            "clip": ["CLIP", {}],
            "prompt": ["STRING", {"multiline": True, "dynamicPrompts": True}],
            "negative_prompt": ["STRING", {"multiline": True, "dynamicPrompts": True}],
            "resolution": ["INT", {"default": 1024, "min": 0, "max": 4096, "step": 32}],
        }, "optional": {
            "vae": ["VAE", {}],
        }},
        "output": ["CONDITIONING", "CONDITIONING", "LATENT"],
        "output_name": ["positive", "negative", "latent"],
    },
}

# (node, input) → the combo values newer than the snapshot, and where they come from.
NEWER_OPTIONS = {
    ("CLIPLoader", "type"): (["flux2", "cogvideox", "minimax"],
                             "nodes.py: CLIPLoader's type list (flux2: ComfyUI 0.3.71, Mistral for Flux.2; "
                             "cogvideox: T5-XXL for CogVideoX; minimax: MiniMax-H3's Qwen3-VL-32B, nodes.py @02217e36)"),
    ("FluxKontextMultiReferenceLatentMethod", "reference_latents_method"): (
        ["index_timestep_zero"], "comfy_extras/nodes_flux.py: FluxKontextMultiReferenceLatentMethod's methods "
                                 "(index_timestep_zero: Qwen-Image-Edit-2511's, as ComfyUI's 2511 template sets it)"),
    ("DualCLIPLoader", "type"): (["hunyuan_video_15"],
                                 "nodes.py: DualCLIPLoader's type list (hunyuan_video_15: ComfyUI 0.3.68, "
                                 "Qwen2.5-VL + byT5 for HunyuanVideo 1.5)"),
}


def with_newer_nodes(info: dict) -> dict:
    """/object_info with the entries above added: the nodes it lacks, and the combo values it lacks."""
    merged = {**info, **{name: {key: value for key, value in entry.items() if key != "source"}
                         for name, entry in NEWER_NODES.items() if name not in info}}
    for (class_type, name), (values, _) in NEWER_OPTIONS.items():
        spec = merged[class_type]["input"]
        group = "required" if name in spec.get("required", {}) else "optional"
        merged[class_type] = {**merged[class_type], "input": {
            **spec, group: {**spec[group], name: with_options(spec[group][name], values)}}}
    return merged


def with_options(spec: list, values: list[str]) -> list:
    """A combo input's spec with more options: [[options], {…}] (legacy nodes) or ["COMBO", {"options": […]}]."""
    kind, *rest = spec
    if isinstance(kind, list):
        return [[*kind, *(value for value in values if value not in kind)], *rest]
    options = rest[0].get("options", [])
    return [kind, {**rest[0], "options": [*options, *(value for value in values if value not in options)]}, *rest[1:]]
