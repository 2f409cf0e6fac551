"""The xDiT Model in the real ComfyUI (issue 26): ComfyUI's own samplers, guiders, schedulers, model-sampling
nodes, CFG functions and conditioning nodes run on a MODEL whose transformer is the backend's, and give the
latent they give on ComfyUI's own model of the same file (UNETLoader), in every layout of the host's two-rank
backend. What acts inside the forward is refused by name."""

import json

import pytest

from host.conftest import COMFYUI_DIR

pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason="needs a ComfyUI checkout: set COMFYUI_DIR "
                                "(and run with a Python that has ComfyUI's requirements) to test the pack in ComfyUI")

LAYOUTS = {"ulysses": {"ulysses": 2}, "ring": {"ring": 2}, "cfg": {"cfg_parallel": True}, "dp": {"dp": 2}}
PIPEFUSION = {"pipefusion": 2, "warmup_steps": 1}  # stale K/V after the first step: not ComfyUI's own latent


def parallel_node(degrees: dict) -> dict:
    inputs = {"gpus": "", "auto": False, "ulysses": 1, "ring": 1, "pipefusion": 1, "num_pipeline_patch": 0,
              "warmup_steps": 1, "cfg_parallel": False, "dp": 1, **degrees}
    return {"class_type": "XDiTParallelConfig", "inputs": inputs}


def models(layout: str = "ulysses", size: int = 64) -> dict:
    """Both models of the tiny SD3 file: ``own`` (ComfyUI's UNETLoader) and ``xmodel`` (the xDiT Model), and
    the stand-in prompts ``cond`` and ``uncond``."""
    return {
        "cond": {"class_type": "XDiTStandInConditioning",
                 "inputs": {"seed": 5, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
        "uncond": {"class_type": "XDiTStandInConditioning",
                   "inputs": {"seed": 6, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
        "empty": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
        "own": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny-sd3.safetensors", "weight_dtype": "default"}},
        "load": {"class_type": "XDiTLoadDiffusionModel", "inputs": {"model_name": "tiny-sd3.safetensors",
                                                                    "weight_dtype": "fp32"}},
        "parallel": parallel_node(PIPEFUSION if layout == "pipefusion" else LAYOUTS[layout]),
        "xmodel": {"class_type": "XDiTModel", "inputs": {"model": ["load", 0], "parallel": ["parallel", 0]}},
    }


def on_both(host, prompt: dict, tail: dict, out: str, tag: str) -> tuple:
    """Run ``tail`` (nodes whose model input is ["MODEL", 0]) once on each model; the latents of node ``out``."""
    latents = []
    for model in ("own", "xmodel"):
        nodes = json.loads(json.dumps(tail).replace('["MODEL", 0]', f'["{model}", 0]'))
        prefix = f"latents/xmodel-{tag}-{model}"
        full = {**prompt, **nodes, "save": {"class_type": "SaveLatent",
                                            "inputs": {"samples": [out, 0], "filename_prefix": prefix}}}
        prompt_id = host.queue(full)
        assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
        latents.append(host.latest_latent(f"xmodel-{tag}-{model}"))
    return tuple(latents)


def assert_same(own, xdit) -> None:
    relative = ((own - xdit).abs().max() / own.abs().max()).item()
    assert relative <= 1e-4, relative


def ksampler(model: str = '["MODEL", 0]', positive="cond", cfg: float = 4.0, sampler: str = "euler",
             scheduler: str = "simple", steps: int = 4) -> dict:
    return {"ks": {"class_type": "KSampler", "inputs": {
        "model": json.loads(model), "seed": 11, "steps": steps, "cfg": cfg, "sampler_name": sampler,
        "scheduler": scheduler, "denoise": 1.0, "positive": [positive, 0], "negative": ["uncond", 0],
        "latent_image": ["empty", 0]}}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ksampler_on_the_xdit_model_gives_ksamplers_latent_on_comfyuis_own_model(host, layout):
    assert_same(*on_both(host, models(layout), ksampler(), "ks", f"ksampler-{layout}"))


def test_sampler_custom_advanced_with_a_guider_sampler_and_scheduler_the_backend_never_ported(host):
    tail = {"noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 3}},
            "guider": {"class_type": "CFGGuider", "inputs": {"model": ["MODEL", 0], "positive": ["cond", 0],
                                                             "negative": ["uncond", 0], "cfg": 3.0}},
            "select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "res_multistep"}},
            "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["MODEL", 0], "scheduler": "kl_optimal",
                                                                  "steps": 4, "denoise": 1.0}},
            "custom": {"class_type": "SamplerCustomAdvanced", "inputs": {
                "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["sigmas", 0],
                "latent_image": ["empty", 0]}}}
    assert_same(*on_both(host, models("cfg"), tail, "custom", "custom-advanced"))


def test_regional_prompts_with_two_areas_and_a_timestep_range(host):
    """ConditioningSetArea twice (chunks of two sizes, one an odd number of latent cells a side, which the
    backend pads to the patch as ComfyUI's model does) combined with a prompt limited to the first half of the
    schedule by ConditioningSetTimestepRange."""
    tail = {"left": {"class_type": "ConditioningSetArea", "inputs": {
                "conditioning": ["uncond", 0], "width": 64, "height": 128, "x": 0, "y": 0, "strength": 1.0}},
            "right": {"class_type": "ConditioningSetArea", "inputs": {
                "conditioning": ["cond", 0], "width": 72, "height": 64, "x": 56, "y": 32, "strength": 0.8}},
            "early": {"class_type": "ConditioningSetTimestepRange", "inputs": {
                "conditioning": ["cond", 0], "start": 0.0, "end": 0.5}},
            "areas": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["left", 0],
                                                                      "conditioning_2": ["right", 0]}},
            "all": {"class_type": "ConditioningCombine", "inputs": {"conditioning_1": ["areas", 0],
                                                                    "conditioning_2": ["early", 0]}},
            **ksampler(positive="all")}
    assert_same(*on_both(host, models("ulysses", size=128), tail, "ks", "areas"))


@pytest.mark.parametrize("guider", ["BasicGuider", "DualCFGGuider", "PerpNegGuider"])
def test_comfyuis_other_guiders_run_on_the_xdit_model(host, guider):
    inputs = {"BasicGuider": {"conditioning": ["cond", 0]},
              "DualCFGGuider": {"cond1": ["cond", 0], "cond2": ["other", 0], "negative": ["uncond", 0],
                                "cfg_conds": 3.0, "cfg_cond2_negative": 2.0, "style": "regular"},
              "PerpNegGuider": {"positive": ["cond", 0], "negative": ["uncond", 0], "empty_conditioning": ["other", 0],
                                "cfg": 3.0, "neg_scale": 1.5}}[guider]
    tail = {"other": {"class_type": "XDiTStandInConditioning",
                      "inputs": {"seed": 7, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
            "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": 3}},
            "guider": {"class_type": guider, "inputs": {"model": ["MODEL", 0], **inputs}},
            "select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler_ancestral"}},
            "sigmas": {"class_type": "BasicScheduler", "inputs": {"model": ["MODEL", 0], "scheduler": "normal",
                                                                  "steps": 3, "denoise": 1.0}},
            "custom": {"class_type": "SamplerCustomAdvanced", "inputs": {
                "noise": ["noise", 0], "guider": ["guider", 0], "sampler": ["select", 0], "sigmas": ["sigmas", 0],
                "latent_image": ["empty", 0]}}}
    assert_same(*on_both(host, models("ring"), tail, "custom", guider))


def test_model_sampling_and_cfg_function_nodes_run_in_comfyui_on_the_backends_calls(host):
    tail = {"shifted": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["MODEL", 0], "shift": 6.0}},
            "zero_star": {"class_type": "CFGZeroStar", "inputs": {"model": ["shifted", 0]}},
            **ksampler(model='["zero_star", 0]', sampler="dpmpp_2m", scheduler="beta")}
    assert_same(*on_both(host, models("cfg"), tail, "ks", "shift-zero-star"))


@pytest.mark.parametrize("layout", ["ulysses", "pipefusion"])
def test_the_xdit_models_ksampler_equals_the_xdit_sampler(host, layout):
    """Also under PipeFusion: the xDiT Model's calls are the steps of KSampler's run, each a PipeFusion step whose
    patches see the K/V the call before left, as the xDiT Sampler's patches see them."""
    prompt = {**models(layout), **ksampler(model='["xmodel", 0]'),
              "xs": {"class_type": "XDiTSampler", "inputs": {
                  "model": ["load", 0], "parallel": ["parallel", 0], "seed": 11, "steps": 4, "cfg": 4.0,
                  "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0],
                  "negative": ["uncond", 0], "latent_image": ["empty", 0]}},
              "save_ks": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0],
                                                                 "filename_prefix": f"latents/xmodel-vs-ks-{layout}"}},
              "save_xs": {"class_type": "SaveLatent", "inputs": {"samples": ["xs", 0],
                                                                 "filename_prefix": f"latents/xmodel-vs-xs-{layout}"}}}
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    assert_same(host.latest_latent(f"xmodel-vs-ks-{layout}"), host.latest_latent(f"xmodel-vs-xs-{layout}"))


