"""The xDiT DiffSynth ControlNet, xDiT Z-Image Fun ControlNet and xDiT ControlNet nodes in the real ComfyUI: the
control latent the sampler sends is what ComfyUI's own DiffSynthCnetPatch and ControlNet.get_control encode (and
ZImageControlPatch, restated from ComfyUI's current source: the snapshot predates it), resized to the latent, with an
inpainting patch's mask; and a workflow with each node runs through ComfyUI's HTTP API to the latent the backend's
serial reference gives with the same control."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from host.conftest import FLUX_TINY, QWEN_TINY, WORKFLOWS

from xdit_backend.models import model_patch

pytestmark = pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"),
                                reason="needs a ComfyUI checkout: set COMFYUI_DIR (and run with a Python that has "
                                       "ComfyUI's requirements) to test the node in ComfyUI")


class StandInControlModel:
    """A control model as ControlNet.get_control calls one: it keeps the hint it is given."""

    dtype = torch.float32
    hint = None

    def __call__(self, x, hint, timesteps, context, **extra):
        self.hint = hint
        return {"input": []}


class StandInVAE:
    """A VAE as the patch uses one (encode, spacial_compression_encode): 8×8 pixel means through a fixed map to 16
    channels, [B, 16, 1, h, w] like Qwen-Image's (Wan 2.1's) VAE."""

    def __init__(self):
        self.mix = torch.randn(16, 3, generator=torch.Generator().manual_seed(9))

    def spacial_compression_encode(self) -> int:
        return 8

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        pooled = torch.nn.functional.avg_pool2d(image.movedim(-1, 1).float(), 8)  # [B, 3, h, w]
        return torch.einsum("oc,bchw->bohw", self.mix, pooled)[:, :, None]  # [B, 16, 1, h, w]


@pytest.mark.parametrize("mask_channels, masked", [(0, False), (1, True), (1, False)],
                         ids=["control", "inpainting-with-mask", "inpainting-without"])
def test_the_control_latent_is_what_comfyuis_patch_encodes(pack, tmp_path, mask_channels, masked):
    """An image of another size than the latent's pixels (ComfyUI's patch re-encodes it resized), through the node
    and the sampler's encoding, then the patch's img_in on the backend: ComfyUI's encoded_image exactly."""
    import comfy.ops
    import comfy_extras.nodes_model_patch as nodes_model_patch
    from comfyui_xdit.nodes import choices, control

    network = model_patch.BlockwiseControlNet(2, 32, 64, 4 * mask_channels)
    theirs = nodes_model_patch.QwenImageBlockWiseControlNet(num_layers=2, dim=32, additional_in_dim=4 * mask_channels,
                                                           operations=comfy.ops.manual_cast)
    theirs.load_state_dict(network.state_dict())
    g = torch.Generator().manual_seed(2)
    image = torch.rand(1, 72, 100, 3, generator=g)  # pixels: not the latent's 64 × 96
    mask = torch.rand(1, 72, 100, generator=g) if masked else None
    vae = StandInVAE()
    path = tmp_path / "patch.safetensors"
    from safetensors.torch import save_file

    save_file(network.state_dict(), str(path))
    mask_in = None if mask is None else 1.0 - mask.unsqueeze(1).unsqueeze(2)  # as QwenImageDiffsynthControlnet
    chosen = choices.ControlChoice(str(path), 0.5, image, vae, mask_in, control.mask_channels(str(path)))
    ours = network.hint(control.control_latent(chosen, 8, 12))  # [1, 48, 32]

    patch = nodes_model_patch.DiffSynthCnetPatch(SimpleNamespace(model=theirs), vae, image, 0.5, mask_in)
    x = torch.zeros(1, 16, 1, 8, 12)  # the latent the model runs on: 64 × 96 pixels
    img = torch.zeros(1, 48, 32)
    patch({"x": x, "img": img, "block_index": 0})  # re-encodes at the latent's size
    assert patch.encoded_image_size == (64, 96)
    assert (ours - patch.encoded_image).abs().max() <= 1e-6


