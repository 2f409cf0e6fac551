"""The pack in the real ComfyUI, driven headless the way a studio drives it: POST /prompt with the
API-format workflows, websocket progress, /history, /interrupt.

Runs when COMFYUI_DIR points at a ComfyUI checkout whose requirements are importable by this
Python (on machines without torchvision, put the host's import shim on PYTHONPATH; it is passed
on to ComfyUI). ComfyUI runs on the CPU from a private base directory with the pack linked into
its custom_nodes, and the pack's backend uses a private socket.
"""

import json
import os
import time
import urllib.request

import pytest
import torch

from host.conftest import COMFYUI_DIR, FLUX_TINY, QWEN_TINY, WORKFLOWS, Host

pytestmark = pytest.mark.skipif(not COMFYUI_DIR, reason="needs a ComfyUI checkout: set COMFYUI_DIR "
                                "(and run with a Python that has ComfyUI's requirements) to test the pack in ComfyUI")


def load_api(name: str) -> dict:
    return json.loads((WORKFLOWS / "api" / name).read_text())


def nodes_of(prompt: dict, class_type: str) -> list[str]:
    return [key for key, node in prompt.items() if node["class_type"] == class_type]


def test_the_pack_registers_its_nodes_in_comfyui(host):
    info = host.get("/object_info")
    for node in ("XDiTLoadDiffusionModel", "XDiTLoraLoader", "XDiTStepCache", "XDiTLTX2Guidance", "XDiTParallelConfig",
                 "XDiTSampler",
                 "XDiTSamplerAdvanced", "XDiTBackend", "XDiTStandInConditioning"):
        assert node in info, node
    sampler = info["XDiTSampler"]["input"]
    assert list(sampler["required"]) == ["model", "seed", "steps", "cfg", "sampler_name", "scheduler",
                                         "latent_image", "denoise"]
    assert "[test] flux-tiny" in info["XDiTLoadDiffusionModel"]["input"]["required"]["model_name"][1]["options"]
    lines = [line for line in (host.base / "comfyui.log").read_text().splitlines() if "comfyui-xdit" in line]
    assert lines and not any("IMPORT FAILED" in line for line in lines), lines


def test_the_nodes_lists_of_families_are_the_registrys(host):
    """Issue 30: the loader's description named 4 of the families and the pipefusion tooltip "(Flux)". Both are
    made from the registry: each family in it is listed, and each listed name is a family's."""
    from xdit_backend.models.registry import FAMILIES, family_names

    info = host.get("/object_info")
    described = info["XDiTLoadDiffusionModel"]["description"]
    listed = described[described.index("runs (") + len("runs ("):described.index("), from")]
    assert listed == ", ".join(family_names()) and len(family_names()) == len(FAMILIES)
    tooltip = info["XDiTParallelConfig"]["input"]["required"]["pipefusion"][1]["tooltip"]
    assert tooltip.endswith("(" + ", ".join(family_names("pipefusion")) + ")")
    assert "LTX-2" not in tooltip and "Qwen-Image 2.1" in tooltip  # LTX-2 refuses PipeFusion, 2.1 runs it


def test_the_template_browser_lists_the_ui_workflows_only_each_loading_with_its_thumbnail(host):
    """Issue 30: the browser listed the API twins too, which empty the canvas ("does not contain a valid version").
    Each listed template loads through the route the page uses, is a UI workflow (a version, nodes and links), and
    has its thumbnail."""
    listed = host.get("/workflow_templates")["comfyui-xdit"]
    expected = sorted(path.stem for path in WORKFLOWS.glob("*.json"))
    assert sorted(listed) == expected and not any(name.endswith(".api") for name in listed)
    for name in listed:
        workflow = host.get(f"/api/workflow_templates/comfyui-xdit/{name}.json")
        assert "version" in workflow and workflow["nodes"] and "links" in workflow, name
        with urllib.request.urlopen(f"{host.url}/api/workflow_templates/comfyui-xdit/{name}.jpg", timeout=30) as reply:
            assert reply.read(3) == b"\xff\xd8\xff", name  # a JPEG


