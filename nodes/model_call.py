"""The xDiT MODEL's model call: what ComfyUI's sampler hands its diffusion model → an ``evaluate`` request.

ComfyUI's ``BaseModel._apply_model`` (comfy/model_base.py) computes the model input, the timestep and the
family's extra inputs, then calls ``self.diffusion_model(xc, t, context=…, control=…, transformer_options=…,
**extra_conds)``. In the xDiT MODEL that diffusion model is ``RemoteDiffusionModel``: it holds no weights, and
its forward sends those inputs to the backend (one ``evaluate`` request) and returns the output. Everything
else — the sampler, the guider, model sampling, CFG functions, conditioning assembly (areas, masks, timestep
ranges, combine), the latent format — is ComfyUI's own, running in ComfyUI's process.

What would act inside the forward (patches on the blocks or the attention, a replaced attention, diffusion-model
wrappers, a ControlNet's residuals) cannot run on the backend: it is refused by name, never dropped. No ComfyUI
import here: remote_model.py builds the ComfyUI side, so these rules are testable without it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xdit_backend.errors import UserError
from xdit_backend.models.patch_embed import pad_to_patch

# transformer_options ComfyUI's sampler sets on every call, which change nothing inside the model
# (comfy/samplers.py calc_cond_batch, CFGGuider.sample: which rows are cond/uncond, the schedule)
INERT = {"cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "callbacks", "wrappers", "patches", "patches_replace"}
# wrapper kinds (comfy/patcher_extension.py WrappersMP) that run around the sampler or apply_model in ComfyUI's
# process; DIFFUSION_MODEL wrappers run inside the diffusion model's forward, which is the backend's
SAMPLER_SIDE_WRAPPERS = {"outer_sample", "prepare_sampling", "sampler_sample", "calc_cond_batch", "apply_model",
                         "predict_noise"}
# what a refused input is, for the message
INSIDE_THE_MODEL = {
    "patches": "patches on the model's blocks or attention",
    "patches_replace": "a replaced attention or block",
    "optimized_attention_override": "an attention override",
    "control": "a ControlNet (Apply ControlNet)",
    "ref_latents": "reference latents (ReferenceLatent)",
    "attention_mask": "an attention mask (a Redux or style model's mask)",
    "c_concat": "an image concatenated to the latent (image-to-video, inpainting models)",
}


class ModelCallError(UserError):
    """A model call the backend cannot run: the message names what and where it came from, the hint the way out."""


def _named(functions) -> str:
    """Where patch functions come from, for a message: their modules and names (ComfyUI records no node)."""
    names = []
    for function in functions if isinstance(functions, (list, tuple)) else [functions]:
        target = getattr(function, "__func__", function)
        module = getattr(target, "__module__", "") or ""
        names.append(f"{module}.{getattr(target, '__qualname__', type(target).__name__)}".strip("."))
    return ", ".join(sorted(set(names)))


def check_transformer_options(options: dict) -> None:
    """Refuse what would act inside the diffusion model's forward, naming it and where it came from."""
    use = "use a ComfyUI model loader for this workflow, or take the node that adds it out of the model's path"
    for key in ("patches", "patches_replace"):
        given = {name: fns for name, fns in (options.get(key) or {}).items() if fns}
        if given:
            first, fns = next(iter(given.items()))
            where = _named(list(fns.values()) if isinstance(fns, dict) else fns)
            raise ModelCallError(f"the model carries {INSIDE_THE_MODEL[key]} ({', '.join(given)}, from {where}), "
                                 "which runs inside the diffusion model: the xDiT MODEL runs the diffusion model on "
                                 "the backend and cannot run it", use)
    for kind, by_key in (options.get("wrappers") or {}).items():
        if kind not in SAMPLER_SIDE_WRAPPERS and any(by_key.values()):
            raise ModelCallError(f"the model carries a {kind!r} wrapper (from {', '.join(by_key) or 'a node'}), which "
                                 "wraps the diffusion model itself: the xDiT MODEL runs the diffusion model on the "
                                 "backend and cannot run it", use)
    for key, value in options.items():
        if key in INERT or value is None or value == {} or value == []:
            continue
        what = INSIDE_THE_MODEL.get(key, f"the transformer option {key!r}")
        raise ModelCallError(f"the model carries {what}, which the xDiT MODEL cannot honour on the backend", use)