def test_a_lora_through_comfyuis_loader_is_refused_naming_the_xdit_lora_node(host):
    import torch
    from safetensors.torch import save_file

    loras = host.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 128),
               "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(128, 4)},
              str(loras / "tiny-sd3-lora.safetensors"))
    prompt = {**models("ulysses"),
              "lora": {"class_type": "LoraLoaderModelOnly", "inputs": {"model": ["xmodel", 0],
                                                                       "lora_name": "tiny-sd3-lora.safetensors",
                                                                       "strength_model": 1.0}},
              **ksampler(model='["lora", 0]'),
              "save": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "latents/lora"}}}
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "error"
    message = host.error_of(prompt_id)["exception_message"]
    assert "chain xDiT LoRA between xDiT Load Diffusion Model and xDiT Model" in message, message


def test_a_patch_inside_the_forward_is_refused_by_name(host):
    prompt = {**models("ulysses"),
              "pag": {"class_type": "PerturbedAttentionGuidance", "inputs": {"model": ["xmodel", 0], "scale": 3.0}},
              **ksampler(model='["pag", 0]'),
              "save": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "latents/pag"}}}
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "error"
    message = host.error_of(prompt_id)["exception_message"]
    assert "replaced attention or block" in message and "perturbed_attention" in message, message


def test_every_sampler_and_scheduler_comfyui_offers_runs_on_the_xdit_model(host):
    """Every name in KSampler's sampler and scheduler lists (as this ComfyUI offers them: /object_info), each in a
    KSampler of one prompt per model, three steps: the same latents on both models."""
    info = host.get("/object_info/KSampler")["KSampler"]["input"]["required"]
    samplers, schedulers = info["sampler_name"][0], info["scheduler"][0]
    runs = [(name, "simple") for name in samplers] + [("euler", name) for name in schedulers]
    tail = {}
    for i, (sampler, scheduler) in enumerate(runs):
        node = ksampler(sampler=sampler, scheduler=scheduler, steps=3)["ks"]
        tail[f"ks{i}"] = node
        tail[f"save{i}"] = {"class_type": "SaveLatent", "inputs": {"samples": [f"ks{i}", 0],
                                                                   "filename_prefix": f"latents/every-MODEL-{i}-"}}
    latents = {}
    for model in ("own", "xmodel"):
        nodes = json.loads(json.dumps(tail).replace('["MODEL", 0]', f'["{model}", 0]').replace("MODEL-", f"{model}-"))
        prompt_id = host.queue({**models("cfg"), **nodes})
        assert host.follow(prompt_id, timeout=600)[0] == "success", host.why(prompt_id)
        latents[model] = [host.latest_latent(f"every-{model}-{i}-") for i in range(len(runs))]
    differ = [f"{run}: {((a - b).abs().max() / a.abs().max()).item():.3g}"
              for run, a, b in zip(runs, latents["own"], latents["xmodel"])
              if ((a - b).abs().max() / a.abs().max()).item() > 1e-4]
    assert not differ and len(runs) > 40, differ


def test_comfyuis_progress_and_cancel_work_and_the_backend_counts_the_calls(host):
    """ComfyUI's progress bar moves with its own sampler's steps; its Cancel stops the run within a call (the
    stand-in's client cancels the running call; ComfyUI stops between calls); the backend counts the calls it
    ran (status) and keeps serving."""
    import time

    from xdit_backend.client import Client

    client = Client(host.socket)
    prompt = {**models("ulysses"), **ksampler(model='["xmodel", 0]', steps=2000),
              "save": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0], "filename_prefix": "latents/stop"}}}
    seen = []

    def interrupt_at_the_third_step(data):
        seen.append(data)
        if len(seen) == 3:
            host.post("/interrupt", {})

    before = sum(client.status()["evaluations"].values()) if client.hello_or_none() else 0
    started = time.monotonic()
    outcome, progress = host.follow(host.queue(prompt), on_progress=interrupt_at_the_third_step)
    assert outcome == "interrupted" and 3 <= progress[-1][0] < 2000
    assert time.monotonic() - started < 120
    counts = client.status()["evaluations"]
    ran = sum(counts.values()) - before
    assert 3 <= ran < 50, counts  # a few calls past the interrupt at most, never the 2000 steps
    prompt["ks"]["inputs"]["steps"] = 2
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)


def model_node(class_type: str, **inputs) -> dict:
    return {"patched": {"class_type": class_type, "inputs": {"model": ["MODEL", 0], **inputs}},
            **ksampler(model='["patched", 0]', steps=3)}


def conditioning_node(class_type: str, extra: dict | None = None, **inputs) -> dict:
    return {**(extra or {}), "conditioned": {"class_type": class_type, "inputs": inputs},
            **ksampler(positive="conditioned", steps=3)}


SOLID = {"solid": {"class_type": "SolidMask", "inputs": {"value": 0.7, "width": 32, "height": 64}}}
MORE_NODES = {
    "KSamplerAdvanced": {"ks": {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["MODEL", 0], "add_noise": "enable", "noise_seed": 11, "steps": 6, "cfg": 4.0,
        "sampler_name": "heun", "scheduler": "karras", "positive": ["cond", 0], "negative": ["uncond", 0],
        "latent_image": ["empty", 0], "start_at_step": 1, "end_at_step": 4, "return_with_leftover_noise": "enable"}}},
    "SamplerCustom": {"select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_3m_sde"}},
                      "sigmas": {"class_type": "BasicScheduler", "inputs": {
                          "model": ["MODEL", 0], "scheduler": "linear_quadratic", "steps": 3, "denoise": 1.0}},
                      "ks": {"class_type": "SamplerCustom", "inputs": {
                          "model": ["MODEL", 0], "add_noise": True, "noise_seed": 4, "cfg": 3.5,
                          "positive": ["cond", 0], "negative": ["uncond", 0], "sampler": ["select", 0],
                          "sigmas": ["sigmas", 0], "latent_image": ["empty", 0]}}},
    "ModelSamplingAuraFlow": model_node("ModelSamplingAuraFlow", shift=1.73),
    "ModelSamplingDiscrete": model_node("ModelSamplingDiscrete", sampling="v_prediction", zsnr=False),
    "CFGNorm": model_node("CFGNorm", strength=0.8),
    "RescaleCFG": model_node("RescaleCFG", multiplier=0.7),
    "APG": model_node("APG", eta=1.0, norm_threshold=5.0, momentum=-0.5),
    "Mahiro": model_node("Mahiro"),
    "ConditioningSetAreaPercentage": conditioning_node("ConditioningSetAreaPercentage", conditioning=["cond", 0],
                                                      width=0.5, height=0.75, x=0.25, y=0.0, strength=1.2),
    "ConditioningSetMask": conditioning_node("ConditioningSetMask", SOLID, conditioning=["cond", 0],
                                            mask=["solid", 0], strength=1.0, set_cond_area="default"),
    "ConditioningConcat": conditioning_node("ConditioningConcat", conditioning_to=["cond", 0],
                                           conditioning_from=["uncond", 0]),
    "ConditioningAverage": conditioning_node("ConditioningAverage", conditioning_to=["cond", 0],
                                            conditioning_from=["uncond", 0], conditioning_to_strength=0.3),
    "ConditioningZeroOut": conditioning_node("ConditioningZeroOut", conditioning=["cond", 0]),
}


@pytest.mark.parametrize("name", list(MORE_NODES))
def test_more_samplers_model_patches_and_conditioning_nodes_run_as_on_comfyuis_model(host, name):
    assert_same(*on_both(host, models("cfg"), MORE_NODES[name], "ks", f"more-{name}"))


