"""Z-Image's Fun ControlNet (models/z_image_controlnet.py): each layout of its files (1.0: plain control refiners, 16
channels; 2.x: control refiners beside the model's, 33 channels; a 15-layer 2.1 file ComfyUI marks ``broken``) gives
the model output ComfyUI's ZImageControlPatch gives, written here as that patch runs (its ``temp_data`` walk over
the noise_refiner and double_block patch calls of comfy/ldm/lumina/model.py, Comfy-Org/ComfyUI 08f68f0 / 617048a;
the shared snapshot predates Z-Image), and runs split as serial from a file. The built-in's layouts:
test_controlnet.py's table."""

import pytest
import torch
from parity import bound
from safetensors.torch import save_file

from xdit_backend.models import controlnet, model_patch, z_image_controlnet
from xdit_backend.models.builtins import BUILTINS
from xdit_backend.models.z_image_controlnet import ZImageFunControlNet, step
from xdit_backend.service.reference import serial_latent

TINY = "z-image-fun-controlnet-tiny"
REQUEST = {"model": "z-image-tiny", "width": 80, "height": 48, "steps": 3, "seed": 13, "cfg": 2.5, "batch": 1,
           "dtype": "float32"}


def comfyui_output(model, network, hint, strength, x, sigma, context):
    """The model output as ComfyUI computes it with one ZImageControlPatch: [caption; image] through the main
    blocks, the patch called after every noise refiner and main block with its state (layer index, (residual,
    control tokens)), advanced and reset as the patch does it."""
    t = model.transformer
    inputs = model.step_inputs(x.shape, sigma, {"context": context}, None)
    adaln, freqs, caption_freqs = inputs["adaln"], inputs["image_freqs"][None], inputs["caption_freqs"]
    image = model.embed(x, None, inputs, None)  # [1, n, D]
    n = image.shape[1]
    image = torch.cat([image, t.x_pad_token.expand(1, -n % 32, -1)], dim=1)
    caption = model.embed_text(inputs)
    for block in t.context_refiner:
        caption = block(caption, None, caption_freqs)
    layers = len(network.control_layers)
    every = round(30 / layers)  # ComfyUI's, for any model

    def refiner_block(index, control, image_in):  # ZImage_Control.forward_noise_refiner_block
        if not network.refiner_control:
            return None, control
        if not network.broken:
            return step(network.control_noise_refiner[index], control, image_in, freqs[:, :n], adaln)
        if index == 0:
            return step(network.control_layers[0], control, image_in, freqs[:, :n], adaln)
        out = None
        for block in network.control_layers[1:]:
            residual, control = step(block, control, image_in, freqs[:, :n], adaln)
            out = residual if out is None else out
        return out, control

    state, embedded = None, image
    for index, block in enumerate(t.noise_refiner):
        image = block(image, None, freqs, adaln)
        if index / every > layers - 1:
            state = None
            continue
        if state is None or state[0] > index // every:
            state = (-3, (None, network(hint, freqs[:, :n], adaln)))
        state = (state[0] + 1, refiner_block(index, state[1][1], embedded[:, :n]))
        if state[1][0] is not None:
            image[:, :n] += state[1][0] * strength
    unified = torch.cat([caption, image], dim=1)
    unified_freqs, text = torch.cat([caption_freqs, freqs], dim=1), caption.shape[1]
    main_input = unified
    for index, block in enumerate(t.layers):
        unified = block(unified, None, unified_freqs, adaln)
        if index / every > layers - 1:
            state = None
            continue
        if state is None or state[0] > index // every:
            state = (-1, (None, network(hint, freqs[:, :n], adaln)))
        while state[0] < index // every and state[0] + 1 < layers:
            state = (state[0] + 1, step(network.control_layers[state[0] + 1], state[1][1],
                                        main_input[:, text:text + n], freqs[:, :n], adaln))
        if index / every == state[0]:
            unified[:, text:text + n] += state[1][0] * strength
            if state[0] + 1 == layers:
                state = None
    out = t.all_final_layer["2-1"](unified[:, text:text + n], c=adaln)
    return model.unpatchify(out, x.shape)


def file_of(tmp_path, refiner_control: bool, layers: int, channels: int, broken: bool = False,
            refiners: int = 1) -> str:
    """A Fun ControlNet file for z-image-tiny (``refiners``: its noise refiners'; random weights, its zero-initialised
    projections drawn too)."""
    config = BUILTINS["z-image-tiny"].config
    network = controlnet.drawn(23, lambda: ZImageFunControlNet(
        config["dim"], config["n_heads"], layers, channels, refiner_control, refiners),
        lambda made: [getattr(b, name) for b in (*made.control_layers, *made.control_noise_refiner)
                      for name in ("after_proj", "before_proj") if hasattr(b, name)])
    state = network.state_dict()
    if broken:  # ComfyUI: a 15-layer file whose first refiner output is all zeros
        state["control_noise_refiner.0.after_proj.weight"] = torch.zeros_like(
            state["control_noise_refiner.0.after_proj.weight"])
    path = tmp_path / "fun.safetensors"
    save_file(state, str(path))
    return str(path)


# the released layouts: (control refiners, control layers, input channels, broken)
LAYOUTS = {"1.0": (False, 6, 16, False), "2.0": (True, 15, 33, False), "2.1 lite": (True, 3, 33, False),
           "2.1 broken": (True, 15, 33, True)}


