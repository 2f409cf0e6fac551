"""The ``evaluate`` request (one model call of ComfyUI's sampler: the xDiT MODEL) on a running backend: every
layout equals the serial model call computed here, the conditioning travels once and is then referenced by its
content hash, and what the backend does not hold is sent again."""

import pytest
import torch

from xdit_backend.client import BackendError
from xdit_backend.distributed.config import ParallelConfig
from xdit_backend.models.resolved import resolve_model
from xdit_backend.wire.content_hash import content_hash


def call(rows: int = 2, h: int = 8, w: int = 8, seed: int = 0, guidance: bool = True):
    """A flux-tiny model call: x [rows, 16, h, w], timestep [rows], guidance [rows]; context, pooled."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"x": torch.randn(rows, 16, h, w, generator=generator),
               "timestep": torch.rand(rows, generator=generator)}
    if guidance:
        tensors["guidance"] = torch.tensor([3.5, 2.0, 5.0, 1.0][:rows] + [3.5] * max(0, rows - 4))
    inputs = {"context": torch.randn(rows, 8, 64, generator=generator),
              "pooled": torch.randn(rows, 32, generator=generator)}
    return tensors, inputs


_SERIAL = {}


def serial(tensors: dict, inputs: dict) -> torch.Tensor:
    """The model call computed in this process, at world 1, without the backend."""
    from xdit_backend.parallel.evaluation import Evaluation

    if "flux-tiny" not in _SERIAL:
        _SERIAL["flux-tiny"] = resolve_model("flux-tiny").build(torch.device("cpu"), torch.float32)
    return Evaluation(_SERIAL["flux-tiny"]).run(tensors["x"], tensors["timestep"], inputs, tensors.get("guidance"))


FIELDS = {"model": "flux-tiny", "dtype": "float32"}


def test_a_call_at_world_1_equals_the_serial_call_and_sends_the_conditioning_once(backend1):
    tensors, inputs = call()
    backend1.inputs_sent.clear()
    out, info = backend1.evaluate(FIELDS, tensors, inputs)
    assert out.shape == tensors["x"].shape
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5
    assert set(backend1.inputs_sent) == {content_hash(t) for t in inputs.values()}
    # the next call names the inputs only; an unknown hash is refused, and the client sends them again
    sent = []
    original = backend1._request
    def recorded(kind, fields, tensors, *rest):
        sent.append(sorted(tensors))
        return original(kind, fields, tensors, *rest)

    backend1._request = recorded
    try:
        again, _ = backend1.evaluate(FIELDS, tensors, inputs)
        backend1.inputs_sent.add("h" + "0" * 32)
        fresh = {"context": inputs["context"] + 1, "pooled": inputs["pooled"]}
        backend1.inputs_sent.add(content_hash(fresh["context"]))  # the client believes it sent it; it did not
        third, _ = backend1.evaluate(FIELDS, tensors, fresh)
    finally:
        backend1._request = original
    assert torch.equal(again, out)
    assert sent[0] == ["guidance", "timestep", "x"]  # no conditioning: held by the backend
    assert len(sent) == 3 and len(sent[2]) == 5  # refused as missing, then sent with both inputs inline
    assert (third - serial(tensors, fresh)).abs().max() <= 1e-5


def test_an_area_crop_of_odd_size_is_padded_to_the_patch_as_comfyui_pads_it(backend1):
    tensors, inputs = call(rows=1, h=7, w=5)
    out, _ = backend1.evaluate(FIELDS, tensors, inputs)
    assert out.shape == (1, 16, 7, 5)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}, {"dp": 2},
                                    {"ulysses": 2, "shard_weights": True}])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_every_layout_equals_the_serial_call(backend2, layout, rows):
    tensors, inputs = call(rows=rows, seed=rows)
    fields = {**FIELDS, "parallel": ParallelConfig(**layout).to_json()}
    out, info = backend2.evaluate(fields, tensors, inputs)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5, info["layout"]
    assert info["rows"] == rows and info["world_size"] == 2


def test_a_tampered_input_is_refused_with_the_reason(backend2):
    tensors, inputs = call()
    name = content_hash(inputs["context"])
    request = {**FIELDS, "inputs": {"context": name, "pooled": content_hash(inputs["pooled"])}}
    tampered = {**tensors, name: inputs["context"] + 1, content_hash(inputs["pooled"]): inputs["pooled"]}
    with pytest.raises(BackendError, match="does not hash to its name"):
        backend2._request("evaluate", request, tampered, None, None, None)


def test_status_counts_the_calls_per_model(backend1):
    tensors, inputs = call(rows=1)
    backend1.evaluate(FIELDS, tensors, inputs)
    before = backend1.status()["evaluations"].get("flux-tiny", 0)
    backend1.evaluate(FIELDS, tensors, inputs)
    status = backend1.status()
    assert status["evaluations"]["flux-tiny"] == before + 1
    assert "flux-tiny" in {m["name"] for m in status["models"]}


def euler_through_calls(client, fields: dict, conditioning: dict, steps: int, cfg: float, seed: int,
                        cache: dict) -> tuple[torch.Tensor, list]:
    """KSampler's Euler with cfg (cond and uncond batched, cond first, as ComfyUI batches them) for flux-tiny at
    64², one evaluate request per step, as the xDiT MODEL's stand-in sends them; the final latent in VAE space and
    each call's info."""
    from xdit_backend.sampling import schedulers
    from xdit_backend.sampling.generate import comfy_noise

    spec = resolve_model("flux-tiny").spec
    sampling = spec.model_sampling(None)
    sigmas = schedulers.sigmas("simple", sampling, steps, 1.0, sampler="euler").float()
    shape = spec.latent_shape(1, 64, 64)
    x = sampling.noise_scaling(sigmas[0], comfy_noise(shape, seed), torch.zeros(shape))
    inputs = {key: torch.cat([value, conditioning[f"negative_{key}"]]) for key, value in conditioning.items()
              if not key.startswith("negative_")}  # context, pooled (and reference_0, …): cond rows first
    infos = []
    for i in range(steps):
        sigma = sigmas[i:i + 1].expand(2)
        tensors = {"x": sampling.calculate_input(sigma, torch.cat([x, x])), "timestep": sampling.timestep(sigma),
                   "guidance": torch.full((2,), 3.5)}
        position = {"generation": "run-1", "step": i, "steps": steps, "slot": 0, "cond_start": 0, "cond_rows": 1}
        out, info = client.evaluate({**fields, **cache, **position}, tensors, inputs)
        infos.append(info)
        cond, uncond = sampling.calculate_denoised(sigma, out, torch.cat([x, x])).chunk(2)
        denoised = uncond + (cond - uncond) * cfg
        x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    return spec.latent_format.process_out(sampling.inverse_noise_scaling(sigmas[-1], x)), infos