def test_the_step_cache_node_on_the_xdit_model_gives_the_xdit_samplers_cached_latent(host):
    """xDiT Step Cache before the xDiT Model: ComfyUI's KSampler runs the loop, the backend keeps the run's cache
    across its calls and skips the same steps as the xDiT Sampler with the same cache (same latent)."""
    prompt = {**models("cfg"),
              "cached": {"class_type": "XDiTStepCache", "inputs": {"model": ["load", 0], "cache": "fbcache",
                                                                   "threshold": 0.5, "start": 1, "end": 1}},
              "xcached": {"class_type": "XDiTModel", "inputs": {"model": ["cached", 0], "parallel": ["parallel", 0]}},
              **ksampler(model='["xcached", 0]', steps=8),
              "xs": {"class_type": "XDiTSampler", "inputs": {
                  "model": ["cached", 0], "parallel": ["parallel", 0], "seed": 11, "steps": 8, "cfg": 4.0,
                  "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0],
                  "negative": ["uncond", 0], "latent_image": ["empty", 0]}},
              "save_ks": {"class_type": "SaveLatent", "inputs": {"samples": ["ks", 0],
                                                                 "filename_prefix": "latents/cached-ks"}},
              "save_xs": {"class_type": "SaveLatent", "inputs": {"samples": ["xs", 0],
                                                                 "filename_prefix": "latents/cached-xs"}},
              "plain": {"class_type": "XDiTSampler", "inputs": {
                  "model": ["load", 0], "parallel": ["parallel", 0], "seed": 11, "steps": 8, "cfg": 4.0,
                  "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0],
                  "negative": ["uncond", 0], "latent_image": ["empty", 0]}},
              "save_plain": {"class_type": "SaveLatent", "inputs": {"samples": ["plain", 0],
                                                                    "filename_prefix": "latents/cached-plain"}}}
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    cached = host.latest_latent("cached-ks")
    assert_same(cached, host.latest_latent("cached-xs"))
    assert (cached - host.latest_latent("cached-plain")).abs().max() > 1e-4  # some steps were reused


# ----------------------------------------------------------------------------------------------- in process
# ComfyUI's own model of a tiny file (comfy.sample.sample: KSampler's code) against the xDiT Model of the same file
# whose calls go to the session's one- or two-rank backend.


def comfyuis_model(state_dict: dict, **sizes):
    """ComfyUI's own model of a tiny file as its detection reads it, with the sizes that detection fixes at the
    full model's (Flux's width 3072, Wan's heads = width / 128, …) set from the tiny config, every weight loaded."""
    import comfy.model_detection
    import comfy.model_patcher
    import torch

    config = comfy.model_detection.model_config_from_unet(state_dict, "")
    config.unet_config.update(sizes)
    config.set_inference_dtype(torch.float32, None)
    model = config.get_model(state_dict, "")
    missing, unexpected = model.diffusion_model.load_state_dict(state_dict, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return comfy.model_patcher.ModelPatcher(model, torch.device("cpu"), torch.device("cpu"))


FLUX_TINY_SIZES = dict(hidden_size=64, num_heads=4, context_in_dim=64, vec_in_dim=32, axes_dim=[4, 6, 6])


def xdit_model(pack, path: str, client, layout: dict | None = None):
    """The xDiT Model of ``path`` (float32) whose calls go to ``client``'s backend, not the nodes' own."""
    remote_model, choices = pack
    parallel = choices.ParallelChoice(layout) if layout else None
    xmodel = remote_model.XDiTModelNode.execute(choices.ModelChoice(path, "float32"), parallel).result[0]
    xmodel.model.diffusion_model.send.client = client
    return xmodel


def sample_both(own, xmodel, latent, seed: int, steps: int, cfg: float, sampler: str, positive, negative):
    """KSampler's sampling (comfy.sample.sample, the simple scheduler) on both models: the same latent."""
    import comfy.sample

    noise = comfy.sample.prepare_noise(latent, seed)
    own_latent, xdit_latent = (comfy.sample.sample(model, noise, steps, cfg, sampler, "simple", positive, negative,
                                                   latent, seed=seed) for model in (own, xmodel))
    assert_same(own_latent, xdit_latent)
    return xdit_latent


def prompts(seed: int, context_dim: int = 64, pooled: int | None = 32, **options):
    """Two stand-in prompts (positive, negative); ``options`` per side as (positive's, negative's) values."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    sides = []
    for side in range(2):
        extra = {"pooled_output": torch.randn(1, pooled, generator=generator)} if pooled else {}
        sides.append([[torch.randn(1, 8, context_dim, generator=generator),
                       {**extra, **{k: v[side] for k, v in options.items()}}]])
    return sides


def tiny_flux_file(path: str) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from backend.test_model_files import bfl_state_dict
    from xdit_backend.models import registry

    save_file(bfl_state_dict(registry.build("flux-tiny", torch.device("cpu"), torch.float32).transformer), path)
    return load_file(path)


def test_at_world_1_the_xdit_model_gives_comfyuis_latent(backend1, pack, tmp_path):
    """The tiny SD3 file through ComfyUI's own loader (comfy.sd, as UNETLoader) and the xDiT Model on one rank."""
    import comfy.sd
    import torch

    from host.conftest import tiny_sd3_file

    path = str(tmp_path / "tiny-sd3.safetensors")
    tiny_sd3_file(path)
    xmodel = xdit_model(pack, path, backend1)
    sample_both(comfy.sd.load_diffusion_model(path), xmodel, torch.zeros(1, 16, 8, 8), 11, 4, 4.0, "euler",
                *prompts(5))
    assert xmodel.model.diffusion_model.send.last_info["layout"].startswith("serial")


@pytest.mark.parametrize("layout", [{}, {"ulysses": 2}, {"ring": 2}, {"cfg": 2}],
                         ids=["world1", "ulysses", "ring", "cfg"])
def test_flux_with_fluxguidance_per_side_gives_comfyuis_latent(backend, pack, tmp_path, layout):
    """A tiny Flux file in BFL's layout, KSampler with cfg 3 and FluxGuidance's guidance different on the two
    sides (each call's rows carry their own)."""
    import torch

    path = str(tmp_path / "tiny-flux.safetensors")
    own = comfyuis_model(tiny_flux_file(path), **FLUX_TINY_SIZES)
    xmodel = xdit_model(pack, path, backend(2 if layout else 1), layout)
    sample_both(own, xmodel, torch.zeros(1, 16, 8, 8), 4, 4, 3.0, "euler", *prompts(8, guidance=(2.5, 6.0)))
    assert xmodel.model.diffusion_model.send.last_info["rows"] == 2


def test_wan_text_to_video_gives_comfyuis_latent(backend2, pack, tmp_path):
    """A tiny Wan 2.1 T2V file in the original layout under ulysses=2: a 5-D video latent of 5 frames, cfg 5,
    uni_pc."""
    import torch
    from safetensors.torch import load_file, save_file

    from unit.test_wan_checkpoint import original_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-wan.safetensors")
    save_file(original_state_dict(registry.build("wan-tiny", torch.device("cpu"), torch.float32).transformer), path)
    own = comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)
    sample_both(own, xdit_model(pack, path, backend2, {"ulysses": 2}), torch.zeros(1, 16, 2, 8, 8), 6, 4, 5.0,
                "uni_pc", *prompts(9, pooled=None))


def test_qwen_image_gives_comfyuis_latent_with_its_frame_axis(backend2, pack, tmp_path):
    """A tiny Qwen-Image file in ComfyUI's layout under ring=2. ComfyUI carries Qwen-Image's latent with a frame
    axis of one, [B, 16, 1, h, w]: the stand-in sends it without and gives it back with."""
    import torch
    from safetensors.torch import save_file

    from ranks.test_qwen_image import TINY, tiny_file

    path = str(tmp_path / "tiny-qwen-image.safetensors")
    state_dict = tiny_file()
    save_file(state_dict, path)
    own = comfyuis_model(state_dict, **{k: TINY[k] for k in ("attention_head_dim", "num_attention_heads",
                                                             "joint_attention_dim", "axes_dims_rope")})
    latent = sample_both(own, xdit_model(pack, path, backend2, {"ring": 2}), torch.zeros(1, 16, 1, 8, 12), 2, 4,
                         2.5, "euler", *prompts(10, pooled=None))
    assert latent.shape == (1, 16, 1, 8, 12)


def test_a_gguf_file_which_comfyuis_core_cannot_read_runs_on_the_xdit_model(backend2, pack, tmp_path):
    """A Q8_0 GGUF of the tiny Flux (city96's layout): ComfyUI's detection reads its keys and shapes from the GGUF
    header, the backend keeps its blocks quantized; ComfyUI's own Flux model given the same values dequantised
    (what ComfyUI-GGUF would compute) gives the same latent."""
    import torch
    from gguf import GGMLQuantizationType

    from backend.test_model_files import bfl_state_dict
    from ranks.test_gguf import gguf_file
    from xdit_backend.models import registry

    path = tmp_path / "tiny-flux-Q8_0.gguf"
    dequantised = gguf_file(bfl_state_dict(registry.build("flux-tiny", torch.device("cpu"), torch.float32).transformer),
                            path, GGMLQuantizationType.Q8_0)
    own = comfyuis_model({k: v.float() for k, v in dequantised.items()}, **FLUX_TINY_SIZES)
    positive, _ = prompts(12)
    sample_both(own, xdit_model(pack, str(path), backend2, {"ulysses": 2}), torch.zeros(1, 16, 8, 8), 5, 3, 1.0,
                "euler", positive, [])