def test_the_sampler_and_the_backend_node_return_their_text_for_the_node(host):
    """Issue 30: the layout that ran (and auto's reason), the time, and — with auto on and degrees set anyway — that
    those degrees were not used; the page shows it on the node (web/xdit.js, which ComfyUI serves)."""
    stop = host.queue({"backend": {"class_type": "XDiTBackend", "inputs": {"action": "stop backend"}}})
    assert host.follow(stop)[0] == "success", host.why(stop)  # so this prompt starts one (the host is the session's)
    log_path = host.base / "comfyui.log"
    before = len(log_path.read_bytes())
    prompt = load_api(f"{FLUX_TINY}.api.json")
    config = nodes_of(prompt, "XDiTParallelConfig")[0]
    prompt[config]["inputs"].update(auto=True, ulysses=2)
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    outputs = host.history(prompt_id)["outputs"]
    text = "\n".join(outputs[nodes_of(prompt, "XDiTSampler")[0]]["text"])
    assert text.startswith("world ") and "auto" in text and " s, including the queue" in text
    assert "auto is on, so ulysses=2 on the xDiT Parallel Config are not used" in text
    assert "/extensions/comfyui-xdit/xdit.js" in host.get("/extensions")
    # the waits before the first step were told (console; on the page, under the node): this prompt started the
    # backend, stopped above; only what the console printed since is read
    log = log_path.read_bytes()[before:].decode()
    assert "xDiT: starting the xDiT backend" in log and "xDiT: backend ready in" in log


def test_a_layout_error_in_comfyui_speaks_of_the_nodes_not_of_cli_flags(host):
    """Issue 30: "start the backend with --nproc 3; or use --parallel auto" in ComfyUI, where there is no such flag.
    The error words its fix for the nodes (the xDiT Parallel Config's widgets, the xDiT Backend node's action)."""
    prompt = load_api(f"{FLUX_TINY}.api.json")
    config = nodes_of(prompt, "XDiTParallelConfig")[0]
    prompt[config]["inputs"].update(auto=False, ulysses=3)  # the backend the nodes start here has 2 ranks
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "error"
    said = host.why(prompt_id)
    assert "multiply to 3" in said and "on the xDiT Parallel Config, set ulysses to 2" in said, said
    assert "stop backend" in said and "--nproc" not in said and "--parallel" not in said and "xdit-backend" not in said


@pytest.mark.parametrize("name,missing", [("gone.safetensors", "is not in ComfyUI's models/diffusion_models"),
                                          ("[test] no-such-tiny", "no such built-in test model")])
def test_a_missing_model_file_is_refused_when_the_prompt_is_queued(host, name, missing):
    """Issue 30: the loader's file was only found missing when the prompt ran; ComfyUI's validation now refuses the
    prompt when it is queued (400, the node's error), and a file that is there passes it."""
    prompt = load_api(f"{FLUX_TINY}.api.json")
    loader = nodes_of(prompt, "XDiTLoadDiffusionModel")[0]
    prompt[loader]["inputs"]["model_name"] = name
    with pytest.raises(AssertionError) as refused:
        host.queue(prompt)
    assert "400" in str(refused.value) and missing in str(refused.value) and "custom_validation_failed" in str(
        refused.value)
    assert str(refused.value).count(missing) == 1  # said once: for model_name, not for every input


# The saved latent's frame axes, as KSampler gives them: Qwen-Image's latent format is Wan 2.1's,
# a video format (latent_dimensions 3), so ComfyUI samples an EmptySD3LatentImage as one frame,
# [B, 16, 1, h, w] (comfy/sample.py fix_empty_latent_channels; comfy/latent_formats.py Wan21).
TINY_WORKFLOWS = {FLUX_TINY: (), QWEN_TINY: (1,)}