@pytest.mark.parametrize("world, layout", [(1, {}), (2, {"ulysses": 2}), (2, {"cfg": 2}), (2, {"pipefusion": 2})])
def test_the_step_cache_across_calls_decides_as_the_xdit_samplers_and_gives_its_latent(backend, world, layout):
    """The xDiT MODEL's calls with a step cache (fbcache): the backend keeps one cache for the run across its calls
    and decides at the same steps as the xDiT Sampler's loop with the same cache, every rank agreeing, so the two
    give the same latent and the same counts, some steps reused."""
    from conftest import flux_tiny_conditioning

    client = backend(world)
    conditioning = {k: v[:1] for k, v in flux_tiny_conditioning(seed=3).items()}
    cache = {"cache": "fbcache", "cache_threshold": 0.5, "cache_start": 1, "cache_end": 1}
    parallel = ParallelConfig(**layout).to_json() if layout else {}
    sample = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 8, "seed": 4, "cfg": 2.5, "dtype": "float32",
              "parallel": parallel, **cache}
    result, info = client.sample(sample, conditioning)
    latent, infos = euler_through_calls(client, {**FIELDS, "parallel": parallel}, conditioning, 8, 2.5, 4, cache)
    assert infos[-1]["cache"] == info["cache"] and info["cache"]["reused"] > 0, ([i["cache"] for i in infos], info)
    assert (latent - result["samples"]).abs().max() <= 1e-5


@pytest.mark.parametrize("layout", [{"pipefusion": 2}, {"pipefusion": 2, "num_pipeline_patch": 4, "warmup_steps": 2},
                                    {"pipefusion": 2, "warmup_steps": 0}])