def test_qwen_image_edit_reference_latents_give_comfyuis_latent(backend2, pack, tmp_path):
    """ReferenceLatent on the positive side only (an odd-sized reference: padded to the patch): ComfyUI's
    extra_conds moves it into the model's latent space, the stand-in sends it back in raw latent space, named by
    its hash (once), and the backend's Qwen-Image places it as ComfyUI's model does (the "index" method); the
    uncond side has none, so ComfyUI runs the two sides as separate calls. Under ulysses=2."""
    import torch
    from safetensors.torch import save_file

    from ranks.test_qwen_image import TINY, tiny_file

    path = str(tmp_path / "tiny-qwen-image-edit.safetensors")
    state_dict = tiny_file()
    save_file(state_dict, path)
    own = comfyuis_model(state_dict, **{k: TINY[k] for k in ("attention_head_dim", "num_attention_heads",
                                                             "joint_attention_dim", "axes_dims_rope")})
    reference = torch.randn(1, 16, 1, 5, 7, generator=torch.Generator().manual_seed(14))
    positive, negative = prompts(15, pooled=None)
    positive[0][1]["reference_latents"] = [reference]
    xmodel = xdit_model(pack, path, backend2, {"ulysses": 2})
    sample_both(own, xmodel, torch.zeros(1, 16, 1, 8, 8), 3, 3, 3.0, "euler", positive, negative)
    assert xmodel.model.diffusion_model.send.last_info["inputs_held"] >= 3  # context ×2 and the reference, kept


# ----------------------------------------------------------------------------------------------- Wan image to video
# A tiny Wan 2.1 I2V file (36 input channels, the CLIP image embedder) in the original layout, against ComfyUI's own
# WAN21 model (image_to_video, as its detection makes it from the file), with the conditioning WanImageToVideo makes
# (comfy_extras/nodes_wan.py: the start frame's latent and a mask over the frames to make, on both sides) and
# CLIPVisionEncode's output.


def pack_module(name: str):
    """A module of the pack as ComfyUI imports it (after the ``pack`` fixture)."""
    import importlib

    return importlib.import_module(f"comfyui_xdit.nodes.{name}")


def sampler_tensors(path: str, positive, negative, batch: int = 1) -> dict:
    """The xDiT Sampler's conditioning tensors for these ComfyUI sides, by the nodes' own translation."""
    from xdit_backend.models import registry

    translate, spec, tensors = pack_module("translate"), registry.spec(path), {}
    for prefix, entries in (("", positive), ("negative_", negative)):
        side = translate.conditioning(entries, spec, batch, "negative" if prefix else "positive")
        tensors.update({prefix + key: tensor for key, tensor in side.tensors.items()})
    return tensors


def tiny_wan_i2v(tmp_path) -> tuple[str, dict]:
    import torch
    from safetensors.torch import load_file, save_file

    from unit.test_wan_checkpoint import original_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-wan-i2v.safetensors")
    save_file(original_state_dict(registry.build("wan-i2v-tiny", torch.device("cpu"), torch.float32).transformer), path)
    return path, load_file(path)


def wan_i2v_prompts(seed: int, frames: int = 3, size: int = 8, image_tokens: int = 6):
    """WanImageToVideo's conditioning: ``concat_latent_image`` (the start frame's latent, the other frames zero),
    ``concat_mask`` (0 on the start frame: kept, 1 on the frames to make), and ``clip_vision_output``."""
    import comfy.clip_vision
    import torch

    generator = torch.Generator().manual_seed(seed)
    image = torch.zeros(1, 16, frames, size, size)
    image[:, :, :1] = torch.randn(1, 16, 1, size, size, generator=generator)
    mask = torch.ones(1, 1, frames, size, size)
    mask[:, :, :1] = 0.0
    clip = comfy.clip_vision.Output()
    clip.penultimate_hidden_states = torch.randn(1, image_tokens, 1280, generator=generator)
    extra = {"concat_latent_image": image, "concat_mask": mask, "clip_vision_output": clip}
    return [[[torch.randn(1, 8, 64, generator=generator), dict(extra)]] for _ in range(2)]


def test_wans_concatenated_channels_are_comfyuis_concat_cond(pack, tmp_path):
    """The backend's Wan builds the 20 channels ComfyUI concatenates exactly as ComfyUI's WAN21.concat_cond does:
    a start image of another size (resized and cropped at the centre), a mask of one channel at pixel size over
    fewer frames (inverted, resized, padded, repeated), a four-channel mask, the LATENT's noise mask in place of a
    concat_mask (ComfyUI's denoise_mask, prepared to the latent's channels), and no image at all."""
    import torch

    from xdit_backend.models import registry

    path, state_dict = tiny_wan_i2v(tmp_path)
    own = comfyuis_model(state_dict, num_heads=2, text_dim=64, freq_dim=32).model
    ours = registry.build(path, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(3)
    noise = torch.randn(2, 16, 4, 8, 12, generator=generator)
    image = torch.randn(2, 16, 4, 10, 10, generator=generator)
    cases = [
        {"concat_latent_image": image, "concat_mask": (torch.rand(2, 1, 3, 64, 96, generator=generator) > 0.5).float()},
        {"concat_latent_image": image, "concat_mask": torch.rand(2, 4, 4, 8, 12, generator=generator)},
        {"concat_latent_image": image},
        {"concat_latent_image": image, "denoise_mask": torch.rand(2, 16, 4, 8, 12, generator=generator)},
        {},
    ]
    for cond in cases:
        theirs = own.concat_cond(noise=noise, device=torch.device("cpu"), **cond)
        assert torch.equal(ours.concat(tuple(noise.shape), cond), theirs), sorted(cond)


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg": 2}], ids=["ulysses", "cfg"])
def test_wan_image_to_video_on_the_xdit_model_gives_comfyuis_latent(backend2, pack, tmp_path, layout):
    """ComfyUI concatenates the channels itself and passes the CLIP hidden states as clip_fea: the xDiT Model sends
    x with 36 channels and the image tokens (once, by hash), and gets ComfyUI's latent."""
    import torch

    path, state_dict = tiny_wan_i2v(tmp_path)
    own = comfyuis_model(state_dict, num_heads=2, text_dim=64, freq_dim=32)
    xmodel = xdit_model(pack, path, backend2, layout)
    sample_both(own, xmodel, torch.zeros(1, 16, 3, 8, 8), 6, 3, 4.0, "euler", *wan_i2v_prompts(16))
    assert xmodel.model.diffusion_model.send.last_info["inputs_held"] >= 3  # context ×2 and the image tokens


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}], ids=["ulysses", "ring"])
def test_wan_image_to_video_on_the_xdit_sampler_gives_comfyuis_latent(backend2, pack, tmp_path, layout):
    """The xDiT Sampler's translation of WanImageToVideo's conditioning (the start latent, the mask, the CLIP
    output's hidden states), and the backend's own concatenation, against KSampler on ComfyUI's own model."""
    import comfy.sample
    import torch

    from xdit_backend.models import registry

    translate = pack_module("translate")

    path, state_dict = tiny_wan_i2v(tmp_path)
    own = comfyuis_model(state_dict, num_heads=2, text_dim=64, freq_dim=32)
    positive, negative = wan_i2v_prompts(17)
    latent = torch.zeros(1, 16, 3, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 7)
    theirs = comfy.sample.sample(own, noise, 3, 4.0, "euler", "simple", positive, negative, latent, seed=7)
    spec = registry.spec(path)
    geometry, _ = translate.latent({"samples": latent}, spec)
    tensors = sampler_tensors(path, positive, negative, geometry.batch)
    assert {"concat_latent_image", "concat_mask", "clip_vision_output"} <= set(tensors)
    request = {"model": path, "dtype": "float32", "width": geometry.width, "height": geometry.height,
               "frames": geometry.frames, "steps": 3, "seed": 7, "cfg": 4.0, "sampler": "euler",
               "scheduler": "simple", "parallel": layout}
    result, _ = backend2.sample(request, tensors)
    assert_same(theirs, translate.to_comfyui(result, spec))