def run_with_control(host, node: dict, prefix: str, workflow: str = QWEN_TINY,
                     model: str = "qwen-image-tiny") -> tuple[torch.Tensor, dict]:
    """A tiny workflow (3 steps; Qwen-Image's unless told) with a control node (class and inputs) between the loader
    and the sampler, through ComfyUI's HTTP API: its latent [B, 16, h, w] (one frame) and the serial request it asked
    for."""
    prompt = json.loads((WORKFLOWS / "api" / f"{workflow}.api.json").read_text())
    kind = {node["class_type"]: key for key, node in prompt.items()}
    prompt["control"] = {"class_type": node["class_type"],
                         "inputs": {"model": [kind["XDiTLoadDiffusionModel"], 0], **node["inputs"]}}
    prompt[kind["XDiTLoadDiffusionModel"]]["inputs"]["model_name"] = f"[test] {model}"
    sampling = prompt[kind["XDiTSampler"]]["inputs"]
    sampling.update(model=["control", 0], steps=3)
    prompt[kind["SaveLatent"]]["inputs"]["filename_prefix"] = f"latents/{prefix}"
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    empty = prompt[kind["EmptySD3LatentImage"]]["inputs"]
    fields = {"model": model, "width": empty["width"], "height": empty["height"],
              "steps": sampling["steps"], "seed": sampling["seed"], "cfg": sampling["cfg"], "dtype": "float32"}
    latent = host.latest_latent(prefix)
    return latent[:, :, 0] if latent.dim() == 5 else latent, fields


def test_a_workflow_with_the_node_gives_the_serial_latent(host):
    """The tiny Qwen-Image workflow with xDiT DiffSynth ControlNet ([test] patch, strength 0.8): the latent of the
    backend's serial reference with that patch, and not the one without it."""
    from xdit_backend.service.reference import serial_latent

    latent, fields = run_with_control(host, {"class_type": "XDiTDiffSynthControlNet", "inputs": {
        "model_patch": "[test] qwen-image-diffsynth-tiny", "strength": 0.8}}, "qwen-control")
    controlled = serial_latent({**fields, "controls": [{"path": "qwen-image-diffsynth-tiny", "strength": 0.8}]})
    assert (latent - controlled).abs().max() <= 1e-4 * max(1.0, controlled.abs().max().item())
    assert (latent - serial_latent(fields)).abs().max() > 1e-2


@pytest.mark.parametrize("preprocess", [None, "canny", "depth"])
def test_the_controlnet_latent_is_what_comfyuis_get_control_encodes(pack, preprocess):
    """ComfyUI's own ControlNet.get_control (its control model a stand-in that keeps the hint it is given) resizes
    the image "nearest-exact" to the latent's pixels, maps it as an SD3.5 canny or depth ControlNet's
    preprocess_image does (load_controlnet_sd35's, taken from the loader of a file with that control_type), encodes
    it and puts it in model space; the xDiT ControlNet node's latent, through the backend's process_in, is that
    hint."""
    import comfy.controlnet
    import comfy.latent_formats
    from comfyui_xdit.nodes import choices, control

    from xdit_backend.models import latent_formats

    image = torch.rand(1, 72, 100, 3, generator=torch.Generator().manual_seed(3))
    vae = StandInVAE()
    mapping = {None: lambda a: a}
    if preprocess is not None:
        sd35 = comfy.controlnet.load_controlnet_sd35(sd35_controlnet_state({"canny": 1, "depth": 2}[preprocess]))
        mapping[preprocess] = sd35.preprocess_image
    theirs = comfy.controlnet.ControlNet(None, compression_ratio=1, latent_format=comfy.latent_formats.Wan21(),
                                         extra_conds=[], preprocess_image=mapping[preprocess])
    theirs.control_model = kept = StandInControlModel()
    theirs.set_cond_hint(image.movedim(-1, 1), 0.7, (0.0, 1.0), vae=vae)
    theirs.model_sampling_current = SimpleNamespace(timestep=lambda t: t, calculate_input=lambda t, x: x)
    x = torch.zeros(1, 16, 1, 8, 12)  # the latent: 64 × 96 pixels
    theirs.get_control(x, torch.tensor([0.5]), {"c_crossattn": torch.zeros(1, 4, 8)}, 1, {})

    chosen = choices.ControlChoice("qwen-image-controlnet-tiny", 0.7, image, vae, resize="nearest-exact",
                                   preprocess=preprocess)
    ours = latent_formats.WAN21.process_in(control.control_latent(chosen, 8, 12))
    assert (ours - kept.hint[:, :, 0]).abs().max() <= 1e-6