def test_pipefusion_across_the_calls_of_a_run_gives_the_xdit_samplers_pipefusion_latent(backend2, layout):
    """Each call one step of PipeFusion, its patches attending to the K/V the run's previous call left: the same
    latent as the xDiT Sampler's PipeFusion loop at the same settings (whose patches see the same K/V), and not the
    serial one (the stale K/V are used)."""
    from conftest import flux_tiny_conditioning

    conditioning = {k: v[:1] for k, v in flux_tiny_conditioning(seed=5).items()}
    parallel = ParallelConfig(**layout).to_json()
    sample = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 6, "seed": 2, "cfg": 2.5, "dtype": "float32"}
    pipelined, _ = backend2.sample({**sample, "parallel": parallel}, conditioning)
    serial_latent, _ = backend2.sample({**sample, "parallel": ParallelConfig(ulysses=2).to_json()}, conditioning)
    latent, infos = euler_through_calls(backend2, {**FIELDS, "parallel": parallel}, conditioning, 6, 2.5, 2, {})
    assert "pipefusion=2" in infos[-1]["layout"]
    assert (latent - pipelined["samples"]).abs().max() <= 1e-5
    assert (latent - serial_latent["samples"]).abs().max() > 1e-4  # stale K/V: PipeFusion's approximation


def test_pipefusion_calls_with_a_reference_give_the_xdit_samplers_pipefusion_latent(backend2):
    """A Kontext edit (flux-tiny given a reference latent) under PipeFusion, 4 patches after 2 warm-up steps: the
    reference tokens travel with each call's first patch as with each step's under the xDiT Sampler, and the two give
    the same latent."""
    from conftest import flux_tiny_conditioning

    conditioning = {k: v[:1] for k, v in flux_tiny_conditioning(seed=5).items()}
    reference = torch.randn(1, 16, 6, 10, generator=torch.Generator().manual_seed(6))  # 15 tokens beside the 16
    conditioning.update(reference_0=reference, negative_reference_0=reference)
    parallel = ParallelConfig(pipefusion=2, num_pipeline_patch=4, warmup_steps=2).to_json()
    sample = {"model": "flux-tiny", "width": 64, "height": 64, "steps": 6, "seed": 2, "cfg": 2.5, "dtype": "float32"}
    pipelined, _ = backend2.sample({**sample, "parallel": parallel}, conditioning)
    latent, _ = euler_through_calls(backend2, {**FIELDS, "parallel": parallel}, conditioning, 6, 2.5, 2, {})
    assert (latent - pipelined["samples"]).abs().max() <= 1e-5


def test_pipefusion_warmed_up_over_every_call_equals_the_serial_call(backend2):
    tensors, inputs = call(rows=2, seed=4)
    fields = {**FIELDS, "parallel": ParallelConfig(pipefusion=2, warmup_steps=1).to_json(), "generation": "run-w",
              "steps": 4}
    out, _ = backend2.evaluate(fields, tensors, inputs)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5


def test_pipefusion_refuses_calls_that_are_not_the_steps_of_a_run(backend2):
    tensors, inputs = call()
    fields = {**FIELDS, "parallel": ParallelConfig(pipefusion=2).to_json()}
    with pytest.raises(BackendError, match="does not say which sampling run and step"):
        backend2.evaluate(fields, tensors, inputs)
    run = {**fields, "generation": "run-s", "step": 3, "steps": 8}
    backend2.evaluate(run, tensors, inputs)
    with pytest.raises(BackendError, match="model call 2 of step 3; PipeFusion's patches attend"):
        backend2.evaluate({**run, "slot": 1}, tensors, inputs)
    out, _ = backend2.evaluate({**FIELDS, "parallel": ParallelConfig(ulysses=2).to_json()}, tensors, inputs)
    assert (out - serial(tensors, inputs)).abs().max() <= 1e-5  # serving on


