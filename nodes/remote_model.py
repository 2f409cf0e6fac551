"""xDiT Model: a real ComfyUI ``MODEL`` whose transformer runs on the backend.

ComfyUI's own model detection reads the file's header (no weights: every tensor is a ``meta`` tensor of the
header's shape and dtype) and builds its own ``BaseModel`` for it — model sampling, latent format,
``extra_conds``, memory rules — with the transformer left out (``disable_unet_model_creation``); the
transformer is model_call.RemoteDiffusionModel, whose forward is one backend call. So every sampler, guider,
scheduler, model-sampling node, CFG function and conditioning node runs as ComfyUI runs it, and only the
transformer's calls go to the backend's GPUs, in the layout chosen (ulysses, ring, cfg over the call's rows,
dp, weight sharding).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from comfy_api.latest import io

from .choices import ModelChoice, ParallelChoice
from .comfy_types import CATEGORY, XDiTModel, XDiTParallel
from . import model_controls
from .model_call import RemoteDiffusionModel


# The input layers whose weight's shape ComfyUI's BaseModel reads off the diffusion model (comfy/model_base.py:
# WAN21.concat_cond, patch_embedding; Flux.concat_cond, img_in): given to the stand-in as meta tensors, no weights.
INPUT_LAYERS = ("patch_embedding", "img_in")


def meta_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The file's tensors as ``meta`` tensors of their shapes and dtypes: what ComfyUI's detection reads. A GGUF
    file (which ComfyUI's core cannot read) gives its tensors' original shapes, in bf16 (the blocks' logical
    values; ComfyUI's detection reads the keys and shapes)."""
    from xdit_backend.models.safetensors_file import DTYPES, open_file

    if path.lower().endswith(".gguf"):
        from xdit_backend.models.gguf_blocks import gguf_package
        from xdit_backend.models.gguf_file import shapes

        return {key: torch.empty(shape, dtype=torch.bfloat16, device="meta")
                for key, shape in shapes(gguf_package().GGUFReader(path), path).items()}
    with open_file(path) as file:
        return {key: torch.empty(view.get_shape(), dtype=DTYPES[view.get_dtype()], device="meta")
                for key in file.keys() for view in (file.get_slice(key),)}


def comfy_model(path: str, diffusion_model: torch.nn.Module):
    """ComfyUI's ModelPatcher for the file at ``path``, as comfy/sd.py load_diffusion_model_state_dict detects it,
    with ``diffusion_model`` as its transformer."""
    import comfy.model_detection
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.utils

    state_dict = meta_state_dict(path)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(state_dict)
    state_dict = comfy.utils.state_dict_prefix_replace(state_dict, {prefix: ""}, filter_keys=True) or state_dict
    config = comfy.model_detection.model_config_from_unet(state_dict, "")
    if config is None:
        converted = comfy.model_detection.convert_diffusers_mmdit(state_dict, "")
        config = converted and comfy.model_detection.model_config_from_unet(converted, "")
    if config is None:
        raise ValueError(f"xDiT: ComfyUI does not recognise the model in {path}, so it cannot sample it\n"
                         "use the xDiT Sampler for this file (the backend reads more layouts than ComfyUI does)")
    config.set_inference_dtype(torch.float32, None)  # what ComfyUI casts x and the conditioning to (model_call.py)
    config.unet_config["disable_unet_model_creation"] = True
    model = config.get_model(state_dict, "", device=torch.device("cpu"))
    for name in INPUT_LAYERS:  # what ComfyUI's model reads off its transformer to count the input's channels
        if f"{name}.weight" in state_dict:
            setattr(diffusion_model, name, SimpleNamespace(weight=state_dict[f"{name}.weight"]))  # a meta tensor
    model.diffusion_model = diffusion_model
    diffusion_model.latent_out = model.process_latent_out  # reference latents back to raw latent space
    model.memory_usage_factor = 0.0  # the activations live on the backend's GPUs, not in ComfyUI's process
    patcher = remote_patcher(comfy.model_patcher.ModelPatcher)(model, load_device=mm.get_torch_device(),
                                                              offload_device=mm.unet_offload_device())
    model_controls.install(patcher)  # Apply ControlNet's ControlNets run on the backend, not in ComfyUI's process
    return patcher


