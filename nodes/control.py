"""xDiT ControlNet, xDiT DiffSynth ControlNet and xDiT Z-Image Fun ControlNet: ComfyUI's Apply ControlNet,
QwenImageDiffsynthControlnet and ZImageFunControlnet for an xDiT model, and the control latent a sampler sends with
them.

ComfyUI's node (comfy_extras/nodes_model_patch.py, snapshot v0.3.64) keeps the image, the VAE and the inverted
mask, and its patch encodes the image when the model first runs, again at the latent's size when they differ
(``DiffSynthCnetPatch.__call__``: ``common_upscale`` "area" / "center" to the latent's pixels). Here the node keeps
the same three, and the sampler, which knows the latent's size, encodes them as that patch would
(``control_latent``): the backend has no VAE, and the patch network's own part (``img_in`` and the blocks) runs
on the backend, on every rank's share of the tokens.
"""

from __future__ import annotations

from comfy_api.latest import io

from .choices import TEST_PREFIX, ControlChoice
from .comfy_types import CATEGORY, XDiTModel

LATENT_CHANNELS = 16  # Qwen-Image's latent (Wan 2.1's VAE), Z-Image's (Flux's)


def patch_names() -> list[str]:
    import folder_paths

    from xdit_backend.models.model_patch import BUILTINS

    return [*folder_paths.get_filename_list("model_patches"), *(TEST_PREFIX + name for name in BUILTINS)]


def chosen_file(name: str, folder: str, what: str, image, vae) -> tuple[str, object, bool]:
    """A control node's file (a ``[test]`` built-in's name, else its path in ComfyUI's ``folder``), the control
    image to send (its colour channels; None for a built-in given none, whose control the backend draws), and whether
    the file takes the image's pixels itself (an XLabs ControlNet: no VAE). A file needs the image, and the model's
    VAE unless it takes pixels."""
    import folder_paths

    from xdit_backend.models.model_patch import PatchSpec, takes_pixels

    test = name.startswith(TEST_PREFIX)
    path = name.removeprefix(TEST_PREFIX) if test else folder_paths.get_full_path_or_raise(folder, name)
    pixels = not test and takes_pixels(PatchSpec(path, 1.0))
    if (image is None or (vae is None and not pixels)) and not test:
        needs, inputs = ("the control image", "image") if pixels else ("the control image and the model's VAE",
                                                                        "image and vae")
        raise ValueError(f"xDiT: the {what} needs {needs}\nconnect {inputs} (only [test] {what}s draw their control "
                         "from the seed)")
    usable = image is not None and (vae is not None or pixels)
    return path, image[:, :, :, :3] if usable else None, pixels


def mask_channels(path: str) -> int:
    """The inpainting patch's mask channels (its ``img_in`` takes 64 + 4 per channel), from the file's header."""
    from safetensors import safe_open

    from xdit_backend.models.model_patch import BUILTINS

    if path in BUILTINS:
        return 0
    with safe_open(path, framework="pt") as handle:
        if "img_in.weight" not in handle.keys():
            raise ValueError(f"xDiT: {path} is not a DiffSynth ControlNet model patch (it has no img_in.weight)\n"
                             "choose a Qwen-Image DiffSynth ControlNet from models/model_patches")
        return (handle.get_slice("img_in.weight").get_shape()[1] - 64) // 4


def inverted(mask):
    """A patch node's MASK as QwenImageDiffsynthControlnet (and ZImageFunControlnet) keep it: [B, 1, 1, H, W], 1
    where the image is kept; None stays None."""
    if mask is None:
        return None
    if mask.ndim == 3:
        mask = mask.unsqueeze(1)
    if mask.ndim == 4:
        mask = mask.unsqueeze(2)
    return 1.0 - mask


class XDiTDiffSynthControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTDiffSynthControlNet",
            display_name="xDiT DiffSynth ControlNet",
            category=CATEGORY,
            description="Qwen-Image's DiffSynth ControlNet (canny, depth, inpainting; a model patch from "
                        "models/model_patches) on an xDiT model, as QwenImageDiffsynthControlnet applies it: run "
                        "on the backend, each GPU controlling its own share of the image. Chain several.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("model_patch", options=patch_names(),
                               tooltip="[test] patches have random weights, for the [test] Qwen-Image"),
                io.Vae.Input("vae", optional=True, tooltip="the model's VAE (Qwen-Image's); not for [test] patches"),
                io.Image.Input("image", optional=True, tooltip="the control image (not for [test] patches)"),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01),
                io.Mask.Input("mask", optional=True, tooltip="inpainting patches: where to inpaint"),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def execute(cls, model, model_patch, strength, vae=None, image=None, mask=None) -> io.NodeOutput:
        path, image, _ = chosen_file(model_patch, "model_patches", "DiffSynth ControlNet", image, vae)
        control = ControlChoice(path, strength, image, vae, inverted(mask), mask_channels(path))
        return io.NodeOutput(model.with_control(control))


def preprocess(path: str) -> str | None:
    """How an SD3.5 ControlNet maps its image before encoding, from the file's ``control_type`` (1 canny, 2 depth;
    0 blur and other files: as it is), as ComfyUI's load_controlnet_sd35 reads it."""
    from safetensors import safe_open

    from xdit_backend.models.controlnet import BUILTINS

    if path in BUILTINS:
        return None
    with safe_open(path, framework="pt") as handle:
        if "control_type" not in handle.keys():
            return None
        return {1: "canny", 2: "depth"}.get(round(handle.get_tensor("control_type").item()))


def union_types() -> dict[str, int]:
    """ComfyUI's union ControlNet types by name (comfy/cldm/control_types.py, what SetUnionControlNetType offers)."""
    from comfy.cldm.control_types import UNION_CONTROLNET_TYPES

    return UNION_CONTROLNET_TYPES


def controlnet_names() -> list[str]:
    import folder_paths

    from xdit_backend.models.controlnet import BUILTINS, MODEL_PATCH_KINDS, family_of_builtin

    return [*folder_paths.get_filename_list("controlnet"),
            *(TEST_PREFIX + name for name in BUILTINS if family_of_builtin(name) not in MODEL_PATCH_KINDS)]


def fun_names() -> list[str]:
    import folder_paths

    from xdit_backend.models.controlnet import BUILTINS, family_of_builtin

    return [*folder_paths.get_filename_list("model_patches"),
            *(TEST_PREFIX + name for name in BUILTINS if family_of_builtin(name) == "z_image")]


def fun_channels(path: str) -> int:
    """A Fun ControlNet's input channels (16: the control latent; 33: with the inpainting mask and latent), from the
    file's header."""
    from safetensors import safe_open

    from xdit_backend.models.controlnet import BUILTINS
    from xdit_backend.models.z_image_controlnet import INPAINT_HINT_CHANNELS

    if path in BUILTINS:
        return INPAINT_HINT_CHANNELS
    with safe_open(path, framework="pt") as handle:
        if "control_all_x_embedder.2-1.weight" not in handle.keys():
            raise ValueError(f"xDiT: {path} is not a Z-Image Fun ControlNet (it has no control_all_x_embedder)\n"
                             "choose a Z-Image-Turbo-Fun-Controlnet-Union file from models/model_patches")
        return handle.get_slice("control_all_x_embedder.2-1.weight").get_shape()[1] // 4


class XDiTZImageFunControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTZImageFunControlNet",
            display_name="xDiT Z-Image Fun ControlNet",
            category=CATEGORY,
            description="Z-Image's Fun ControlNet Union (alibaba-pai's 1.0 / 2.0 / 2.1, a model patch from "
                        "models/model_patches) on an xDiT model, as ZImageFunControlnet applies it: its control "
                        "layers run on the backend under the model's own split, each GPU controlling its share of "
                        "the image. A 2.x file also inpaints (inpaint_image, mask). Chain several.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("model_patch", options=fun_names(),
                               tooltip="[test] patches have random weights, for the [test] Z-Image"),
                io.Vae.Input("vae", optional=True, tooltip="the model's VAE (Z-Image's: Flux's); not for [test] "
                                                          "patches"),
                io.Float.Input("strength", default=1.0, min=-10.0, max=10.0, step=0.01),
                io.Image.Input("image", optional=True, tooltip="the control image (canny, depth, pose, …)"),
                io.Image.Input("inpaint_image", optional=True, tooltip="2.x files: the image to inpaint"),
                io.Mask.Input("mask", optional=True, tooltip="2.x files: where to inpaint"),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def execute(cls, model, model_patch, strength, vae=None, image=None, inpaint_image=None,
                mask=None) -> io.NodeOutput:
        path, given, _ = chosen_file(model_patch, "model_patches", "Fun ControlNet",
                                     image if image is not None else inpaint_image, vae)
        channels = fun_channels(path)
        if image is None and channels == LATENT_CHANNELS and given is not None:
            raise ValueError("xDiT: this Fun ControlNet (1.0, 16 channels) needs the control image\nconnect image")
        mask = inverted(mask)
        usable = given is not None
        control = ControlChoice(path, strength, image[..., :3] if usable and image is not None else None,
                                vae, mask, channels - LATENT_CHANNELS,
                                inpaint_image=inpaint_image[..., :3] if usable and inpaint_image is not None else None,
                                fun=True)
        return io.NodeOutput(model.with_control(control))


class XDiTControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="XDiTControlNet",
            display_name="xDiT ControlNet",
            category=CATEGORY,
            description="A Flux.1, SD3.5, HunyuanDiT or Qwen-Image ControlNet (InstantX's, Shakker-Labs' and XLabs' "
                        "for Flux, Stability's for SD3.5, Tencent's for HunyuanDiT; models/controlnet) on an xDiT "
                        "model, as Load ControlNet Model + Set Union ControlNet Type + Apply ControlNet (with the VAE) "
                        "apply it: run on the backend under the model's own split, each GPU adding its share of the "
                        "residuals. Chain several.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("control_net", options=controlnet_names(),
                               tooltip="[test] ControlNets have random weights, for the [test] Qwen-Image"),
                io.Vae.Input("vae", optional=True, tooltip="the model's VAE; not for [test] or XLabs ControlNets"),
                io.Image.Input("image", optional=True, tooltip="the control image (not for [test] ControlNets)"),
                io.Float.Input("strength", default=1.0, min=0.0, max=10.0, step=0.01),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.001),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.001),
                io.Combo.Input("union_type", options=["auto", *union_types()], default="auto", optional=True,
                               tooltip="a union ControlNet's control type, as Set Union ControlNet Type's"),
            ],
            outputs=[XDiTModel.Output(display_name="XDIT_MODEL")],
        )

    @classmethod
    def execute(cls, model, control_net, strength, start_percent, end_percent, vae=None, image=None,
                union_type="auto") -> io.NodeOutput:
        path, image, pixels = chosen_file(control_net, "controlnet", "ControlNet", image, vae)
        control = ControlChoice(path, strength, image, vae, start=start_percent, end=end_percent,
                                resize="nearest-exact", mode=union_types().get(union_type), preprocess=preprocess(path),
                                pixels=pixels)
        return io.NodeOutput(model.with_control(control))