def test_careless_and_hostile_calls_are_refused_by_name_and_the_backend_serves_on(backend1):
    tensors, inputs = call(rows=1)
    names = {key: content_hash(t) for key, t in inputs.items()}
    inline = {names[key]: t for key, t in inputs.items()}
    good = {**FIELDS, "inputs": names}
    cases = [  # (fields, tensors, what the message says)
        (good, {"timestep": tensors["timestep"], **inline}, "carries the tensors x and timestep"),
        (good, {**tensors, "x": torch.randn(1, 15, 8, 8), **inline}, "with C = 16"),
        (good, {**tensors, "x": torch.randn(1, 16, 8), **inline}, "[N, C, h, w]"),
        (good, {**tensors, "timestep": torch.tensor([float("nan")]), **inline}, "NaN or infinite"),
        (good, {**tensors, "timestep": torch.rand(2), **inline}, "one per row of x"),
        (good, {**tensors, "stray": torch.zeros(1), **inline}, "unknown tensors"),
        ({**good, "inputs": {"context": "not-a-hash"}}, tensors, "is not a content hash"),
        ({**good, "inputs": {**names, "mask": names["context"]}}, {**tensors, **inline}, "takes no 'mask'"),
        ({**good, "inputs": {"pooled": names["pooled"]}}, {**tensors, names["pooled"]: inputs["pooled"]},
         "have no 'context'"),
        ({**good, "inputs": {"context": content_hash(torch.randn(2, 8, 64)), "pooled": names["pooled"]}},
         {**tensors, content_hash(torch.randn(2, 8, 64)): torch.randn(2, 8, 64), **inline}, "not among"),
        ({**good, "step": -1}, {**tensors, **inline}, "out of range"),
        ({**good, "cache": "nonsense"}, {**tensors, **inline}, "is not supported"),
    ]
    for fields, sent, says in cases:
        with pytest.raises(BackendError) as refused:
            backend1._request("evaluate", fields, sent, None, None, None)
        assert refused.value.kind == "bad_request" and says in refused.value.message, (says, refused.value.message)
    out, _ = backend1.evaluate(FIELDS, tensors, inputs)
    assert out.shape == tensors["x"].shape


def test_every_call_is_sized_before_anything_is_allocated(monkeypatch):
    """Issue 25's rule on the xDiT Model's calls: with the model loaded, a call of many large rows is refused by the
    fit check (out of memory, its bytes named) where a small one under the same budget runs; nothing is computed
    for the refused one."""
    from datetime import timedelta
    from types import SimpleNamespace

    from xdit_backend.memory import fit as memory_fit
    from xdit_backend.service.evaluate_request import EvaluateRequest
    from xdit_backend.service.executor import Executor
    from xdit_backend.wire.protocol import Message

    executor = Executor(SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1, local_world_size=1,
                                        control=None, timeout=timedelta(seconds=60), local_rank=0,
                                        data_backend="gloo"))

    def request(rows: int, side: int) -> EvaluateRequest:
        tensors, inputs = call(rows=rows, h=side, w=side)
        names = {key: content_hash(t) for key, t in inputs.items()}
        return EvaluateRequest.parse(Message("evaluate", {**FIELDS, "inputs": names},
                                             {**tensors, **{names[k]: t for k, t in inputs.items()}}))

    small = request(1, 8)
    model = resolve_model("flux-tiny")
    estimate = memory_fit.needed(model, torch.float32, "default", 1, None, 16 + 8, 1)
    monkeypatch.setenv(memory_fit.TEST_BUDGET_ENV, str(int(estimate.total * 1.5)))
    assert executor.evaluate(small).shape == small.x.shape
    calls = executor.evaluations["flux-tiny"]
    with pytest.raises(memory_fit.NotEnoughMemory) as refused:
        executor.evaluate(request(64, 256))
    assert "flux-tiny" in refused.value.message and executor.evaluations["flux-tiny"] == calls