def test_a_workflow_with_the_controlnet_node_gives_the_serial_latent(host):
    """The tiny Qwen-Image workflow with xDiT ControlNet ([test], strength 0.6, the first 60 % of the schedule): the
    backend's serial reference with that ControlNet and range, not the whole range's."""
    from xdit_backend.service.reference import serial_latent

    latent, fields = run_with_control(host, {"class_type": "XDiTControlNet", "inputs": {
        "control_net": "[test] qwen-image-controlnet-tiny", "strength": 0.6, "start_percent": 0.0,
        "end_percent": 0.6}}, "qwen-controlnet")
    control = {"path": "qwen-image-controlnet-tiny", "strength": 0.6}
    expected = serial_latent({**fields, "controls": [{**control, "start": 0.0, "end": 0.6}]})
    assert (latent - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert (latent - serial_latent({**fields, "controls": [control]})).abs().max() > 1e-3


def test_a_flux_workflow_with_a_union_controlnet_gives_the_serial_latent(host):
    """The tiny Flux workflow with xDiT ControlNet ([test] flux-controlnet-tiny, union type canny): the backend's
    serial reference with that ControlNet and type, not the one of type auto."""
    from xdit_backend.service.reference import serial_latent

    latent, fields = run_with_control(host, {"class_type": "XDiTControlNet", "inputs": {
        "control_net": "[test] flux-controlnet-tiny", "strength": 0.6, "start_percent": 0.0, "end_percent": 1.0,
        "union_type": "canny/lineart/anime_lineart/mlsd"}}, "flux-controlnet", FLUX_TINY, "flux-tiny")
    control = {"path": "flux-controlnet-tiny", "strength": 0.6}
    expected = serial_latent({**fields, "controls": [{**control, "type": 3}]})
    assert (latent - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert (latent - serial_latent({**fields, "controls": [control]})).abs().max() > 1e-3


def test_an_sd3_workflow_with_its_controlnet_gives_the_serial_latent(host):
    """The tiny workflow on [test] sd3-tiny with xDiT ControlNet ([test] sd3-controlnet-tiny, strength 0.6, the last
    half of the schedule): the backend's serial reference with that ControlNet and range, not the whole range's."""
    from xdit_backend.service.reference import serial_latent

    latent, fields = run_with_control(host, {"class_type": "XDiTControlNet", "inputs": {
        "control_net": "[test] sd3-controlnet-tiny", "strength": 0.6, "start_percent": 0.5, "end_percent": 1.0}},
        "sd3-controlnet", FLUX_TINY, "sd3-tiny")
    control = {"path": "sd3-controlnet-tiny", "strength": 0.6}
    expected = serial_latent({**fields, "controls": [{**control, "start": 0.5, "end": 1.0}]})
    assert (latent - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert (latent - serial_latent({**fields, "controls": [control]})).abs().max() > 1e-3


def test_a_workflow_with_the_z_image_fun_node_gives_the_serial_latent(host):
    """The tiny workflow on [test] z-image-tiny with xDiT Z-Image Fun ControlNet ([test] patch, strength 0.7): the
    backend's serial reference with that control, not the one without it."""
    from xdit_backend.service.reference import serial_latent

    latent, fields = run_with_control(host, {"class_type": "XDiTZImageFunControlNet", "inputs": {
        "model_patch": "[test] z-image-fun-controlnet-tiny", "strength": 0.7}}, "z-image-fun", model="z-image-tiny")
    expected = serial_latent({**fields, "controls": [{"path": "z-image-fun-controlnet-tiny", "strength": 0.7}]})
    assert (latent - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())
    assert (latent - serial_latent(fields)).abs().max() > 1e-2


class FluxStandInVAE(StandInVAE):
    """As StandInVAE, with a 4-D latent [B, 16, h, w] like Z-Image's (Flux's) VAE."""

    def encode(self, image: torch.Tensor) -> torch.Tensor:
        return super().encode(image)[:, :, 0]


@pytest.mark.parametrize("given", ["image", "image-inpaint-mask", "inpaint-mask", "image-16-channels"])
def test_the_fun_control_latent_is_what_comfyuis_patch_encodes(pack, given):
    """ZImageControlPatch's encode_latent_cond, step by step as ComfyUI's source has it (the shared snapshot predates
    it): images resized "area" / "center" to the latent's pixels; a 33-channel file's input is the control latent
    (a 0.5 grey image's without one), the inverted mask resized "nearest" (zeros without one) and the inpainting
    image's latent, grey where the mask says to inpaint. The backend's model-space step comes after
    (z_image_controlnet.hint)."""
    import comfy.utils
    from comfyui_xdit.nodes import choices, control

    g = torch.Generator().manual_seed(6)
    image = torch.rand(1, 72, 100, 3, generator=g)  # not the latent's 64 × 96 pixels
    inpaint = torch.rand(1, 72, 100, 3, generator=g)
    mask = torch.rand(1, 72, 100, generator=g)
    vae = FluxStandInVAE()
    channels = 16 if given == "image-16-channels" else 33
    use_image = image if given.startswith("image") else None
    use_inpaint = inpaint if "inpaint" in given else None
    use_mask = 1.0 - mask.unsqueeze(1).unsqueeze(2) if "mask" in given else None  # as the node inverts it
    chosen = choices.ControlChoice("fun.safetensors", 0.7, use_image, vae, use_mask, channels - 16,
                                   inpaint_image=use_inpaint, fun=True)
    ours = control.control_latent(chosen, 8, 12)

    def fitted(picture):
        return comfy.utils.common_upscale(picture.movedim(-1, 1), 96, 64, "area", "center").movedim(1, -1)

    if channels == 16:
        expected = vae.encode(fitted(image))
    else:
        grey_inpaint = fitted(inpaint) if use_inpaint is not None else torch.ones(1, 64, 96, 3) * 0.5
        kept = None
        if use_mask is not None:
            kept = use_mask.view(1, -1, 72, 100).mean(dim=1, keepdim=True)
            scaled = comfy.utils.common_upscale(kept, 96, 64, "bilinear", "center")
            grey_inpaint = (grey_inpaint - 0.5) * scaled.movedim(1, -1).round() + 0.5
        inpaint_latent = vae.encode(grey_inpaint)
        mask_channel = (torch.zeros(1, 1, 8, 12) if kept is None
                        else comfy.utils.common_upscale(kept, 12, 8, "nearest", "center"))
        control_image = fitted(image) if use_image is not None else torch.ones(1, 64, 96, 3) * 0.5
        expected = torch.cat([vae.encode(control_image), mask_channel, inpaint_latent], dim=1)
    assert ours.shape == (1, channels, 8, 12)
    assert (ours - expected).abs().max() <= 1e-6


def sd35_controlnet_state(control_type: int) -> dict:
    """The smallest state dict ComfyUI's load_controlnet_sd35 builds a ControlNet from (width 64, no blocks; the
    weights it lacks are left as built), with ``control_type``: for its preprocess_image."""
    return {"control_type": torch.tensor(float(control_type)),
            "time_text_embed.text_embedder.linear_1.weight": torch.zeros(64, 2048)}


def test_the_node_reads_an_sd35_files_control_type(pack, tmp_path):
    """xDiT ControlNet's preprocess comes from the file's control_type, as load_controlnet_sd35 reads it."""
    from safetensors.torch import save_file

    from comfyui_xdit.nodes import control

    for control_type, expected in ((0, None), (1, "canny"), (2, "depth")):
        path = tmp_path / f"cn{control_type}.safetensors"
        save_file({"control_type": torch.tensor(float(control_type)), "x": torch.zeros(1)}, str(path))
        assert control.preprocess(str(path)) == expected
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    assert control.preprocess(str(tmp_path / "other.safetensors")) is None
    assert control.preprocess("sd3-controlnet-tiny") is None


def test_an_xlabs_controlnets_image_is_what_comfyuis_get_control_hands_it(pack):
    """Without a VAE (an XLabs ControlNet) ComfyUI's get_control resizes the image "nearest-exact" to 8× the latent
    and hands the pixels over: the node sends those pixels [1, 3, 8·h, 8·w]."""
    import comfy.controlnet
    from comfyui_xdit.nodes import choices, control

    image = torch.rand(1, 72, 100, 3, generator=torch.Generator().manual_seed(4))
    theirs = comfy.controlnet.ControlNet(None, extra_conds=[])  # load_controlnet_flux_xlabs_mistoline's: ratio 8
    theirs.control_model = kept = StandInControlModel()
    theirs.set_cond_hint(image.movedim(-1, 1), 0.7, (0.0, 1.0))
    theirs.model_sampling_current = SimpleNamespace(timestep=lambda t: t, calculate_input=lambda t, x: x)
    theirs.get_control(torch.zeros(1, 16, 8, 12), torch.tensor([0.5]), {"c_crossattn": torch.zeros(1, 4, 8)}, 1, {})
    chosen = choices.ControlChoice("flux.safetensors", 0.7, image, None, resize="nearest-exact", pixels=True)
    ours = control.control_latent(chosen, 8, 12)
    assert ours.shape == (1, 3, 64, 96)
    assert torch.equal(ours, kept.hint)


# ----------------------------------------------------------------------------------------------- Apply ControlNet
# ComfyUI's own Load ControlNet Model / Set Union ControlNet Type / Apply ControlNet (Advanced) before an xDiT
# sampler: the sampler finds each ControlNet's file in the prompt graph and sends what xDiT ControlNet would.


def applied_graph(strength: float = 0.6, end: float = 0.8):
    """A prompt graph with Load ControlNet Model → Set Union ControlNet Type → Apply ControlNet (Advanced) → (Flux
    Guidance on the positive side) → the xDiT Sampler, node 9."""
    return {
        "1": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "flux-union.safetensors"}},
        "2": {"class_type": "SetUnionControlNetType", "inputs": {"control_net": ["1", 0],
                                                                  "type": "canny/lineart/anime_lineart/mlsd"}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "a", "clip": ["0", 0]}},
        "4": {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["3", 0], "negative": ["3", 0], "control_net": ["2", 0], "image": ["5", 0], "vae": ["6", 0],
            "strength": strength, "start_percent": 0.0, "end_percent": end}},
        "7": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["4", 0], "guidance": 3.5}},
        "9": {"class_type": "XDiTSampler", "inputs": {"positive": ["7", 0], "negative": ["4", 1]}},
    }