def fun_control_latent(control: ControlChoice, rows: int, columns: int):
    """A Z-Image Fun ControlNet's control input as ZImageControlPatch encodes it for a latent of that size, before its
    model-space step (the backend's): the control image's latent (a 0.5 grey image's without one), and for a
    33-channel file the mask (resized "nearest"; zeros without one) and the inpainting image's latent (0.5 grey
    where the mask says to inpaint; all grey without one). Images meet the latent's pixels "area" / "center"."""
    import torch

    import comfy.utils

    if control.image is None and control.inpaint_image is None:
        return None  # a built-in: the backend draws its control
    scale = control.vae.spacial_compression_encode()

    def fitted(image):
        if (image.shape[1], image.shape[2]) == (rows * scale, columns * scale):
            return image
        return comfy.utils.common_upscale(image.movedim(-1, 1), columns * scale, rows * scale, "area",
                                          "center").movedim(1, -1)

    image = fitted(control.image) if control.image is not None else None
    if not control.mask_channels:
        return control.vae.encode(image)[:1].to("cpu", torch.float32).contiguous()  # [1, 16, rows, columns]
    inpaint = fitted(control.inpaint_image) if control.inpaint_image is not None else torch.ones_like(image) * 0.5
    mask = None
    if control.mask is not None:
        mask = control.mask.view(control.mask.shape[0], -1, *control.mask.shape[-2:]).mean(dim=1, keepdim=True)
        kept = comfy.utils.common_upscale(mask, inpaint.shape[-2], inpaint.shape[-3], "bilinear", "center")
        inpaint = (inpaint - 0.5) * kept.movedim(1, -1).round() + 0.5
    inpaint_latent = control.vae.encode(inpaint)  # [B, 16, rows, columns]
    if mask is None:
        mask = torch.zeros_like(inpaint_latent)[:, :1]
    else:
        mask = comfy.utils.common_upscale(mask.to(inpaint_latent.device), inpaint_latent.shape[-1],
                                          inpaint_latent.shape[-2], "nearest", "center")
    latent = control.vae.encode(image if image is not None else torch.ones_like(inpaint) * 0.5)
    latent = torch.cat([latent, mask.to(latent), inpaint_latent.to(latent)], dim=1)  # [B, 33, rows, columns]
    return latent[:1].to("cpu", torch.float32).contiguous()


def control_latent(control: ControlChoice, rows: int, columns: int):
    """The control latent [1, C, rows, columns] the patch or ControlNet would encode for a latent of that size: the
    image resized to its pixels (a patch's "area" when they differ, a ControlNet's "nearest-exact" always: ComfyUI's
    get_control), through the VAE, with a patch's mask channels after it (the mask resized "bilinear", or ones
    without one). None for a built-in without an image (the backend draws one)."""
    import torch

    import comfy.utils

    if control.fun:
        return fun_control_latent(control, rows, columns)
    if control.image is None:
        return None
    if control.pixels:  # an XLabs ControlNet: the image itself at 8× the latent, as get_control hands it without a VAE
        image = comfy.utils.common_upscale(control.image.movedim(-1, 1), columns * 8, rows * 8, control.resize,
                                           "center")
        return image[:1].to("cpu", torch.float32).contiguous()  # [1, 3, 8·rows, 8·columns]
    scale = control.vae.spacial_compression_encode()
    image = control.image
    if (image.shape[1], image.shape[2]) != (rows * scale, columns * scale) or control.resize != "area":
        image = comfy.utils.common_upscale(image.movedim(-1, 1), columns * scale, rows * scale, control.resize,
                                           "center").movedim(1, -1)
    if control.preprocess == "canny":
        image = image * 255 * 0.5 + 0.5
    elif control.preprocess == "depth":
        image = 1.0 - image
    latent = control.vae.encode(image)  # [B, 16, 1, rows, columns] (Qwen-Image's VAE) or [B, 16, rows, columns]
    if control.mask_channels:
        if control.mask is None:
            extra = torch.ones_like(latent)[:, :control.mask_channels]
        else:
            extra = comfy.utils.common_upscale(control.mask.mean(dim=1, keepdim=True), latent.shape[-1],
                                               latent.shape[-2], "bilinear", "none")
        latent = torch.cat([latent, extra.to(latent)], dim=1)
    if latent.dim() == 5:
        latent = latent[:, :, 0]  # one frame
    return latent[:1].to("cpu", torch.float32).contiguous()