def remote_patcher(model_patcher: type) -> type:
    """ComfyUI's ModelPatcher, refusing weight patches: ComfyUI's LoRA loaders and model-merging nodes patch the
    weights in ComfyUI's process, and this model's weights are on the backend (ComfyUI would match none of the
    LoRA's keys and only log it). ``clone`` keeps the class, so every node downstream gets it too."""

    class RemoteModelPatcher(model_patcher):
        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
            if patches:
                raise ValueError(
                    f"xDiT: a LoRA loader (LoraLoader, LoraLoaderModelOnly) or a model-merging node patches "
                    f"{len(patches)} weights of the xDiT Model in ComfyUI's process, but its weights are on the "
                    "backend, so the patch would be lost\nchain xDiT LoRA between xDiT Load Diffusion Model and "
                    "xDiT Model instead (the same LoRA files and strengths, patched on the backend)")
            return super().add_patches(patches, strength_patch, strength_model)

    return RemoteModelPatcher


class BackendCalls:
    """The backend a MODEL's calls go to: its client (started on the first call, as the xDiT Sampler starts it),
    the model choice and the layout as request fields; ``__call__`` is model_call.RemoteDiffusionModel's send."""

    def __init__(self, choice: ModelChoice, parallel: ParallelChoice | None):
        self.choice, self.parallel = choice, parallel
        from xdit_backend import schema

        fields = choice.request_fields()  # the choice's sample fields; an evaluate takes those schema.EVALUATE shares
        self.fields = {name: value for name, value in fields.items() if name in schema.EVALUATE_SHARED}
        self.fields["parallel"] = (parallel or ParallelChoice()).request_value()
        self.client = None
        self.last_info: dict = {}

    def __call__(self, tensors: dict, inputs: dict, position: dict) -> torch.Tensor:
        import comfy.model_management as mm

        from .sampler import _shares_comfyui_gpu, backend_client, comfyui_errors

        if self.client is None:
            client, running = backend_client(self.parallel)
            if _shares_comfyui_gpu(mm.get_torch_device(), running):
                mm.soft_empty_cache()
            self.client = client
        with comfyui_errors():
            output, self.last_info = self.client.evaluate({**self.fields, **position}, tensors, inputs,
                                                          should_cancel=mm.processing_interrupted)
        return output


class XDiTModelNode(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTModel",
            display_name="xDiT Model",
            category=CATEGORY,
            description="A ComfyUI MODEL whose transformer runs on the xDiT backend's GPUs: use it with any "
                        "sampler, guider, scheduler, model-sampling node, CFG function and conditioning node "
                        "(KSampler, SamplerCustomAdvanced, ConditioningSetArea…). Each model call is one request "
                        "to the backend; the conditioning is sent once per generation. The xDiT Sampler runs the "
                        "whole loop on the backend instead (lower overhead, PipeFusion).",
            inputs=[
                XDiTModel.Input("model", tooltip="from xDiT Load Diffusion Model (and xDiT LoRA)"),
                XDiTParallel.Input("parallel", optional=True,
                                   tooltip="default: all GPUs, layout chosen automatically for each call"),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def fingerprint_inputs(cls, model, parallel=None):
        return repr((model.fingerprint(), parallel))

    @classmethod
    def execute(cls, model: ModelChoice, parallel: ParallelChoice | None = None) -> io.NodeOutput:
        from xdit_backend.models import registry

        if model.ref in registry.BUILTINS:
            raise ValueError(f"xDiT: the [test] model {model.ref} has no file for ComfyUI to read its kind from\n"
                             "use a model file, or the xDiT Sampler for the [test] models")
        if model.shift is not None:
            raise ValueError("xDiT: the loader's shift is the xDiT Sampler's; the xDiT Model samples with ComfyUI's "
                             "model sampling\nset the loader's shift to 0 and use ModelSamplingFlux / "
                             "ModelSamplingSD3 after the xDiT Model")
        spec = registry.spec(model.ref)
        pipelined = bool(parallel and parallel.degrees and parallel.degrees.get("pipefusion", 1) > 1)
        stand_in = RemoteDiffusionModel(spec, BackendCalls(model, parallel),
                                        run_position=model.cache != "none" or pipelined, model_controls=model.controls)
        return io.NodeOutput(comfy_model(model.ref, stand_in))
