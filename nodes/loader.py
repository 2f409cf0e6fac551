"""xDiT Load Diffusion Model, xDiT LoRA, and a stand-in conditioning for the built-in test models."""

from __future__ import annotations

import torch
from comfy_api.latest import io

from .choices import TEST_PREFIX, ModelChoice
from .comfy_types import CATEGORY, XDiTModel

# weight_dtype → (the backend's compute dtype, its storage weight_dtype). ComfyUI's UNETLoader
# choices first: default keeps the file's precision (an fp8 or GGUF file stays so, computed in bf16
# on GPUs, fp32 on the CPU); fp8_* store a 16/32-bit file's Linear weights in that float8. Then the
# compute dtypes, for a 16/32-bit model held and computed in one.
DTYPES = {"default": ("auto", "default"), "fp8_e4m3fn": ("auto", "fp8_e4m3fn"), "fp8_e5m2": ("auto", "fp8_e5m2"),
          "bf16": ("bfloat16", "default"), "fp16": ("float16", "default"), "fp32": ("float32", "default")}
CHECKPOINTS = "checkpoints/"  # files from models/checkpoints are listed with this prefix


def model_names() -> list[str]:
    """Files from diffusion_models (and unet; .gguf included), then checkpoints/…, then the built-in test models."""
    import folder_paths

    from xdit_backend.models.registry import BUILTINS

    return [*folder_paths.get_filename_list("diffusion_models"), *gguf_names(),
            *(CHECKPOINTS + name for name in folder_paths.get_filename_list("checkpoints")),
            *(TEST_PREFIX + name for name in BUILTINS)]


def gguf_names() -> list[str]:
    """GGUF files in diffusion_models (and unet), where city96's ComfyUI-GGUF users keep them:
    ComfyUI's own list leaves the .gguf extension out."""
    import folder_paths

    names = set()
    for root in folder_paths.get_folder_paths("diffusion_models"):
        files, _ = folder_paths.recursive_search(root)
        names.update(folder_paths.filter_files_extensions(files, {".gguf"}))
    return sorted(names)


def missing_file(model_name: str) -> str | None:
    """What is missing of the loader's model, said for ComfyUI's validation message; None when it is there."""
    from xdit_backend.models.registry import BUILTINS

    if model_name.startswith(TEST_PREFIX) and model_name.removeprefix(TEST_PREFIX) not in BUILTINS:
        return (f"model_name {model_name!r}: no such built-in test model; the built-ins are "
                f"{', '.join(TEST_PREFIX + name for name in BUILTINS)}")
    try:
        model_path(model_name)
    except FileNotFoundError:
        where = "checkpoints" if model_name.startswith(CHECKPOINTS) else "diffusion_models (or unet)"
        return (f"model_name {model_name!r} is not in ComfyUI's models/{where}: put the file there (then refresh "
                "the page, R), or choose one the list shows")
    return None


def model_path(name: str) -> str:
    import folder_paths

    if name.startswith(TEST_PREFIX):
        return name.removeprefix(TEST_PREFIX)
    if name.startswith(CHECKPOINTS):
        return folder_paths.get_full_path_or_raise("checkpoints", name.removeprefix(CHECKPOINTS))
    return folder_paths.get_full_path_or_raise("diffusion_models", name)


class XDiTLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import folder_paths

        from xdit_backend.models.registry import family_names

        return io.Schema(
            node_id="XDiTLoadDiffusionModel",
            display_name="xDiT Load Diffusion Model",
            category=CATEGORY,
            description=f"Chooses the diffusion model the xDiT backend runs ({', '.join(family_names())}), from "
                        "diffusion_models or checkpoints. Nothing is loaded here: the backend loads it on "
                        "every GPU when a sampler first runs, and keeps it loaded.",
            inputs=[
                io.Combo.Input("model_name", options=model_names(),
                               tooltip="[test] models have random weights and need no file"),
                io.Combo.Input("weight_dtype", options=list(DTYPES), default="default",
                               tooltip="default: the file's precision (an fp8 or GGUF file stays so on the GPUs, "
                                       "upcast one layer at a time), computed in bf16 on GPUs, fp32 on the CPU. "
                                       "fp8_e4m3fn / fp8_e5m2: a bf16/fp16 file's weights stored in fp8 (half "
                                       "the memory). bf16 / fp16 / fp32: weights and compute in that dtype."),
                io.Combo.Input("lora_name", options=["None", *folder_paths.get_filename_list("loras")],
                               default="None", optional=True),
                io.Float.Input("lora_strength", default=1.0, min=-10.0, max=10.0, step=0.01, optional=True),
                io.Float.Input("shift", default=0.0, min=0.0, max=100.0, step=0.01, optional=True,
                               tooltip="flow shift, as ModelSamplingFlux / ModelSamplingSD3 set it; 0: the model's "
                                       "default (Flux 1.15, SD3 3, Wan 8). PixArt has none."),
                io.Boolean.Input("compile", default=False, optional=True,
                                 tooltip="torch.compile the transformer's blocks: the first run compiles (slow), "
                                         "later runs reuse the compiled model, at any size. A separate copy "
                                         "of the model from the uncompiled one."),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def choice(cls, model_name, weight_dtype, lora_name="None", lora_strength=1.0, shift=0.0,
               compile=False) -> ModelChoice:
        dtype, storage = DTYPES[weight_dtype]
        choice = ModelChoice(model_path(model_name), dtype, shift=shift or None, compile=compile, weight_dtype=storage)
        if lora_name and lora_name != "None":
            import folder_paths

            choice = choice.with_lora(folder_paths.get_full_path_or_raise("loras", lora_name), lora_strength)
        return choice

    @classmethod
    def validate_inputs(cls, model_name) -> bool | str:
        """ComfyUI's check when the prompt is queued (its input validation), not only when it runs: a model file
        that is not where the loader looks is refused then, with the way out (only model_name is named here, so
        ComfyUI still checks the other inputs' ranges itself)."""
        return missing_file(model_name) or True

    @classmethod
    def fingerprint_inputs(cls, **inputs):
        return cls.choice(**inputs).fingerprint()

    @classmethod
    def execute(cls, model_name, weight_dtype, lora_name="None", lora_strength=1.0, shift=0.0,
                compile=False) -> io.NodeOutput:
        return io.NodeOutput(cls.choice(model_name, weight_dtype, lora_name, lora_strength, shift, compile))


class XDiTLoraLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        import folder_paths

        return io.Schema(
            node_id="XDiTLoraLoader",
            display_name="xDiT LoRA",
            category=CATEGORY,
            description="Adds a LoRA (kohya, ComfyUI or diffusers layout) to an xDiT model; patched onto the "
                        "loaded model (no copy of it). Chain several for several LoRAs.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras")),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def validate_inputs(cls, lora_name) -> bool | str:
        """When the prompt is queued: a LoRA file that is not in models/loras is refused then, not when it runs."""
        import folder_paths

        if folder_paths.get_full_path("loras", lora_name) is None:
            return (f"lora_name {lora_name!r} is not in ComfyUI's models/loras: put the file there (then refresh the "
                    "page, R), or choose one the list shows")
        return True

    @classmethod
    def fingerprint_inputs(cls, model, lora_name, strength):
        import folder_paths

        return model.with_lora(folder_paths.get_full_path_or_raise("loras", lora_name), strength).fingerprint()

    @classmethod
    def execute(cls, model, lora_name, strength) -> io.NodeOutput:
        import folder_paths

        return io.NodeOutput(model.with_lora(folder_paths.get_full_path_or_raise("loras", lora_name), strength))


class XDiTStandInConditioning(io.ComfyNode):
    """Seeded random conditioning of a given shape, for test models and checks without text encoders."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTStandInConditioning",
            display_name="xDiT Stand-in Conditioning (test)",
            category=CATEGORY + "/test",
            description="Random text conditioning from a seed, shaped like a text encoder's output: for the "
                        "[test] models and for comparing samplers without text-encoder files. Not a prompt.",
            inputs=[
                io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF),
                io.Int.Input("tokens", default=8, min=1, max=512),
                io.Int.Input("context_dim", default=64, min=1, max=8192),
                io.Int.Input("pooled_dim", default=32, min=0, max=8192, tooltip="0: no pooled output"),
            ],
            outputs=[io.Conditioning.Output()],
        )

    @classmethod
    def execute(cls, seed, tokens, context_dim, pooled_dim) -> io.NodeOutput:
        generator = torch.Generator().manual_seed(seed)
        context = torch.randn(1, tokens, context_dim, generator=generator)
        options = {"pooled_output": torch.randn(1, pooled_dim, generator=generator)} if pooled_dim else {}
        return io.NodeOutput([[context, options]])