def test_apply_controlnet_before_the_sampler_sends_what_xdit_controlnet_would(pack, tmp_path):
    """The ControlNet ComfyUI's own nodes attach (its image, VAE, strength, range, union type) and the file the
    graph's loader names: the same control as xDiT ControlNet given that file and those inputs."""
    import comfy.controlnet
    import folder_paths
    import nodes as comfy_nodes
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    from safetensors.torch import save_file

    from comfyui_xdit.nodes import choices, comfy_controls, control
    from xdit_backend.models import model_patch

    network = model_patch.network(model_patch.PatchSpec("flux-controlnet-tiny", 1.0), torch.device("cpu"),
                                  torch.float32)
    save_file(network.state_dict(), str(tmp_path / "flux-union.safetensors"))
    folder_paths.add_model_folder_path("controlnet", str(tmp_path))
    import comfy.latent_formats

    # as load_controlnet_flux_instantx makes it, without the network (the file is what is sent)
    loaded = comfy.controlnet.ControlNet(None, compression_ratio=1, latent_format=comfy.latent_formats.Flux())
    loaded.control_model_wrapped = None  # what copy() reads of a loaded one
    typed = SetUnionControlNetType().set_controlnet_type(loaded, "canny/lineart/anime_lineart/mlsd")[0]
    image, vae = torch.rand(1, 48, 64, 3, generator=torch.Generator().manual_seed(2)), StandInVAE()
    prompt = [[torch.zeros(1, 8, 64), {}]]
    positive, negative = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(prompt, prompt, typed, image, 0.6,
                                                                                 0.0, 0.8, vae=vae)
    positive = [[positive[0][0], {**positive[0][1], "guidance": 3.5}]]  # FluxGuidance keeps the control
    sent = comfy_controls.choices(positive, negative, applied_graph(), "9")
    node = control.XDiTControlNet.execute(choices.ModelChoice("flux-tiny"), "flux-union.safetensors", 0.6, 0.0, 0.8,
                                          vae=vae, image=image, union_type="canny/lineart/anime_lineart/mlsd")
    assert sent == list(node.result[0].controls)  # path, strength, range, type, resize, preprocess, pixels
    assert torch.equal(sent[0].image, image) and sent[0].vae is vae