def test_an_image_input_on_a_text_to_video_wan_is_left_out_as_comfyui_does_and_said(pack, caplog):
    """WanImageToVideo before a text-to-video file: ComfyUI's own model takes nothing of it (its concat_cond and the
    blocks' cross-attention ignore it); the xDiT Sampler leaves it out too, so its latent is KSampler's, and says so
    in the console."""
    from xdit_backend.models import registry

    translate = pack_module("translate")
    positive, _ = wan_i2v_prompts(18)
    with caplog.at_level("WARNING", logger="comfyui-xdit"):
        side = translate.conditioning(positive, registry.spec("wan-tiny"), 1, "positive")
    assert not {"concat_latent_image", "concat_mask"} & set(side.tensors)  # its CLIP tokens go: the model ignores them
    assert "an image to condition on (image-to-video), which this wan model does not take" in caplog.text


# ----------------------------------------------------------------------------------------------- Flux Kontext
# Reference latents on Flux (ReferenceLatent: Flux.1 Kontext), placed as ComfyUI's Flux places them by default
# ("offset": index 1, each reference beside or below the ones before).


@pytest.mark.parametrize("path_kind, layout", [("model", {"ulysses": 2}), ("sampler", {"ring": 2})])
def test_flux_kontext_references_give_comfyuis_latent(backend2, pack, tmp_path, path_kind, layout):
    """Two references of different sizes on the positive side (one wide, one tall: placed beside, then below),
    none on the negative: ComfyUI's own Flux against the xDiT Model (ComfyUI's sampler; the references by hash)
    and the xDiT Sampler (the nodes' translation, the whole loop on the backend)."""
    import comfy.sample
    import torch

    path = str(tmp_path / "tiny-flux-kontext.safetensors")
    own = comfyuis_model(tiny_flux_file(path), **FLUX_TINY_SIZES)
    generator = torch.Generator().manual_seed(19)
    positive, negative = prompts(20)
    positive[0][1]["reference_latents"] = [torch.randn(1, 16, 6, 10, generator=generator),
                                           torch.randn(1, 16, 8, 4, generator=generator)]
    latent = torch.zeros(1, 16, 8, 8)
    if path_kind == "model":
        sample_both(own, xdit_model(pack, path, backend2, layout), latent, 3, 3, 2.0, "euler", positive, negative)
        return
    noise = comfy.sample.prepare_noise(latent, 3)
    theirs = comfy.sample.sample(own, noise, 3, 2.0, "euler", "simple", positive, negative, latent, seed=3)
    tensors = sampler_tensors(path, positive, negative)
    assert {"reference_0", "reference_1"} <= set(tensors)
    request = {"model": path, "dtype": "float32", "width": 64, "height": 64, "steps": 3, "seed": 3, "cfg": 2.0,
               "sampler": "euler", "scheduler": "simple", "parallel": layout}
    result, _ = backend2.sample(request, tensors)
    assert_same(theirs, result["samples"])
    plain, _ = backend2.sample(request, {k: v for k, v in tensors.items() if not k.startswith("reference_")})
    assert (plain["samples"] - result["samples"]).abs().max() > 1e-2  # the references did something


# ----------------------------------------------------------------------------------------------- Flux Fill
# A tiny Flux.1 Fill file (384 input channels: the latent, the image to inpaint and its 8×8-folded mask, packed) in
# BFL's layout, with InpaintModelConditioning's conditioning (nodes.py: the masked image's latent and the pixel mask
# on both sides, the mask also the latent's noise mask).


def tiny_flux_fill(tmp_path) -> tuple[str, dict]:
    import torch
    from safetensors.torch import load_file, save_file

    from backend.test_model_files import bfl_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-flux-fill.safetensors")
    save_file(bfl_state_dict(registry.build("flux-fill-tiny", torch.device("cpu"), torch.float32).transformer), path)
    return path, load_file(path)


def fill_prompts(seed: int):
    """InpaintModelConditioning's values: the image to inpaint (its latent) and the mask at pixel size."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(1, 16, 8, 8, generator=generator)
    mask = torch.zeros(1, 1, 64, 64)
    mask[..., 16:48, 8:40] = 1.0
    sides = prompts(seed)
    for side in sides:
        side[0][1].update({"concat_latent_image": image, "concat_mask": mask})
    return sides, image, mask


def test_flux_fills_concatenated_channels_are_comfyuis_concat_cond(pack, tmp_path):
    """The image resized and moved into model space, the mask averaged, resized to 8× the latent and folded into 64
    channels: bit for bit ComfyUI's Flux.concat_cond, with a mask, with the noise mask instead (denoise_mask), without
    one (all ones), without an image."""
    import torch

    from xdit_backend.models import registry

    path, state_dict = tiny_flux_fill(tmp_path)
    own = comfyuis_model(state_dict, **FLUX_TINY_SIZES).model
    ours = registry.build(path, torch.device("cpu"), torch.float32)
    assert ours.spec.concat_channels == 80
    generator = torch.Generator().manual_seed(2)
    noise = torch.randn(2, 16, 8, 12, generator=generator)
    image = torch.randn(2, 16, 10, 10, generator=generator)
    for cond in ({"concat_latent_image": image, "concat_mask": torch.rand(2, 3, 50, 70, generator=generator)},
                 {"concat_latent_image": image, "denoise_mask": torch.rand(2, 16, 8, 12, generator=generator)},
                 {"concat_latent_image": image}, {}):
        theirs = own.concat_cond(noise=noise, device=torch.device("cpu"), **cond)
        assert torch.equal(ours.concat(tuple(noise.shape), cond), theirs), sorted(cond)


@pytest.mark.parametrize("path_kind, layout, concat_mask",
                         [("model", {"ring": 2}, True), ("sampler", {"ulysses": 2}, True),
                          ("sampler", {"pipefusion": 2, "warmup_steps": 3}, False)],
                         ids=["model", "sampler", "sampler-noise-mask-only"])
def test_flux_fill_inpainting_gives_comfyuis_latent(backend2, pack, tmp_path, path_kind, layout, concat_mask):
    """InpaintModelConditioning's conditioning and its noise mask on the latent: ComfyUI's own Fill model against
    the xDiT Model (ComfyUI concatenates the channels and blends) and the xDiT Sampler (the backend does both);
    without a concat_mask (a Fill model after Set Latent Noise Mask) both models take the noise mask for it."""
    import comfy.sample

    from xdit_backend.models import registry

    path, state_dict = tiny_flux_fill(tmp_path)
    own = comfyuis_model(state_dict, **FLUX_TINY_SIZES)
    (positive, negative), image, mask = fill_prompts(21)
    if not concat_mask:
        for side in (positive, negative):
            del side[0][1]["concat_mask"]
    noise = comfy.sample.prepare_noise(image, 4)
    theirs = comfy.sample.sample(own, noise, 3, 1.0, "euler", "simple", positive, negative, image, noise_mask=mask,
                                 seed=4)
    if path_kind == "model":
        xmodel = xdit_model(pack, path, backend2, layout)
        ours = comfy.sample.sample(xmodel, noise, 3, 1.0, "euler", "simple", positive, negative, image,
                                   noise_mask=mask, seed=4)
        assert_same(theirs, ours)
        return
    translate = pack_module("translate")
    spec = registry.spec(path)
    tensors = {"latent": image, "noise_mask": mask}
    side = translate.conditioning(positive, spec, 1, "positive")
    assert ("concat_mask" in side.tensors) is concat_mask and "concat_latent_image" in side.tensors
    tensors.update(side.tensors)
    request = {"model": path, "dtype": "float32", "width": 64, "height": 64, "steps": 3, "seed": 4, "cfg": 1.0,
               "sampler": "euler", "scheduler": "simple", "parallel": layout}
    result, _ = backend2.sample(request, tensors)
    assert_same(theirs, result["samples"])


def test_wan_first_last_frame_gives_comfyuis_latent(backend2, pack, tmp_path):
    """A tiny FLF2V file (the image embedder's position table over two frames' CLIP tokens) with
    WanFirstLastFrameToVideo's conditioning (both frames' latents, a four-channel mask, the two CLIP outputs joined:
    2 × 6 tokens), the xDiT Sampler under ulysses=2 against ComfyUI's own WAN21 model."""
    import comfy.sample
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file, save_file

    from unit.test_wan_checkpoint import original_state_dict
    from xdit_backend.models import registry

    config = {**registry.BUILTINS["wan-i2v-tiny"].config, "pos_embed_seq_len": 12}
    torch.manual_seed(3)
    model = WanTransformer3DModel(**config)
    with torch.no_grad():
        model.condition_embedder.image_embedder.pos_embed.normal_()  # zeros at construction: make it count
    path = str(tmp_path / "tiny-wan-flf2v.safetensors")
    save_file(original_state_dict(model), path)
    own = comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)
    positive, negative = wan_i2v_prompts(22, image_tokens=12)
    mask = torch.ones(1, 4, 3, 8, 8)
    mask[:, :, 0], mask[:, :3, -1] = 0.0, 0.0  # the first frame kept, the last latent frame's first three
    for side in (positive, negative):
        side[0][1]["concat_mask"] = mask
    latent = torch.zeros(1, 16, 3, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 8)
    theirs = comfy.sample.sample(own, noise, 3, 4.0, "euler", "simple", positive, negative, latent, seed=8)
    tensors = sampler_tensors(path, positive, negative)
    request = {"model": path, "dtype": "float32", "width": 64, "height": 64, "frames": 9, "steps": 3, "seed": 8,
               "cfg": 4.0, "sampler": "euler", "scheduler": "simple", "parallel": {"ulysses": 2}}
    result, _ = backend2.sample(request, tensors)
    assert_same(theirs, result["samples"])


