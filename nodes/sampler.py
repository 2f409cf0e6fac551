"""xDiT Sampler and xDiT Sampler (Advanced): KSampler's inputs, run by the multi-GPU backend.

They translate (nodes/translate.py), send one request through xdit_backend.client, move
ComfyUI's progress bar on every step and turn ComfyUI's Cancel into a backend cancel.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from socket import gethostname

from comfy_api.latest import io, ui

from xdit_backend import schema
from xdit_backend.schema import FIELDS, MAX_STEPS, SEED_RANGE

from . import comfy_controls, translate
from .choices import ParallelChoice
from .control import control_latent
from .comfy_types import CATEGORY, XDiTModel, XDiTParallel

log = logging.getLogger("comfyui-xdit")


def sampler_names() -> list[str]:
    from xdit_backend.sampling.samplers import SAMPLERS

    return list(SAMPLERS)


def scheduler_names() -> list[str]:
    from xdit_backend.sampling.schedulers import SCHEDULERS

    return list(SCHEDULERS)


def seed_range() -> dict:
    """The seed widget's settings: the request's seed default and range."""
    return {"default": FIELDS["seed"].default, "min": SEED_RANGE[0], "max": SEED_RANGE[1],
            "control_after_generate": True}


def common_inputs() -> list:
    steps, cfg = FIELDS["steps"], FIELDS["cfg"]
    return [
        io.Int.Input("seed", **seed_range()),
        io.Int.Input("steps", default=steps.default, min=steps.low, max=steps.high),
        io.Float.Input("cfg", default=8.0, min=cfg.low, max=cfg.high, step=0.1, round=0.01),  # KSampler's default
        io.Combo.Input("sampler_name", options=sampler_names()),
        io.Combo.Input("scheduler", options=scheduler_names()),
    ]


class XDiTSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        seed, steps, cfg, sampler_name, scheduler = common_inputs()
        return io.Schema(
            node_id="XDiTSampler",
            display_name="xDiT Sampler",
            category=CATEGORY,
            description="KSampler on several GPUs: the xDiT backend denoises in parallel and returns the latent "
                        "for VAE Decode. Same inputs, same math, same picture as KSampler.",
            inputs=[
                XDiTModel.Input("model"), seed, steps, cfg, sampler_name, scheduler,
                io.Conditioning.Input("positive", optional=True, tooltip="optional only for [test] models"),
                io.Conditioning.Input("negative", optional=True),
                io.Latent.Input("latent_image"),
                io.Float.Input("denoise", default=FIELDS["denoise"].default, min=FIELDS["denoise"].low,
                               max=FIELDS["denoise"].high, step=0.01),
                XDiTParallel.Input("parallel", optional=True, tooltip="default: all GPUs, layout chosen automatically"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],  # Apply ControlNet's files: comfy_controls
        )

    @classmethod
    def execute(cls, model, seed, steps, cfg, sampler_name, scheduler, latent_image, denoise=1.0,
                positive=None, negative=None, parallel=None) -> io.NodeOutput:
        fields = schema.fields(seed=seed, steps=steps, cfg=cfg, sampler=sampler_name, scheduler=scheduler,
                               denoise=denoise)
        latent, text = run(model, parallel, positive, negative, latent_image, fields,
                           graph=(cls.hidden.prompt, cls.hidden.unique_id))
        return io.NodeOutput(latent, ui=ui.PreviewText(text))


class XDiTSamplerAdvanced(io.ComfyNode):
    @classmethod
    def define_schema(cls):
        seed, steps, cfg, sampler_name, scheduler = common_inputs()
        seed = io.Int.Input("noise_seed", **seed_range())
        return io.Schema(
            node_id="XDiTSamplerAdvanced",
            display_name="xDiT Sampler (Advanced)",
            category=CATEGORY,
            description="KSamplerAdvanced on several GPUs: a step range (Wan 2.2's two experts), noise on or off, "
                        "leftover noise, and an optional SIGMAS input that replaces the scheduler.",
            inputs=[
                XDiTModel.Input("model"),
                io.Combo.Input("add_noise", options=["enable", "disable"]),
                seed, steps, cfg, sampler_name, scheduler,
                io.Conditioning.Input("positive", optional=True, tooltip="optional only for [test] models"),
                io.Conditioning.Input("negative", optional=True),
                io.Latent.Input("latent_image"),
                io.Int.Input("start_at_step", default=0, min=0, max=MAX_STEPS),
                io.Int.Input("end_at_step", default=MAX_STEPS, min=0, max=MAX_STEPS),
                io.Combo.Input("return_with_leftover_noise", options=["disable", "enable"]),
                io.Sigmas.Input("sigmas", optional=True, tooltip="replaces steps and scheduler (any scheduler node)"),
                XDiTParallel.Input("parallel", optional=True, tooltip="default: all GPUs, layout chosen automatically"),
            ],
            outputs=[io.Latent.Output()],
            hidden=[io.Hidden.prompt, io.Hidden.unique_id],  # Apply ControlNet's files: comfy_controls
        )

    @classmethod
    def execute(cls, model, add_noise, noise_seed, steps, cfg, sampler_name, scheduler, latent_image,
                start_at_step, end_at_step, return_with_leftover_noise, positive=None, negative=None,
                sigmas=None, parallel=None) -> io.NodeOutput:
        end_step = end_at_step if end_at_step < steps else None  # KSamplerAdvanced's default 10000: to the end
        fields = schema.fields(seed=noise_seed, steps=steps, cfg=cfg, sampler=sampler_name, scheduler=scheduler,
                               add_noise=add_noise == "enable", start_step=start_at_step, end_step=end_step,
                               return_with_leftover_noise=return_with_leftover_noise == "enable")
        extra = {}
        if sigmas is not None:
            extra["sigmas"] = sigmas.detach().to("cpu").float().contiguous()
            fields["steps"] = len(sigmas) - 1
        latent, text = run(model, parallel, positive, negative, latent_image, fields, extra,
                           graph=(cls.hidden.prompt, cls.hidden.unique_id))
        return io.NodeOutput(latent, ui=ui.PreviewText(text))


def run(model, parallel: ParallelChoice | None, positive, negative, latent_image: dict, fields: dict,
        extra: dict | None = None, graph: tuple = (None, None)) -> tuple[dict, str]:
    """One backend request for a sampler node; returns ComfyUI's LATENT and what the node shows of the run
    (ran_text). ``graph``: the prompt and the node's id, where Apply ControlNet's files are found (comfy_controls)."""
    import comfy.model_management as mm
    import comfy.utils

    from xdit_backend.errors import UserError
    from xdit_backend.models import registry

    try:
        spec = registry.spec(model.ref)
        geometry, samples = translate.latent(latent_image, spec)
        tensors = dict(extra or {})
        if samples is not None:
            tensors["latent"] = samples
        audio = translate.audio_latent(latent_image, spec)
        if audio is not None:
            tensors["audio_latent"] = audio
        mask = translate.noise_mask(latent_image)
        if mask is not None:
            tensors["noise_mask"] = mask
        rows, columns = spec.latent_shape(geometry.batch, geometry.width, geometry.height, geometry.frames)[-2:]
        for control in comfy_controls.choices(positive, negative, *graph) if spec.takes_controlnets else ():
            model = model.with_control(control)  # after the xDiT ControlNet nodes' (the model's) ones
        for index, control in enumerate(model.controls):
            latent = control_latent(control, rows, columns)
            if latent is not None:
                tensors[f"control_{index}"] = latent
        guidance = None
        for which, entries in (("positive", positive), ("negative", negative)):
            if entries is None:
                continue
            side = translate.conditioning(entries, spec, geometry.batch, which)
            prefix = "" if which == "positive" else "negative_"
            tensors.update({prefix + key: tensor for key, tensor in side.tensors.items()})
            if which == "positive":
                guidance = side.guidance
    except (UserError, translate.TranslationError) as exc:
        raise ValueError(_readable(exc)) from None
    if negative is not None and positive is None:
        raise ValueError("xDiT: a negative conditioning without a positive one; connect the positive prompt")
    request = {**model.request_fields(), **fields,
               **schema.fields(width=geometry.width, height=geometry.height, frames=geometry.frames,
                               batch=geometry.batch, parallel=(parallel or ParallelChoice()).request_value(),
                               guidance=guidance)}
    client, running = backend_client(parallel)
    if _shares_comfyui_gpu(mm.get_torch_device(), running):  # then ComfyUI's models make room for the backend's
        mm.unload_all_models()
        mm.soft_empty_cache()
    progress = comfy.utils.ProgressBar(fields.get("steps", 1))
    started = time.perf_counter()
    with comfyui_errors():
        result, info = client.sample(request, tensors, should_cancel=mm.processing_interrupted,
                                     on_progress=lambda step, total, _: progress.update_absolute(step, total),
                                     on_note=lambda text: tell(text, graph[1]))
    return {"samples": translate.to_comfyui(result, spec)}, ran_text(info, time.perf_counter() - started, parallel)


def tell(text: str, node_id) -> None:
    """What the sampler waits for before its first step (the backend starting, the model loading), in ComfyUI's
    console and on the node (the page shows a node's progress text under it), never a silent 0 %."""
    log.info("xDiT: %s", text)
    try:
        from server import PromptServer

        if node_id is not None and PromptServer.instance is not None:
            PromptServer.instance.send_progress_text(text, node_id)
    except (ImportError, AttributeError):  # a ComfyUI without progress text: the console has it
        pass


def ran_text(info: dict, elapsed: float, parallel: ParallelChoice | None) -> str:
    """What the sampler shows on its node after a run: the layout that ran (and why, when auto chose it), the
    time, the step cache's counts; with auto on, that the degree widgets of its xDiT Parallel Config were not used."""
    lines = [f"world {info.get('world_size')}: {info.get('layout', '')}", f"{elapsed:.1f} s, including the queue"]
    if "cache" in info:
        lines.append(f"step cache: {info['cache']['computed']} steps computed, {info['cache']['reused']} reused")
    if parallel is not None and parallel.unused_with_auto:  # set only with auto on
        lines.append(f"auto is on, so {parallel.unused_with_auto} on the xDiT Parallel Config are not used: turn "
                     "auto off to run them")
    return "\n".join(lines)


@contextmanager
def comfyui_errors():
    """The backend's errors as ComfyUI shows them: a cancel ComfyUI asked for (its Cancel) as ComfyUI's interrupt,
    any other as its message and its fix."""
    import comfy.model_management as mm

    from xdit_backend.client import BackendError, Cancelled
    from xdit_backend.errors import UserError

    try:
        yield
    except Cancelled:
        if mm.processing_interrupted():
            raise mm.InterruptProcessingException() from None
        raise
    except (BackendError, UserError) as exc:  # UserError: the backend the node starts, refused before it starts
        raise RuntimeError(_readable(exc)) from None


def backend_client(parallel: ParallelChoice | None):
    """The client of the backend at the default socket, and the running backend's status (None when
    none runs: the first request starts one on the chosen GPUs). A running backend on other GPUs is
    an error that says how to restart it."""
    import folder_paths

    from xdit_backend.client import Client
    from xdit_backend.errors import UserError
    from xdit_backend.launch.gpus import running_elsewhere
    from xdit_backend.launch.idle import nodes_idle_times
    from xdit_backend.launch.options import LaunchError, LaunchOptions, cuda_device_count
    from xdit_backend.wire.paths import default_socket

    gpus = parallel.gpus if parallel else None
    socket = default_socket()
    # a backend this node starts serves files from ComfyUI's model folders only
    folders = ("diffusion_models", "checkpoints", "loras", "model_patches", "controlnet")
    roots = tuple(sorted({str(Path(p).resolve()) for kind in folders
                          for p in folder_paths.get_folder_paths(kind)}))
    try:  # a backend this node starts lets the GPUs go when ComfyUI stops using it (idle.py)
        idle_unload, idle_stop = nodes_idle_times(os.environ)
    except UserError as exc:
        raise RuntimeError(_readable(exc)) from None
    client = Client(socket, auto_start=True,
                    launch=LaunchOptions(socket=socket, gpus=gpus, model_roots=roots, idle_unload=idle_unload,
                                         idle_stop=idle_stop))
    if client.hello_or_none() is None:
        return client, None
    status = client.status()
    if gpus and cuda_device_count():  # (without a GPU, a backend this node starts refuses gpus: options.py)
        try:
            elsewhere = running_elsewhere(status["ranks"], os.environ, gpus, cuda_device_count(), gethostname())
        except LaunchError as exc:
            raise RuntimeError(f"xDiT: {exc}") from None
        if elsewhere:
            raise RuntimeError(f"xDiT: {elsewhere}.\nStop it with the xDiT Backend node (action: stop backend) "
                               "and queue again; it restarts on the GPUs asked for.")
    return client, status


def _shares_comfyui_gpu(comfyui_device, running: dict | None) -> bool:
    """Whether the backend may run on ComfyUI's GPU: ComfyUI's text encoders and VAE would then take
    memory its ranks need. Unknown before a backend runs (its first start frees ComfyUI's GPU)."""
    from xdit_backend.launch.gpus import device_uuid, uses_gpu

    if comfyui_device.type != "cuda":
        return False
    return running is None or uses_gpu(running["ranks"], device_uuid(comfyui_device), gethostname())


def _readable(exc) -> str:
    """An error as ComfyUI shows it: the message and the fix in the nodes' words (its ``node_hint``) where the error
    words one for them, else its hint."""
    hint = getattr(exc, "node_hint", "") or getattr(exc, "hint", "")
    return f"xDiT: {getattr(exc, 'message', str(exc))}" + (f"\n{hint}" if hint else "")