def test_controls_the_sampler_cannot_send_as_comfyui_runs_them_are_refused(pack, tmp_path):
    """The old Apply ControlNet controls the positive side only: refused (the backend controls every row); at
    strength 0 ComfyUI attaches nothing and neither does the graph walk."""
    import comfy.controlnet
    import nodes as comfy_nodes

    from comfyui_xdit.nodes import comfy_controls
    from comfyui_xdit.nodes.translate import TranslationError

    prompt = [[torch.zeros(1, 8, 64), {}]]
    image = torch.rand(1, 48, 64, 3)
    loaded = comfy.controlnet.ControlNet(None)
    loaded.control_model_wrapped = None
    positive = comfy_nodes.ControlNetApply().apply_controlnet(prompt, loaded, image, 0.5)[0]
    graph = {"4": {"class_type": "ControlNetApply", "inputs": {"conditioning": ["3", 0], "control_net": ["1", 0],
                                                               "image": ["5", 0], "strength": 0.5}},
             "9": {"class_type": "XDiTSampler", "inputs": {"positive": ["4", 0], "negative": ["3", 0]}}}
    with pytest.raises(TranslationError, match="the positive and negative prompts carry different ControlNets"):
        comfy_controls.choices(positive, prompt, graph, "9")
    assert comfy_controls.apply_nodes(applied_graph(strength=0), "9", "positive") == []