# ----------------------------------------------------------------------------------------------- Wan 2.2 TI2V-5B
# A tiny TI2V-5B file (48 channels) against ComfyUI's own WAN22, with Wan22ImageToVideoLatent's LATENT (the start
# image's latent in the first frame, its noise mask 0 there): ComfyUI's model takes a timestep per frame from the mask
# (process_timestep) and keeps the first frame clean (scale_latent_inpaint).


def ti2v_latent(seed: int, frames: int = 3, size: int = 8) -> tuple:
    """Wan22ImageToVideoLatent's samples (raw: the mean where the video is to be made, the start latent in front) and
    noise mask [1, 1, T, h, w]."""
    import comfy.latent_formats
    import torch

    generator = torch.Generator().manual_seed(seed)
    latent = comfy.latent_formats.Wan22().process_out(torch.zeros(1, 48, frames, size, size))
    latent[:, :, :1] = torch.randn(1, 48, 1, size, size, generator=generator)
    mask = torch.ones(1, 1, frames, size, size)
    mask[:, :, :1] = 0.0
    return latent, mask


def tiny_wan_ti2v(tmp_path) -> tuple[str, object]:
    import torch
    from safetensors.torch import load_file, save_file

    from unit.test_wan_checkpoint import original_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-wan-ti2v.safetensors")
    save_file(original_state_dict(registry.build("wan-ti2v-tiny", torch.device("cpu"), torch.float32).transformer),
              path)
    return path, comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"pipefusion": 2, "warmup_steps": 3}],
                         ids=["ulysses", "pipefusion"])
def test_wan_ti2v_first_frame_on_the_xdit_sampler_gives_comfyuis_latent(backend2, pack, tmp_path, layout):
    """KSampler with the noise mask on ComfyUI's WAN22 against the xDiT Sampler sent the LATENT's samples and mask
    (the timesteps per frame split with the tokens, or taken per chunk): the same latent, its first frame the start
    image's."""
    import comfy.sample

    path, own = tiny_wan_ti2v(tmp_path)
    latent, mask = ti2v_latent(31)
    positive, negative = prompts(32, pooled=None)
    noise = comfy.sample.prepare_noise(latent, 9)
    theirs = comfy.sample.sample(own, noise, 3, 4.0, "euler", "simple", positive, negative, latent, noise_mask=mask,
                                 seed=9)
    request = {"model": path, "dtype": "float32", "width": 128, "height": 128, "frames": 9, "steps": 3, "seed": 9,
               "cfg": 4.0, "sampler": "euler", "scheduler": "simple", "parallel": layout}
    result, _ = backend2.sample(request, {**sampler_tensors(path, positive, negative), "latent": latent,
                                          "noise_mask": mask})
    assert_same(theirs, result["samples"])
    assert (theirs[:, :, 0] - latent[:, :, 0]).abs().max() < 1e-4  # the start frame kept


def test_wan_ti2v_first_frame_on_the_xdit_model_gives_comfyuis_latent(backend2, pack, tmp_path):
    """ComfyUI's sampler on the xDiT Model: its WAN22 turns the mask into timesteps per frame, which the calls carry
    ([N, T]); the backend modulates each token by its frame's, under ulysses=2."""
    path, own = tiny_wan_ti2v(tmp_path)
    latent, mask = ti2v_latent(33)
    import comfy.sample

    xmodel = xdit_model(pack, path, backend2, {"ulysses": 2})
    noise = comfy.sample.prepare_noise(latent, 10)
    positive, negative = prompts(34, pooled=None)
    own_latent, xdit_latent = (comfy.sample.sample(model, noise, 3, 4.0, "euler", "simple", positive, negative, latent,
                                                   noise_mask=mask, seed=10) for model in (own, xmodel))
    assert_same(own_latent, xdit_latent)


# ----------------------------------------------------------------------------------------------- Wan 2.1 Fun Control
# A tiny Fun Control file (48 input channels: the latent, the control video's latent, the start image's; the CLIP
# image embedder) against ComfyUI's own WAN21 as its detection makes it (WAN21_FunControl2V: image_to_video off, so
# the 32 channels go in without a mask), with WanFunControlToVideo's conditioning.


def tiny_wan_fun_control(tmp_path) -> tuple[str, object]:
    import torch
    from diffusers import WanTransformer3DModel
    from safetensors.torch import load_file, save_file

    from unit.test_wan_checkpoint import original_state_dict
    from xdit_backend.models import registry

    torch.manual_seed(4)
    model = WanTransformer3DModel(**{**registry.BUILTINS["wan-i2v-tiny"].config, "in_channels": 48})
    path = str(tmp_path / "tiny-wan-fun-control.safetensors")
    save_file(original_state_dict(model), path)
    return path, comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)


def fun_control_prompts(seed: int, frames: int = 3, size: int = 8):
    """WanFunControlToVideo's conditioning: ``concat_latent_image`` [1, 32, T, h, w], the control video's latent then
    the start image's (its first frame; the mean elsewhere: process_out of zero), on both sides, and CLIP tokens."""
    import comfy.clip_vision
    import comfy.latent_formats
    import torch

    generator = torch.Generator().manual_seed(seed)
    latent = comfy.latent_formats.Wan21().process_out(torch.zeros(1, 16, frames, size, size)).repeat(1, 2, 1, 1, 1)
    latent[:, :16] = torch.randn(1, 16, frames, size, size, generator=generator)  # the control video
    latent[:, 16:, :1] = torch.randn(1, 16, 1, size, size, generator=generator)  # the start image
    clip = comfy.clip_vision.Output()
    clip.penultimate_hidden_states = torch.randn(1, 6, 1280, generator=generator)
    extra = {"concat_latent_image": latent, "clip_vision_output": clip}
    return [[[torch.randn(1, 8, 64, generator=generator), dict(extra)]] for _ in range(2)]


def test_wan_fun_control_on_the_xdit_sampler_gives_comfyuis_latent(backend2, pack, tmp_path):
    """The file loads as Fun Control (48 in); the backend concatenates the 32 channels as ComfyUI's WAN21.concat_cond
    does for it (no mask), and the xDiT Sampler under ulysses=2 gives KSampler's latent on ComfyUI's own model."""
    import comfy.sample
    import torch

    from xdit_backend.models import registry

    path, own = tiny_wan_fun_control(tmp_path)
    positive, negative = fun_control_prompts(41)
    latent = torch.zeros(1, 16, 3, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(2))
    theirs_concat = own.model.concat_cond(noise=noise, device=torch.device("cpu"), **positive[0][1])
    ours = registry.build(path, torch.device("cpu"), torch.float32)
    assert torch.equal(ours.concat(tuple(noise.shape), positive[0][1]), theirs_concat)
    theirs = comfy.sample.sample(own, comfy.sample.prepare_noise(latent, 7), 3, 4.0, "euler", "simple", positive,
                                 negative, latent, seed=7)
    request = {"model": path, "dtype": "float32", "width": 64, "height": 64, "frames": 9, "steps": 3, "seed": 7,
               "cfg": 4.0, "sampler": "euler", "scheduler": "simple", "parallel": {"ulysses": 2}}
    result, _ = backend2.sample(request, sampler_tensors(path, positive, negative))
    assert_same(theirs, result["samples"])


# ----------------------------------------------------------------------------------------------- Wan VACE
# A tiny Wan 2.1 VACE file in the original layout against ComfyUI's own WAN21_Vace model, with the conditioning
# WanVaceToVideo makes from a control video and its masks (comfy_extras/nodes_wan.py) through a stand-in video VAE.