def call_tensors(spec, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor, control,
                 transformer_options: dict, extra: dict, latent_out: Callable | None = None) -> tuple[dict, dict]:
    """ComfyUI's diffusion-model inputs → (the call's tensors x, timestep, guidance; the conditioning by request
    key), on the CPU in float32; refused by name where the backend cannot run them. ``latent_out``: ComfyUI's model's
    ``process_latent_out``, which takes reference latents back to the raw latent space the backend takes them in
    (ComfyUI's extra_conds moved them into the model's)."""
    if spec.comfy_model_inputs is None:
        raise ModelCallError(f"the xDiT MODEL does not run {spec.family} models yet",
                             "use the xDiT Sampler for this model (the whole sampling loop on the backend)")
    if control is not None:
        raise ModelCallError(f"the model call carries {INSIDE_THE_MODEL['control']}, whose residuals ComfyUI computed "
                             "in its own process; the xDiT Model does not send them to the backend", "sample with the "
                             "xDiT Sampler instead: it takes Apply ControlNet's ControlNets and runs them on the "
                             "backend under the model's split (or use ComfyUI's own model loader)")
    check_transformer_options(transformer_options or {})
    if context is None:
        raise ModelCallError("the model call carries no text conditioning (context)", "connect a text encoder's output")
    rows = x.shape[0]
    # Wan 2.2 TI2V-5B under a noise mask: ComfyUI's WAN22.process_timestep gives one per row and latent frame
    per_frame = spec.masked_timesteps_per_frame and timestep.dim() == 2 and x.dim() == 5 and tuple(
        timestep.shape) == (rows, x.shape[2])
    if timestep.numel() not in (1, rows) and not per_frame:
        raise ModelCallError(f"the model call carries timesteps of shape {list(timestep.shape)} for {rows} rows, "
                             f"which a {spec.family} model does not take", "use the xDiT Sampler for this model")

    def host(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu", torch.float32).contiguous()

    if one_frame(spec, x):
        x = x[:, :, 0]  # [N, C, 1, h, w] → [N, C, h, w]: the backend's image latent
    timestep = host(timestep) if per_frame else host(timestep).reshape(-1).expand(rows).contiguous()  # [N] or [N, T]
    tensors = {"x": host(x), "timestep": timestep}
    inputs = {"context": host(context)}
    for name, value in extra.items():
        if value is None:
            continue
        key = spec.comfy_model_inputs.get(name)
        if name == "ref_latents_method" and key is not None:
            if value != key:
                raise ModelCallError(f"the model call asks for the reference latents method {value!r}; a {spec.family} "
                                     f"model on the backend places its references by {key!r}",
                                     "take the node that sets the method out, or use ComfyUI's own model loader")
            continue
        if key is None:
            what = INSIDE_THE_MODEL.get(name, f"the input {name!r}")
            raise ModelCallError(f"the model call carries {what}, which the xDiT MODEL does not run for {spec.family} "
                                 "models yet", "take the node that adds it out of the conditioning's path, or use "
                                 "ComfyUI's own model loader for this workflow")
        if key == "timestep":  # read already: the timesteps per frame ComfyUI made from it (denoise_mask)
            continue
        if key == "guidance":
            tensors["guidance"] = host(value).reshape(-1).expand(rows).contiguous()  # [N]
        elif key.startswith("vace_"):  # WAN21_Vace's: a context [N, entries, 96, T, h, w], a strength per entry
            inputs[key] = control_videos(value, rows)
        elif key == "references":
            inputs.update(references(value, spec, latent_out))
        else:
            inputs[key] = host(value)
    return tensors, inputs


def control_videos(value, rows: int) -> torch.Tensor:
    """WAN21_Vace's vace_context [N, E, 96, T, h, w] → [N, 96·E, T, h, w] (the control videos side by side in the
    channels, as the backend takes them), or its vace_strength [s_1, …, s_E] → [N, E]."""
    if isinstance(value, (list, tuple)):
        return torch.tensor([float(strength) for strength in value]).expand(rows, -1).contiguous()
    return value.detach().to("cpu", torch.float32).flatten(1, 2).contiguous()


def references(latents: list, spec, latent_out: Callable | None) -> dict[str, torch.Tensor]:
    """ComfyUI's ``ref_latents`` (model space, [N, C, (1,) h, w] each) → ``reference_<i>`` [N, C, h', w'] in raw
    latent space, padded circularly to the patch as ComfyUI's model pads them."""
    if latent_out is None:
        raise ModelCallError("the model call carries reference latents, and the stand-in has no latent format to "
                             "read them with", "build the MODEL with the xDiT Model node")
    out = {}
    for i, latent in enumerate(latents):
        raw = latent_out(latent.detach().to("cpu", torch.float32))
        if raw.dim() == 5 and raw.shape[2] == 1:
            raw = raw[:, :, 0]  # a video latent format's one frame
        out[f"reference_{i}"] = pad_to_patch(raw, spec.patch).contiguous()
    return out


def one_frame(spec, x: torch.Tensor) -> bool:
    """ComfyUI carries this image family's latent with a frame axis of one (Qwen-Image's latent format is Wan
    2.1's: translate.has_frame_axis); the backend takes it without."""
    return spec.latent_format.video and not spec.video and x.dim() == 5 and x.shape[2] == 1


class RunPosition:
    """Where each call stands in ComfyUI's sampling run, for the backend's step cache and PipeFusion, which keep
    state across a run's calls (``evaluate``'s generation,
    step, steps, slot, cond_rows fields): the step is the schedule position of the call's noise level (ComfyUI's
    ``sample_sigmas``: the entries at or above it, less one), the slot its place among the calls of that step
    (slot 0 decides), the cond rows the first run of chunks ComfyUI marked cond (``cond_or_uncond``: 0; it batches
    uncond first). A new run begins
    when the schedule changes or the step goes back."""

    def __init__(self):
        self.run, self.schedule, self.step, self.calls = 0, None, -1, 0

    def fields(self, options: dict, rows: int) -> dict:
        schedule, sigma = options.get("sample_sigmas"), options.get("sigmas")
        if schedule is None or sigma is None:
            raise ModelCallError("the step cache and PipeFusion need ComfyUI's schedule of the run (sample_sigmas), "
                                 "which this sampler does not give", "take the xDiT Step Cache node out of the xDiT "
                                 "Model's path, and use a layout without pipefusion")
        schedule = schedule.detach().float().cpu()
        level = float(sigma.reshape(-1)[0])
        step = max(0, int((schedule >= level * (1 - 1e-6)).sum()) - 1)
        key = tuple(schedule.tolist())
        if key != self.schedule or step < self.step:
            self.run, self.schedule, self.step, self.calls = self.run + 1, key, step, 0
        elif step > self.step:
            self.step, self.calls = step, 0
        slot, self.calls = self.calls, self.calls + 1
        chunks = list(options.get("cond_or_uncond") or [0])
        first = chunks.index(0) if 0 in chunks else len(chunks)
        count = next((i for i, kind in enumerate(chunks[first:]) if kind != 0), len(chunks) - first)
        per_chunk = rows // len(chunks)
        return {"generation": f"{id(self):x}-{self.run}", "step": step, "steps": max(1, len(key) - 1), "slot": slot,
                "cond_start": per_chunk * first, "cond_rows": per_chunk * count}


class RemoteDiffusionModel(torch.nn.Module):
    """ComfyUI's ``diffusion_model``, standing in for the transformer the backend holds: no weights here (ComfyUI's
    memory manager sees an empty module), and each forward is one ``evaluate`` request through ``send(tensors,
    inputs, fields) → output`` (``fields``: where the call stands in its run, with ``run_position``: for the step
    cache and PipeFusion). Its dtype is
    float32: ComfyUI casts x and the conditioning to it, and the backend casts them to its compute dtype, rounding
    once as ComfyUI's own model would."""

    def __init__(self, spec, send: Callable[[dict, dict, dict], torch.Tensor], run_position: bool = False,
                 model_controls: tuple = ()):
        super().__init__()
        self.spec = spec
        self.send = send
        self.dtype = torch.float32
        self.position = RunPosition() if run_position else None
        self.latent_out = None  # ComfyUI's model's process_latent_out (remote_model.comfy_model sets it)
        # controls (model_controls.py): the xDiT control nodes' on the model (choices.ControlChoice), and for the
        # calls of one sampling run every control with its σ range (high, low) and each one's latent per latent size
        self.model_controls = list(model_controls)
        self.controls: tuple = ()
        self.control_latents: dict = {}

    def forward(self, x, timesteps, context=None, control=None, transformer_options=None, **extra):
        tensors, inputs = call_tensors(self.spec, x, timesteps, context, control, transformer_options or {}, extra,
                                       self.latent_out)
        fields = {} if self.position is None else self.position.fields(transformer_options or {}, x.shape[0])
        sigma = (transformer_options or {}).get("sigmas")
        active = [choice for choice, high, low in self.controls
                  if sigma is None or low <= float(sigma.reshape(-1)[0]) <= high]  # ComfyUI's get_control test
        if active:
            fields["controls"] = [choice.request_entry(ranged=False) for choice in active]
            latents = {f"control_{i}": self.control_latent(choice, *x.shape[-2:]) for i, choice in enumerate(active)}
            inputs.update({name: latent for name, latent in latents.items() if latent is not None})  # None: drawn
        out = self.send(tensors, inputs, fields)
        return (out[:, :, None] if one_frame(self.spec, x) else out).to(x.device)

    def control_latent(self, choice, rows: int, columns: int) -> torch.Tensor:
        """A control's latent at a latent of rows × columns, encoded the first time in the run (nodes/control.py, as
        the xDiT Sampler encodes it)."""
        from .control import control_latent

        key = (id(choice), rows, columns)
        if key not in self.control_latents:
            self.control_latents[key] = control_latent(choice, rows, columns)
        return self.control_latents[key]