def test_pipefusion_calls_with_concatenated_channels_give_the_xdit_samplers_pipefusion_latent(backend2):
    """wan-i2v-tiny under PipeFusion with two patches after one warm-up step: the xDiT Sampler cuts the
    concatenated channels (built on the backend from the start latent and mask) into each patch's band; the xDiT
    Model's calls bring them concatenated by the caller, as ComfyUI does. The same latent both ways."""
    from xdit_backend.models import registry
    from xdit_backend.sampling import schedulers
    from xdit_backend.sampling.generate import comfy_noise

    name, steps, cfg, seed = "wan-i2v-tiny", 4, 3.0, 5
    model = resolve_model(name).build(torch.device("cpu"), torch.float32)
    spec, sampling = model.spec, model.spec.model_sampling(None)
    shape = spec.latent_shape(1, 64, 64, 5)  # [1, 16, 2, 8, 8]
    positive, negative = registry.random_conditioning(name, 1, 3, spec, latent=shape)
    parallel = ParallelConfig(pipefusion=2, warmup_steps=1).to_json()
    sample = {"model": name, "width": 64, "height": 64, "frames": 5, "steps": steps, "seed": seed, "cfg": cfg,
              "dtype": "float32", "parallel": parallel}
    tensors = {**positive, **{f"negative_{key}": value for key, value in negative.items()}}
    pipelined, _ = backend2.sample(sample, tensors)

    sigmas = schedulers.sigmas("simple", sampling, steps, 1.0, sampler="euler").float()
    x = sampling.noise_scaling(sigmas[0], comfy_noise(shape, seed), torch.zeros(shape))
    concat = torch.cat([model.concat(shape, positive), model.concat(shape, negative)])  # [2, 20, 2, 8, 8]
    inputs = {key: torch.cat([positive[key], negative[key]]) for key in ("context", "clip_vision_output")}
    for i in range(steps):
        sigma = sigmas[i:i + 1].expand(2)
        call = {"x": torch.cat([sampling.calculate_input(sigma, torch.cat([x, x])), concat], dim=1),
                "timestep": sampling.timestep(sigma)}
        position = {"generation": "run-i2v", "step": i, "steps": steps}
        out, _ = backend2.evaluate({"model": name, "dtype": "float32", "parallel": parallel, **position}, call, inputs)
        cond, uncond = sampling.calculate_denoised(sigma, out, torch.cat([x, x])).chunk(2)
        x = x + (x - (uncond + (cond - uncond) * cfg)) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    latent = spec.latent_format.process_out(sampling.inverse_noise_scaling(sigmas[-1], x))
    assert (latent - pipelined["samples"]).abs().max() <= 1e-4


@pytest.mark.parametrize("layout", [{"ulysses": 2}, {"ring": 2}, {"cfg": 2}])
def test_a_call_with_a_controlnet_equals_the_serial_call_with_it(backend2, layout):
    """A call carrying ComfyUI's Apply ControlNet (flux-controlnet-tiny, union type 3, its latent an input): each
    layout equals the serial call with that ControlNet applied, which the ControlNet moved."""
    from xdit_backend.models import model_patch

    tensors, inputs = call(rows=2, h=8, w=12, seed=4)
    control = torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(9))
    entry = {"path": "flux-controlnet-tiny", "strength": 0.7, "type": 3}
    out, _ = backend2.evaluate({**FIELDS, "controls": [entry], "parallel": layout}, tensors,
                               {**inputs, "control_0": control})
    model = resolve_model("flux-tiny").build(torch.device("cpu"), torch.float32)
    spec = model_patch.PatchSpec("flux-controlnet-tiny", 0.7, mode=3)
    model.model_patches = [model_patch.applied(spec, model_patch.network(spec, model.device, model.dtype), control, 0,
                                               (8, 12), model, model.spec.model_sampling(None))]
    from xdit_backend.parallel.evaluation import Evaluation

    expected = Evaluation(model).run(tensors["x"], tensors["timestep"], inputs, tensors["guidance"])
    assert (out - expected).abs().max() <= 1e-4
    assert (expected - serial(tensors, inputs)).abs().max() > 1e-2


def test_a_call_whose_controls_the_backend_cannot_run_is_refused_by_name(backend1):
    tensors, inputs = call(rows=1, h=8, w=8, seed=5)
    entry = {"path": "qwen-image-controlnet-tiny", "strength": 0.7}
    with pytest.raises(BackendError, match="is a qwen_image ControlNet, but flux-tiny is a flux model"):
        backend1.evaluate({**FIELDS, "controls": [entry]}, tensors, {**inputs, "control_0": torch.zeros(1, 16, 8, 8)})
    with pytest.raises(BackendError, match=r"control_0 has shape \[1, 16, 4, 4\]; it must be one latent"):
        backend1.evaluate({**FIELDS, "controls": [{**entry, "path": "flux-controlnet-tiny"}]}, tensors,
                          {**inputs, "control_0": torch.zeros(1, 16, 4, 4)})