class StandInVideoVAE:
    """A video VAE as WanVaceToVideo uses one: frames [F, H, W, 3] → [1, 16, 1 + (F − 1)/4, H/8, W/8] (every fourth
    frame's 8 × 8 pixel means through a fixed map)."""

    def __init__(self):
        import torch

        self.mix = torch.randn(16, 3, generator=torch.Generator().manual_seed(12))

    def encode(self, frames):
        import torch

        pooled = torch.nn.functional.avg_pool2d(frames.movedim(-1, 1).float(), 8)[::4]  # [T', 3, h, w]
        return torch.einsum("oc,tchw->othw", self.mix, pooled)[None]


@pytest.mark.parametrize("layout, chained", [({"ulysses": 2}, False), ({"ring": 2}, False), ({"ulysses": 2}, True)],
                         ids=["ulysses", "ring", "chained-ulysses"])
def test_wan_vace_on_the_xdit_sampler_gives_comfyuis_latent(backend2, pack, tmp_path, layout, chained):
    """WanVaceToVideo (a 9-frame control video, its masks, strength 0.8; chained: a second one after it, another
    video at strength −0.4) before the xDiT Sampler: its translation of vace_frames, vace_mask and vace_strength, and
    the backend's VACE blocks run split, against KSampler on ComfyUI's own VACE model."""
    import comfy.sample
    import torch
    from comfy_extras.nodes_wan import WanVaceToVideo
    from safetensors.torch import load_file, save_file

    from backend.test_wan_vace import original_vace_state_dict
    from xdit_backend.models import registry

    translate = pack_module("translate")
    path = str(tmp_path / "tiny-wan-vace.safetensors")
    save_file(original_vace_state_dict(registry.build("wan-vace-tiny", torch.device("cpu")).transformer), path)
    own = comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)
    g = torch.Generator().manual_seed(21)
    prompts_ = [[[torch.randn(1, 8, 64, generator=g), {}]] for _ in range(2)]
    video, masks = torch.rand(9, 64, 64, 3, generator=g), torch.rand(9, 64, 64, generator=g)
    positive, negative, latent, _ = WanVaceToVideo.execute(*prompts_, StandInVideoVAE(), 64, 64, 9, 1, 0.8,
                                                           control_video=video, control_masks=masks).result
    if chained:
        positive, negative, latent, _ = WanVaceToVideo.execute(positive, negative, StandInVideoVAE(), 64, 64, 9, 1,
                                                               -0.4, control_video=torch.rand(9, 64, 64, 3,
                                                                                              generator=g)).result
    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, 7)
    theirs = comfy.sample.sample(own, noise, 3, 4.0, "euler", "simple", positive, negative, samples, seed=7)
    spec = registry.spec(path)
    geometry, _ = translate.latent(latent, spec)
    tensors = sampler_tensors(path, positive, negative, geometry.batch)
    assert {"vace_frames", "vace_mask", "vace_strength"} <= set(tensors)
    request = {"model": path, "dtype": "float32", "width": geometry.width, "height": geometry.height,
               "frames": geometry.frames, "steps": 3, "seed": 7, "cfg": 4.0, "sampler": "euler",
               "scheduler": "simple", "parallel": layout}
    result, _ = backend2.sample(request, tensors)
    assert_same(theirs, translate.to_comfyui(result, spec))


@pytest.mark.parametrize("layout, chained", [({"ulysses": 2}, False), ({"cfg": 2}, False), ({"ring": 2}, True)],
                         ids=["ulysses", "cfg", "chained-ring"])
def test_wan_vace_on_the_xdit_model_gives_comfyuis_latent(backend2, pack, tmp_path, layout, chained):
    """ComfyUI's WAN21_Vace makes vace_context and vace_strength from WanVaceToVideo's conditioning and passes them
    to the model: the xDiT Model sends them on (one control video; chained: two), and KSampler's latent is ComfyUI's
    own."""
    import torch
    from comfy_extras.nodes_wan import WanVaceToVideo
    from safetensors.torch import load_file, save_file

    from backend.test_wan_vace import original_vace_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-wan-vace.safetensors")
    save_file(original_vace_state_dict(registry.build("wan-vace-tiny", torch.device("cpu")).transformer), path)
    own = comfyuis_model(load_file(path), num_heads=2, text_dim=64, freq_dim=32)
    g = torch.Generator().manual_seed(22)
    prompts_ = [[[torch.randn(1, 8, 64, generator=g), {}]] for _ in range(2)]
    video = torch.rand(9, 64, 64, 3, generator=g)
    positive, negative, latent, _ = WanVaceToVideo.execute(*prompts_, StandInVideoVAE(), 64, 64, 9, 1, 0.6,
                                                           control_video=video).result
    if chained:
        positive, negative, latent, _ = WanVaceToVideo.execute(positive, negative, StandInVideoVAE(), 64, 64, 9, 1,
                                                               1.2, control_video=1 - video).result
    sample_both(own, xdit_model(pack, path, backend2, layout), latent["samples"], 6, 3, 4.0, "euler", positive,
                negative)


# ----------------------------------------------------------------------------------------------- Apply ControlNet
# Load ControlNet Model + Set Union ControlNet Type + Apply ControlNet (Advanced) on the prompts of KSampler: ComfyUI
# runs the ControlNet itself on its own model; on the xDiT Model the ControlNet runs on the backend, its file found
# in the running prompt's graph (model_controls.py).

CONTROLNET_GRAPH = {
    "1": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "flux-union.safetensors"}},
    "2": {"class_type": "SetUnionControlNetType", "inputs": {"control_net": ["1", 0],
                                                              "type": "canny/lineart/anime_lineart/mlsd"}},
    "4": {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["3", 0], "negative": ["5", 0], "control_net": ["2", 0], "image": ["6", 0], "vae": ["7", 0],
        "strength": 0.7, "start_percent": 0.0, "end_percent": 0.6}},
    "ks": {"class_type": "KSampler", "inputs": {"positive": ["4", 0], "negative": ["4", 1]}},
}


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg": 2}], ids=["ulysses", "cfg"])
def test_apply_controlnet_on_the_xdit_model_gives_comfyuis_latent(backend2, pack, tmp_path, monkeypatch, layout):
    """A Flux union ControlNet (canny type, strength 0.7, the first 60 % of the schedule) applied to both prompts:
    KSampler on ComfyUI's own tiny Flux with ComfyUI's own ControlNetFlux, and on the xDiT Model, whose calls send
    the ControlNet to the backend while it is active: the same latent; ComfyUI's process never runs it."""
    import comfy.controlnet
    import comfy.latent_formats
    import comfy.ldm.flux.controlnet
    import comfy.ops
    import folder_paths
    import nodes as comfy_nodes
    import torch
    from comfy_extras.nodes_controlnet import SetUnionControlNetType
    from safetensors.torch import save_file

    from backend.test_flux_controlnet import FLUX_PARAMS, comfy_state
    from host.test_control_nodes import FluxStandInVAE
    from xdit_backend.models import model_patch

    network = model_patch.network(model_patch.PatchSpec("flux-controlnet-tiny", 1.0), torch.device("cpu"),
                                  torch.float32)
    (tmp_path / "controlnet").mkdir()
    save_file(network.state_dict(), str(tmp_path / "controlnet" / "flux-union.safetensors"))
    folder_paths.add_model_folder_path("controlnet", str(tmp_path / "controlnet"))
    theirs = comfy.ldm.flux.controlnet.ControlNetFlux(
        latent_input=True, num_union_modes=8, control_latent_channels=16, operations=comfy.ops.disable_weight_init,
        **FLUX_PARAMS, depth=1, depth_single_blocks=1)
    theirs.load_state_dict(comfy_state(network.state_dict()), strict=True)
    runs = []
    original_forward = theirs.forward
    theirs.forward = lambda *args, **kwargs: runs.append(1) or original_forward(*args, **kwargs)
    loaded = comfy.controlnet.ControlNet(theirs, compression_ratio=1, latent_format=comfy.latent_formats.Flux(),
                                         load_device=torch.device("cpu"), extra_conds=["y", "guidance"])
    typed = SetUnionControlNetType().set_controlnet_type(loaded, "canny/lineart/anime_lineart/mlsd")[0]
    image = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(3))
    positive, negative = comfy_nodes.ControlNetApplyAdvanced().apply_controlnet(
        *prompts(8, guidance=(3.5, 3.5)), typed, image, 0.7, 0.0, 0.6, vae=FluxStandInVAE())

    path = str(tmp_path / "tiny-flux.safetensors")
    own = comfyuis_model(tiny_flux_file(path), **FLUX_TINY_SIZES)
    xmodel = xdit_model(pack, path, backend2, layout)
    import comfy.sample

    latent = torch.zeros(1, 16, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 4)
    with pytest.raises(ValueError, match="(?s)xDiT: the xDiT Model's conditioning carries a ControlNet.*queue"):
        comfy.sample.sample(xmodel, noise, 4, 3.0, "euler", "simple", positive, negative, latent, seed=4)  # no prompt
    monkeypatch.setattr(pack_module("model_controls"), "running_prompt", lambda: (CONTROLNET_GRAPH, "ks"))
    own_latent = comfy.sample.sample(own, noise, 4, 3.0, "euler", "simple", positive, negative, latent, seed=4)
    ran_in_comfyui = len(runs)
    xdit_latent = comfy.sample.sample(xmodel, noise, 4, 3.0, "euler", "simple", positive, negative, latent, seed=4)
    assert_same(own_latent, xdit_latent)
    assert ran_in_comfyui > 0 and len(runs) == ran_in_comfyui  # the xDiT Model's run never called it here
    plain = comfy.sample.sample(own, noise, 4, 3.0, "euler", "simple", *prompts(8, guidance=(3.5, 3.5)), latent,
                                seed=4)
    assert (plain - own_latent).abs().max() > 1e-3

    # the same ControlNet from xDiT ControlNet on the model before the xDiT Model (no Apply ControlNet on the prompts)
    remote_model, choices = pack
    control = choices.ControlChoice(str(tmp_path / "controlnet" / "flux-union.safetensors"), 0.7, image,
                                    FluxStandInVAE(), start=0.0, end=0.6, resize="nearest-exact", mode=3)
    choice = choices.ModelChoice(path, "float32").with_control(control)
    controlled = remote_model.XDiTModelNode.execute(choice, choices.ParallelChoice(layout)).result[0]
    controlled.model.diffusion_model.send.client = backend2
    from_node = comfy.sample.sample(controlled, noise, 4, 3.0, "euler", "simple", *prompts(8, guidance=(3.5, 3.5)),
                                    latent, seed=4)
    assert_same(own_latent, from_node)


