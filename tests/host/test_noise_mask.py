"""A latent's noise mask (Set Latent Noise Mask: inpainting with any model) on the xDiT Sampler gives KSampler's
latent on ComfyUI's own model of the same file: the backend resizes the mask as ComfyUI does and blends each model
call as KSampler does (sampling/inpaint.py), under every layout, PipeFusion included. In process (comfy.sample, the
nodes' own translation) and through the real ComfyUI over HTTP."""

import json

import pytest

from host.conftest import COMFYUI_DIR

pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason="needs a ComfyUI checkout: set COMFYUI_DIR "
                                "(and run with a Python that has ComfyUI's requirements) to test the pack in ComfyUI")


def xdit_sampler(client, path: str, positive, negative, latent: dict, seed: int, steps: int, cfg: float,
                 sampler: str, layout: dict):
    """The xDiT Sampler's request for these ComfyUI values (the nodes' translation), sent to ``client``."""
    from host.test_xdit_model import pack_module, sampler_tensors
    from xdit_backend.models import registry

    translate = pack_module("translate")
    geometry, samples = translate.latent(latent, registry.spec(path))
    tensors = {"latent": samples, "noise_mask": translate.noise_mask(latent),
               **sampler_tensors(path, positive, negative, geometry.batch)}
    request = {"model": path, "dtype": "float32", "width": geometry.width, "height": geometry.height,
               "batch": geometry.batch, "steps": steps, "seed": seed, "cfg": cfg, "sampler": sampler,
               "scheduler": "simple", "parallel": layout}
    result, info = client.sample(request, {k: v for k, v in tensors.items() if v is not None})
    return translate.to_comfyui(result, registry.spec(path)), info


def prompts(seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [[[torch.randn(1, 8, 64, generator=generator), {"pooled_output": torch.randn(1, 32, generator=generator)}]]
            for _ in range(2)]


@pytest.mark.parametrize("world, layout, sampler", [
    (1, {}, "euler"), (2, {"ulysses": 2}, "euler"), (2, {"cfg": 2}, "dpmpp_2m_sde"), (2, {"dp": 2}, "euler"),
    (2, {"pipefusion": 2, "warmup_steps": 4}, "euler"), (2, {"pipefusion": 2, "warmup_steps": 1}, "euler"),
], ids=["world1", "ulysses", "cfg-sde", "dp", "pipefusion-warm", "pipefusion-stale"])
def test_a_noise_mask_gives_ksamplers_latent(backend, pack, tmp_path, world, layout, sampler):
    """A pixel-size mask (left half to make, a soft band, the rest kept) on an encoded-image latent of batch 2
    (dp splits it): the same latent as KSampler on ComfyUI's own model, ≤ 1e-4 relative; the kept region is the
    input latent. PipeFusion with stale K/V is not exact, so there the xDiT Sampler's result is compared with the
    same layout without the mask's kept region changing: the kept region must still be the input latent."""
    import comfy.sample
    import comfy.sd
    import torch

    from host.conftest import tiny_sd3_file

    path = tmp_path / "tiny-sd3.safetensors"
    tiny_sd3_file(path)
    generator = torch.Generator().manual_seed(4)
    image = torch.randn(2, 16, 8, 8, generator=generator)
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., :32] = 1.0
    mask[..., 32:40] = 0.5
    latent = {"samples": image, "noise_mask": mask}
    positive, negative = prompts(5)
    ours, _ = xdit_sampler(backend(world), str(path), positive, negative, latent, 9, 4, 4.0, sampler, layout)
    kept = ours[..., 5:] - image[..., 5:]  # latent columns 5… are kept (mask 0 from pixel 40)
    assert kept.abs().max() <= 1e-4 * image.abs().max()
    if layout.get("warmup_steps") == 1:
        return  # stale K/V: not KSampler's latent by design (the kept region above is exact all the same)
    own = comfy.sd.load_diffusion_model(str(path))
    noise = comfy.sample.prepare_noise(image, 9)
    theirs = comfy.sample.sample(own, noise, 4, 4.0, sampler, "simple", positive, negative, image, noise_mask=mask,
                                 seed=9)
    relative = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert relative <= 1e-4, relative
    unmasked, _ = xdit_sampler(backend(world), str(path), positive, negative, {"samples": image}, 9, 4, 4.0, sampler,
                               layout)
    assert (unmasked - ours).abs().max() > 1e-2  # the mask did something


def test_set_latent_noise_mask_in_the_real_comfyui(host):
    """Through ComfyUI's HTTP API: SolidMask → Set Latent Noise Mask → KSampler on ComfyUI's model and the xDiT
    Sampler (ulysses=2) on the same file, the same latent."""
    from host.test_xdit_model import assert_same, models

    prompt = {**models("ulysses"),
              "mask": {"class_type": "SolidMask", "inputs": {"value": 0.6, "width": 64, "height": 64}},
              "masked": {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["empty", 0], "mask": ["mask", 0]}}}
    common = {"seed": 11, "steps": 4, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
              "positive": ["cond", 0], "negative": ["uncond", 0], "latent_image": ["masked", 0]}
    prompt["ks"] = {"class_type": "KSampler", "inputs": {**common, "model": ["own", 0]}}
    prompt["xs"] = {"class_type": "XDiTSampler", "inputs": {**common, "model": ["load", 0],
                                                              "parallel": ["parallel", 0]}}
    for node in ("ks", "xs"):
        prompt[f"save_{node}"] = {"class_type": "SaveLatent", "inputs": {"samples": [node, 0],
                                                                         "filename_prefix": f"latents/mask-{node}"}}
    prompt_id = host.queue(json.loads(json.dumps(prompt)))
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    assert_same(host.latest_latent("mask-ks"), host.latest_latent("mask-xs"))


def test_the_mask_is_resized_as_comfyuis_reshape_mask(pack):
    """Image masks of other sizes and batches, and video masks given per frame or as one 5-D tensor."""
    import comfy.utils
    import torch

    from xdit_backend.sampling.inpaint import prepare_mask

    generator = torch.Generator().manual_seed(1)
    cases = [((1, 64, 64), (2, 16, 8, 8)), ((2, 1, 40, 24), (2, 16, 5, 3)), ((3, 1, 8, 8), (2, 4, 8, 8)),
             ((5, 1, 16, 16), (1, 16, 5, 8, 8)), ((1, 1, 3, 16, 16), (2, 16, 5, 8, 8))]
    for mask_shape, latent_shape in cases:
        mask = torch.rand(mask_shape, generator=generator)
        assert torch.equal(prepare_mask(mask, latent_shape), comfy.utils.reshape_mask(mask, latent_shape)), mask_shape