@pytest.mark.parametrize("name", TINY_WORKFLOWS)
def test_the_tiny_workflow_runs_with_progress_and_a_latent(host, name):
    prompt = load_api(f"{name}.api.json")
    prompt_id = host.queue(prompt)
    outcome, progress = host.follow(prompt_id)
    assert outcome == "success", host.why(prompt_id)
    steps = prompt[nodes_of(prompt, "XDiTSampler")[0]]["inputs"]["steps"]
    assert (steps, steps) in progress and len(progress) >= steps  # the bar moved every step
    latent = host.latest_latent(prompt[nodes_of(prompt, "SaveLatent")[0]]["inputs"]["filename_prefix"].split("/")[-1])
    empty = prompt[nodes_of(prompt, "EmptySD3LatentImage")[0]]["inputs"]
    frames = TINY_WORKFLOWS[name]
    assert latent.shape == (empty["batch_size"], 16, *frames, empty["height"] // 8, empty["width"] // 8)
    assert torch.isfinite(latent).all() and latent.abs().max() > 0


def test_a_bad_parallel_config_reaches_history_readably(host):
    prompt = load_api(f"{FLUX_TINY}.api.json")
    config = nodes_of(prompt, "XDiTParallelConfig")[0]
    prompt[config]["inputs"].update({"auto": False, "ulysses": 3})
    prompt_id = host.queue(prompt)
    outcome, _ = host.follow(prompt_id)
    assert outcome == "error"
    error = host.error_of(prompt_id)
    assert error["node_type"] == "XDiTSampler"
    assert "ulysses" in error["exception_message"] and "Traceback" not in error["exception_message"]
    # ComfyUI and the backend both keep going: the same workflow, fixed, runs
    assert host.follow(host.queue(load_api(f"{FLUX_TINY}.api.json")))[0] == "success"


def test_interrupt_stops_a_long_run_and_the_backend_keeps_serving(host):
    prompt = load_api(f"{FLUX_TINY}.api.json")
    sampler = nodes_of(prompt, "XDiTSampler")[0]
    prompt[sampler]["inputs"]["steps"] = 2000
    seen = []

    def interrupt_once(data):
        if not seen:
            seen.append(data)
            host.post("/interrupt", {})

    started = time.monotonic()
    outcome, progress = host.follow(host.queue(prompt), on_progress=interrupt_once)
    assert outcome == "interrupted" and progress[-1][0] < 2000
    assert time.monotonic() - started < 120
    assert host.follow(host.queue(load_api(f"{FLUX_TINY}.api.json")))[0] == "success"


def test_xdit_sampler_gives_ksamplers_latent_on_the_same_file(host):
    """The tiny SD3-layout file through ComfyUI's own loader and KSampler, and through the xDiT
    loader and sampler (ulysses=2): the same latent. Times from POST to success are printed."""
    common = {
        "cond": {"class_type": "XDiTStandInConditioning",
                 "inputs": {"seed": 5, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
        "uncond": {"class_type": "XDiTStandInConditioning",
                   "inputs": {"seed": 6, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
        "empty": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}},
    }
    sampling = {"seed": 11, "steps": 8, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0,
                "positive": ["cond", 0], "negative": ["uncond", 0], "latent_image": ["empty", 0]}
    comfy = {**common,
             "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny-sd3.safetensors",
                                                             "weight_dtype": "default"}},
             "ksampler": {"class_type": "KSampler", "inputs": {"model": ["unet", 0], **sampling}},
             "save": {"class_type": "SaveLatent", "inputs": {"samples": ["ksampler", 0],
                                                             "filename_prefix": "latents/ksampler"}}}
    xdit = {**common,
            "load": {"class_type": "XDiTLoadDiffusionModel", "inputs": {"model_name": "tiny-sd3.safetensors",
                                                                        "weight_dtype": "fp32"}},
            "parallel": {"class_type": "XDiTParallelConfig",
                         "inputs": {"gpus": "", "auto": False, "ulysses": 2, "ring": 1, "pipefusion": 1,
                                    "num_pipeline_patch": 0, "warmup_steps": 1, "cfg_parallel": False, "dp": 1}},
            "xsampler": {"class_type": "XDiTSampler", "inputs": {"model": ["load", 0], "parallel": ["parallel", 0],
                                                                 **sampling}},
            "save": {"class_type": "SaveLatent", "inputs": {"samples": ["xsampler", 0],
                                                            "filename_prefix": "latents/xdit"}}}
    times = {}
    for name, prompt in (("ksampler", comfy), ("xdit", xdit), ("ksampler", comfy), ("xdit", xdit)):
        prompt = json.loads(json.dumps(prompt))
        prompt["cond"]["inputs"]["seed"] += len(times.get(name, []))  # not cached: a new run each time
        started = time.monotonic()
        outcome, _ = host.follow(host.queue(prompt))
        assert outcome == "success", name
        times.setdefault(name, []).append(time.monotonic() - started)
    difference = (host.latest_latent("ksampler") - host.latest_latent("xdit")).abs().max().item()
    print(f"\nPOST /prompt → success, tiny SD3 128², 8 steps (first, second run): KSampler "
          f"{times['ksampler'][0]:.2f} s, {times['ksampler'][1]:.2f} s; xDiT Sampler (ulysses=2) "
          f"{times['xdit'][0]:.2f} s, {times['xdit'][1]:.2f} s; max |KSampler − xDiT| = {difference:.3g}")
    assert difference <= 1e-4


def test_the_step_cache_node_offers_the_schemas_methods_and_defaults(host):
    from xdit_backend import schema

    inputs = host.get("/object_info/XDiTStepCache")["XDiTStepCache"]["input"]["required"]
    assert list(inputs) == ["model", "cache", "threshold", "start", "end"]
    assert inputs["cache"][1]["options"] == [m for m in schema.CACHE_METHODS if m != "none"]
    for name, field in (("start", "cache_start"), ("end", "cache_end")):
        assert inputs[name][1]["default"] == schema.FIELDS[field].default
    threshold = schema.FIELDS["cache_threshold"]
    assert (inputs["threshold"][1]["min"], inputs["threshold"][1]["max"]) == (threshold.low, threshold.high)
    assert all(str(value) in inputs["threshold"][1]["tooltip"] for value in schema.CACHE_THRESHOLDS.values())


def test_the_step_cache_node_reaches_the_backend(host):
    """Through ComfyUI: a cache that reuses steps changes the latent; the same cache with every step
    computed (start = steps) gives the uncached latent, so the sampler re-ran for a changed setting."""
    steps = 6

    def latent(prefix: str, cache: dict | None) -> torch.Tensor:
        prompt = xdit_on_tiny_sd3(seed=31)
        prompt["sampler"]["inputs"]["steps"] = steps
        prompt["save"]["inputs"]["filename_prefix"] = f"latents/{prefix}"
        if cache is not None:
            prompt["cache"] = {"class_type": "XDiTStepCache", "inputs": {"model": ["load", 0], **cache}}
            prompt["sampler"]["inputs"]["model"] = ["cache", 0]
        prompt_id = host.queue(prompt)
        assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
        return host.latest_latent(prefix)

    uncached = latent("step-cache-none", None)
    reusing = latent("step-cache-reusing", {"cache": "fbcache", "threshold": 10.0, "start": 1, "end": 1})
    computing = latent("step-cache-computing", {"cache": "fbcache", "threshold": 10.0, "start": steps, "end": 1})
    assert (reusing - uncached).abs().max() > 1e-3  # steps 2..5 reused
    assert torch.allclose(computing, uncached, rtol=0, atol=1e-6)


def xdit_on_tiny_sd3(seed: int = 1) -> dict:
    return {
        "cond": {"class_type": "XDiTStandInConditioning",
                 "inputs": {"seed": 5, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
        "empty": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "load": {"class_type": "XDiTLoadDiffusionModel", "inputs": {"model_name": "tiny-sd3.safetensors",
                                                                    "weight_dtype": "default"}},
        "sampler": {"class_type": "XDiTSampler",
                    "inputs": {"model": ["load", 0], "seed": seed, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
                               "scheduler": "simple", "denoise": 1.0, "positive": ["cond", 0],
                               "latent_image": ["empty", 0]}},
        "save": {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0], "filename_prefix": "latents/cache"}},
    }


def executed_nodes(host: Host, prompt_id: str) -> set[str]:
    """Nodes that ran (not taken from ComfyUI's cache) for a prompt."""
    cached = set()
    for kind, data in host.history(prompt_id)["status"]["messages"]:
        if kind == "execution_cached":
            cached |= set(data["nodes"])
    return {"cond", "empty", "load", "sampler", "save"} - cached


def test_caching_reruns_the_sampler_exactly_when_an_input_or_the_model_file_changes(host):
    model_file = host.base / "models" / "diffusion_models" / "tiny-sd3.safetensors"
    first = host.queue(xdit_on_tiny_sd3(seed=21))
    assert host.follow(first)[0] == "success"
    again = host.queue(xdit_on_tiny_sd3(seed=21))
    assert host.follow(again)[0] == "success" and "sampler" not in executed_nodes(host, again)
    new_seed = host.queue(xdit_on_tiny_sd3(seed=22))
    assert host.follow(new_seed)[0] == "success" and "sampler" in executed_nodes(host, new_seed)
    os.utime(model_file, ns=(time.time_ns(), time.time_ns()))  # the file was replaced (same name)
    replaced = host.queue(xdit_on_tiny_sd3(seed=22))
    assert host.follow(replaced)[0] == "success" and {"load", "sampler"} <= executed_nodes(host, replaced)


def test_the_backend_node_shows_status_unloads_and_stops(host):
    def run(action: str) -> str:
        prompt = {"backend": {"class_type": "XDiTBackend", "inputs": {"action": action}}}
        prompt_id = host.queue(prompt)
        assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
        return host.history(prompt_id)["outputs"]["backend"]["text"][0]

    assert host.follow(host.queue(xdit_on_tiny_sd3(seed=31)))[0] == "success"  # a backend with a model loaded
    status = run("status")
    assert "world size 2" in status and "tiny-sd3.safetensors" in status
    assert "rank 0: cpu" in status and "rank 1: cpu" in status and "  memory: " in status  # ranks, devices, memory
    assert "tiny-sd3.safetensors" in run("unload models")
    assert "stopped" in run("stop backend")
    assert "no backend" in run("status")
    assert host.follow(host.queue(xdit_on_tiny_sd3(seed=32)))[0] == "success"  # the next run starts it again

    # its "after" input orders it after a sampler: in the same prompt, it reports the backend that run left
    run("unload models")
    prompt = {**xdit_on_tiny_sd3(seed=33)}
    sampler = next(key for key, node in prompt.items() if node["class_type"] == "XDiTSampler")
    prompt["backend"] = {"class_type": "XDiTBackend", "inputs": {"action": "status", "after": [sampler, 0]}}
    prompt_id = host.queue(prompt)
    assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
    assert "tiny-sd3.safetensors" in host.history(prompt_id)["outputs"]["backend"]["text"][0]


def test_comfyuis_unload_models_also_unloads_the_backends(host):
    """POST /free {"unload_models": true}, as the page's "Unload Models" sends it: the backend started by
    the nodes (with their idle times: 30 minutes, 4 hours) shows no models loaded."""
    from xdit_backend.client import Client

    assert host.follow(host.queue(xdit_on_tiny_sd3(seed=41)))[0] == "success"
    client = Client(host.socket)
    status = client.status()
    assert any("tiny-sd3.safetensors" in str(model) for model in status["models"]), status["models"]
    assert (status["idle"]["unload_after_s"], status["idle"]["stop_after_s"]) == (1800.0, 14400.0)
    host.post("/api/free", {"unload_models": True})
    deadline = time.monotonic() + 60
    while client.status()["models"]:
        assert time.monotonic() < deadline, "the backend kept its models after POST /free"
        time.sleep(0.2)
    assert client.hello_or_none() is not None, "unloading must leave the backend running"


def test_flux_guidance_from_comfyuis_node_reaches_the_model(host):
    """FluxGuidance on the conditioning sets the Flux guidance embedding: 1.5 and 5.0 differ."""
    def run(guidance: float) -> torch.Tensor:
        prompt = {
            "cond": {"class_type": "XDiTStandInConditioning",
                     "inputs": {"seed": 2, "tokens": 8, "context_dim": 64, "pooled_dim": 32}},
            "guided": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["cond", 0], "guidance": guidance}},
            "empty": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
            "load": {"class_type": "XDiTLoadDiffusionModel", "inputs": {"model_name": "[test] flux-tiny",
                                                                        "weight_dtype": "default"}},
            "sampler": {"class_type": "XDiTSampler",
                        "inputs": {"model": ["load", 0], "seed": 3, "steps": 2, "cfg": 1.0, "sampler_name": "euler",
                                   "scheduler": "simple", "denoise": 1.0, "positive": ["guided", 0],
                                   "latent_image": ["empty", 0]}},
            "save": {"class_type": "SaveLatent", "inputs": {"samples": ["sampler", 0],
                                                            "filename_prefix": f"latents/guidance-{guidance}"}},
        }
        prompt_id = host.queue(prompt)
        assert host.follow(prompt_id)[0] == "success", host.why(prompt_id)
        return host.latest_latent(f"guidance-{guidance}")

    assert (run(1.5) - run(5.0)).abs().max() > 1e-3