def test_a_model_patch_node_on_the_xdit_model_gives_comfyuis_latent(backend2, pack, tmp_path, monkeypatch):
    """QwenImageDiffsynthControlnet (ComfyUI's own node, strength 0.8) on ComfyUI's tiny Qwen-Image and on the xDiT
    Model, KSampler under ulysses=2: the same latent; the patch runs on the backend (its file found through the
    node's ModelPatchLoader in the running prompt), not in ComfyUI's process."""
    import comfy.model_patcher
    import comfy.ops
    import comfy.sample
    import comfy_extras.nodes_model_patch as nodes_model_patch
    import folder_paths
    import torch
    from safetensors.torch import save_file

    from host.test_control_nodes import StandInVAE
    from ranks.test_qwen_image import TINY, tiny_file
    from xdit_backend.models import model_patch

    network = model_patch.network(model_patch.PatchSpec("qwen-image-diffsynth-tiny", 1.0), torch.device("cpu"),
                                  torch.float32)
    (tmp_path / "model_patches").mkdir()
    save_file(network.state_dict(), str(tmp_path / "model_patches" / "canny-patch.safetensors"))
    folder_paths.add_model_folder_path("model_patches", str(tmp_path / "model_patches"))
    width = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    theirs = nodes_model_patch.QwenImageBlockWiseControlNet(num_layers=TINY["num_layers"], dim=width,
                                                           operations=comfy.ops.manual_cast)
    theirs.load_state_dict(network.state_dict())
    runs = []
    original_block = theirs.control_block
    theirs.control_block = lambda *args: runs.append(1) or original_block(*args)
    loaded = comfy.model_patcher.ModelPatcher(theirs, torch.device("cpu"), torch.device("cpu"))  # ModelPatchLoader's
    graph = {"p": {"class_type": "ModelPatchLoader", "inputs": {"name": "canny-patch.safetensors"}},
             "q": {"class_type": "QwenImageDiffsynthControlnet",
                   "inputs": {"model": ["xm", 0], "model_patch": ["p", 0]}},
             "ks": {"class_type": "KSampler", "inputs": {"model": ["q", 0]}}}
    monkeypatch.setattr(pack_module("model_controls"), "running_prompt", lambda: (graph, "ks"))

    path = str(tmp_path / "tiny-qwen-image.safetensors")
    state_dict = tiny_file()
    save_file(state_dict, path)
    own = comfyuis_model(state_dict, **{k: TINY[k] for k in ("attention_head_dim", "num_attention_heads",
                                                             "joint_attention_dim", "axes_dims_rope")})
    image = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(7))
    node = nodes_model_patch.QwenImageDiffsynthControlnet()
    own_patched = node.diffsynth_controlnet(own, loaded, StandInVAE(), image, 0.8)[0]
    xdit_patched = node.diffsynth_controlnet(xdit_model(pack, path, backend2, {"ulysses": 2}), loaded, StandInVAE(),
                                             image, 0.8)[0]
    latent = torch.zeros(1, 16, 1, 8, 12)
    noise = comfy.sample.prepare_noise(latent, 2)
    sides = prompts(10, pooled=None)
    own_latent = comfy.sample.sample(own_patched, noise, 4, 2.5, "euler", "simple", *sides, latent, seed=2)
    ran_in_comfyui = len(runs)
    xdit_latent = comfy.sample.sample(xdit_patched, noise, 4, 2.5, "euler", "simple", *sides, latent, seed=2)
    assert_same(own_latent, xdit_latent)
    assert ran_in_comfyui > 0 and len(runs) == ran_in_comfyui
    plain = comfy.sample.sample(own, noise, 4, 2.5, "euler", "simple", *sides, latent, seed=2)
    assert (plain - own_latent).abs().max() > 1e-3


def tiny_chroma(tmp_path) -> tuple[str, object]:
    """The tiny Chroma as a file in the original layout, and ComfyUI's own model of it (its detection, the tiny
    sizes set)."""
    import torch
    from safetensors.torch import load_file, save_file

    from backend.test_chroma import TINY, original_state_dict
    from xdit_backend.models import registry

    path = str(tmp_path / "tiny-chroma.safetensors")
    save_file(original_state_dict(registry.build("chroma-tiny", torch.device("cpu")).transformer), path)
    width = TINY["num_attention_heads"] * TINY["attention_head_dim"]
    return path, comfyuis_model(load_file(path), hidden_size=width, num_heads=TINY["num_attention_heads"],
                                context_in_dim=64, axes_dim=list(TINY["axes_dims_rope"]), out_dim=width,
                                hidden_dim=TINY["approximator_hidden_dim"], n_layers=TINY["approximator_layers"])


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"cfg": 2}], ids=["ulysses", "cfg"])
def test_chroma_gives_comfyuis_latent(backend2, pack, tmp_path, layout):
    """A tiny Chroma file in the original layout: KSampler on ComfyUI's own Chroma (its detection, the tiny sizes
    set) and on the xDiT Model, cfg 3, FluxGuidance 4 on the positive side (ComfyUI's default 0 on the other)."""
    import torch

    path, own = tiny_chroma(tmp_path)
    # CLIPTextEncode with Chroma's T5 gives no pooled vector (pooled_output None)
    positive, negative = prompts(12, pooled=None, pooled_output=(None, None), guidance=(4.0, 0.0))
    sample_both(own, xdit_model(pack, path, backend2, layout), torch.zeros(1, 16, 8, 8), 5, 4, 3.0, "euler",
                positive, negative)


def test_chroma_on_the_xdit_sampler_gives_comfyuis_latent(backend2, pack, tmp_path):
    """The same tiny Chroma under the xDiT Sampler (ring=2), its prompts translated by the nodes (T5 alone: ComfyUI's
    pooled_output None), against KSampler on ComfyUI's own Chroma."""
    import comfy.sample
    import torch

    path, own = tiny_chroma(tmp_path)
    positive, negative = prompts(13, pooled=None, pooled_output=(None, None))
    latent = torch.zeros(1, 16, 8, 8)
    noise = comfy.sample.prepare_noise(latent, 6)
    theirs = comfy.sample.sample(own, noise, 4, 3.0, "euler", "simple", positive, negative, latent, seed=6)
    request = {"model": path, "dtype": "float32", "width": 64, "height": 64, "steps": 4, "seed": 6, "cfg": 3.0,
               "sampler": "euler", "scheduler": "simple", "parallel": {"ring": 2}}
    result, _ = backend2.sample(request, sampler_tensors(path, positive, negative))
    assert_same(theirs, result["samples"])