def deep_model():
    """z-image-tiny with Z-Image's 2 noise refiners and 30 main blocks (ComfyUI's patch counts on both), drawn from a
    seed."""
    from diffusers import ZImageTransformer2DModel

    from xdit_backend.models.z_image import ZImageModel, ZImageSpec

    config = {**BUILTINS["z-image-tiny"].config, "n_layers": 30, "n_refiner_layers": 2}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(17)
        transformer = ZImageTransformer2DModel(**config)
        for parameter in transformer.parameters():
            torch.nn.init.normal_(parameter, std=0.1)
    return ZImageModel(transformer, "z-image-30-blocks", ZImageSpec.from_config(config))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_model_output_is_comfyuis(tmp_path, layout):
    refiner_control, layers, channels, broken = LAYOUTS[layout]
    path = file_of(tmp_path, refiner_control, layers, channels, broken, refiners=2)
    model = deep_model()
    network = model_patch.network(model_patch.PatchSpec(path, 0.8), torch.device("cpu"), torch.float32)
    assert (network.refiner_control, network.broken, len(network.control_layers)) == (refiner_control, broken, layers)
    g = torch.Generator().manual_seed(2)
    x, context = torch.randn(1, 16, 6, 10, generator=g), torch.randn(1, 9, 64, generator=g)  # 15 tokens, 17 pads
    control = torch.randn(1, channels, 6, 10, generator=g)
    sigma = torch.tensor([0.6])
    spec = model_patch.PatchSpec(path, 0.8)
    with torch.no_grad():
        model.model_patches = [model_patch.applied(spec, network, control, 0, (6, 10), model,
                                                   model.spec.model_sampling(None))]
        ours = model.output(x, sigma, {"context": context}, None)
        model.model_patches = []
        plain = model.output(x, sigma, {"context": context}, None)
        hint = z_image_controlnet.hint(network, control)
        expected = comfyui_output(model, network, hint, 0.8, x, sigma, context)
    assert (ours - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert (expected - plain).abs().max() > 1e-2


def test_control_layers_go_after_the_main_blocks_comfyui_puts_them_after():
    """ZImageControlPatch: layer k after main block k · round(30 / layers) (3, 6 and 15 layers: the released files)."""
    network = ZImageFunControlNet(8, 1, 1, 16, False)  # the placement reads the layer count only
    for layers in (3, 6, 15):
        network.control_layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(layers))
        every = round(30 / layers)
        expected = {block: block // every for block in range(30) if block % every == 0 and block // every < layers}
        placed = {block: network.layer_at(block) for block in range(30)}
        assert {block: layer for block, layer in placed.items() if layer is not None} == expected


@pytest.mark.parametrize("layout", ["1.0", "2.1 broken"])
def test_a_file_runs_split_as_serial(tmp_path, backend2, layout):
    """A file of each refiner layout (a broken one runs its control layers whole first, then split) under ulysses=2,
    with its control latent sent; and the built-in written to a file is the built-in."""
    refiner_control, layers, channels, broken = LAYOUTS[layout]
    path = file_of(tmp_path, refiner_control, layers, channels, broken)
    tensors = {"control_0": torch.randn(1, channels, 6, 10, generator=torch.Generator().manual_seed(8))}
    fields = {**REQUEST, "controls": [{"path": path, "strength": 0.9}]}
    expected = serial_latent(fields, tensors)
    result, _ = backend2.sample({**fields, "parallel": {"ulysses": 2}}, tensors)
    assert (result["samples"] - expected).abs().max() <= bound(expected)


def test_the_built_in_written_to_a_file_is_the_built_in(tmp_path):
    network = model_patch.network(model_patch.PatchSpec(TINY, 1.0), torch.device("cpu"), torch.float32)
    path = tmp_path / "fun.safetensors"
    save_file(network.state_dict(), str(path))
    tensors = {"control_0": torch.randn(1, 33, 6, 10, generator=torch.Generator().manual_seed(5))}
    from_file = serial_latent({**REQUEST, "controls": [{"path": str(path), "strength": 0.7}]}, tensors)
    built_in = serial_latent({**REQUEST, "controls": [{"path": TINY, "strength": 0.7}]}, tensors)
    assert torch.equal(from_file, built_in)


def test_requests_the_fun_controlnet_cannot_serve_are_refused_with_the_reason():
    """Under PipeFusion (its control layers take the whole image's tokens at the main blocks' input), and on another
    family's model."""
    from xdit_backend.models import registry
    from xdit_backend.service.request import RequestError, SampleRequest
    from xdit_backend.wire.protocol import Message

    controls = [{"path": TINY, "strength": 0.7}]
    request = SampleRequest.parse(Message("sample", {**REQUEST, "controls": controls, "parallel": {"pipefusion": 2}}))
    with pytest.raises(RequestError, match="with pipefusion=2: a ControlNet runs a transformer of its own"):
        request.check_model(registry.spec("z-image-tiny"))
    flux = SampleRequest.parse(Message("sample", {**REQUEST, "model": "flux-tiny", "controls": controls}))
    with pytest.raises(RequestError, match="is a z_image ControlNet, but flux-tiny is a flux model"):
        flux.check_model(registry.spec("flux-tiny"))
