"""The xDiT Model's controls: ComfyUI's Apply ControlNet on the conditioning of a sampler that runs in ComfyUI's
process (KSampler, SamplerCustomAdvanced's guider), ComfyUI's model-patch node on the xDiT Model
(QwenImageDiffsynthControlnet), and the xDiT control nodes on the model before the xDiT Model.

ComfyUI would load each ControlNet in its own process (``prepare_sampling``) and compute its residuals there
(``calc_cond_batch``: ``control.get_control`` before ``apply_model``; comfy/samplers.py, snapshot v0.3.64), then
send them with every call; a model patch likewise (``get_additional_models_from_model_options``, then the model's
``double_block`` patches). Here the xDiT Model's ``outer_sample`` wrapper takes the ControlNets off the run's
conditioning and the patches off its model options before either happens, finds each one's file as the xDiT
sampler does (comfy_controls: up the prompt graph from the running sampler, which ComfyUI's executing context
names; a patch's through its node's ModelPatchLoader), and gives the stand-in transformer
(model_call.RemoteDiffusionModel) every control with its σ range (its percents through the run's model sampling,
as ``ControlBase.pre_run`` turns them); each call then sends those active at its noise level, their control
latents encoded once per latent size, and the backend runs them under the model's split (schema.EVALUATE's
``controls``).
"""

from __future__ import annotations

from .choices import ControlChoice
from .translate import TranslationError

CONDITIONING_SIDES = ("positive", "negative")
WRAPPER_KEY = "xdit_controls"
# ComfyUI's model-patch node (comfy_extras/nodes_model_patch.py) and the patch it attaches, by class name (Z-Image's,
# ZImageFunControlnet, comes with a ComfyUI newer than the snapshot, which the xDiT Model does not run Z-Image on yet)
PATCH_NODES = ("QwenImageDiffsynthControlnet",)
PATCH_CLASSES = ("DiffSynthCnetPatch",)


def install(patcher) -> None:
    """The wrapper on the xDiT Model's ModelPatcher (clones keep it)."""
    import comfy.patcher_extension

    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, on_the_backend)


def on_the_backend(executor, *args, **kwargs):
    """A guider's ``outer_sample`` with the ControlNets taken off its conditioning (this run's copies): the stand-in
    transformer holds them, with the model's own controls, for the run's calls."""
    from .sampler import _readable

    guider = executor.class_obj
    patcher = guider.model_patcher
    stand_in = patcher.model.diffusion_model
    try:
        chains = {side: _chain_of(entries) for side, entries in guider.conds.items()}
        found = _resolved(stand_in, chains)
        for entries in guider.conds.values():
            for entry in entries:
                entry.pop("control", None)
        patched = _patches_taken_off(guider)
        controls = stand_in.model_controls + _patch_choices(patched) + found
    except TranslationError as exc:
        raise ValueError(_readable(exc)) from None
    sampling = patcher.get_model_object("model_sampling")  # ControlBase.pre_run's: each percent as a σ
    stand_in.controls = tuple((choice, float(sampling.percent_to_sigma(choice.start)),
                               float(sampling.percent_to_sigma(choice.end))) for choice in controls)
    try:
        return executor(*args, **kwargs)
    finally:
        stand_in.controls, stand_in.control_latents = (), {}  # the run's: its choices go with it


def _chain_of(entries: list | None):
    """The ControlNet object on one side's entries (the last applied; its chain through ``previous_controlnet``), the
    same on every entry of the side, or None."""
    controls = {id(entry.get("control")): entry.get("control") for entry in entries or ()}
    if len(controls) > 1:
        raise TranslationError("the prompt's entries carry different ControlNets (Apply ControlNet on part of a "
                               "combined or area conditioning); the backend runs a control on every row",
                               "apply the ControlNet to the whole prompt, or use ComfyUI's own model loader")
    return next(iter(controls.values()), None)


def _resolved(stand_in, chains: dict) -> list[ControlChoice]:
    """The ControlNets as the xDiT ControlNet node would choose them, first applied first."""
    from . import comfy_controls

    if not any(chains.values()):
        return []
    if any(chain is not None for side, chain in chains.items() if side not in CONDITIONING_SIDES):
        raise TranslationError("a conditioning other than the positive and negative prompts (DualCFGGuider's) "
                               "carries a ControlNet; the backend runs a control on every row of both",
                               "use a CFGGuider, or ComfyUI's own model loader")
    if not stand_in.spec.takes_controlnets:
        raise TranslationError(f"the conditioning carries a ControlNet (Apply ControlNet), and ControlNets for "
                               f"{stand_in.spec.family} models do not run on the backend yet",
                               "remove Apply ControlNet from the prompt's path, or use ComfyUI's own model loader")
    prompt, node_id = running_prompt()
    sides = {side: [[None, {"control": chains[side]}]] for side in CONDITIONING_SIDES if side in chains}
    return comfy_controls.choices(sides.get("positive"), sides.get("negative"), prompt,
                                  conditioning_node(prompt, node_id))


def _patches_taken_off(guider) -> list:
    """The model-patch nodes' patches on the run's model options (first applied first), taken off them: a new
    options dict for the run (the patcher's own is shared with every clone)."""
    options = guider.model_options.get("transformer_options", {})
    patches = options.get("patches", {})
    found = []
    for patch in patches.get("double_block", ()):
        if type(patch).__name__ in PATCH_CLASSES and patch not in found:
            found.append(patch)
    if found:
        kept = {name: [p for p in listed if p not in found] for name, listed in patches.items()}
        guider.model_options = {**guider.model_options, "transformer_options": {
            **options, "patches": {name: listed for name, listed in kept.items() if listed}}}
    return found


def _patch_choices(patched: list) -> list[ControlChoice]:
    """The model patches as the xDiT DiffSynth ControlNet node would choose them."""
    from .control import mask_channels

    if not patched:
        return []
    prompt, node_id = running_prompt()
    files = patch_files(prompt, model_node(prompt, node_id))
    if len(files) != len(patched):
        raise TranslationError(f"the model carries {len(patched)} model patches and {len(files)} model-patch nodes "
                               "lead to the sampler", "patch the xDiT Model on the sampler's own path, or use the "
                               "xDiT DiffSynth ControlNet node")
    return [ControlChoice(path, patch.strength, patch.image, patch.vae, patch.mask, mask_channels(path))
            for patch, path in zip(patched, files)]


def patch_files(prompt: dict, node_id: str) -> list[str]:
    """The model patches' files of the model-patch nodes on the way up from ``node_id``'s model input (through any
    node that passes a model on), first applied first."""
    import folder_paths

    files, link, seen = [], prompt[node_id]["inputs"].get("model"), set()
    while isinstance(link, list) and str(link[0]) not in seen:
        seen.add(str(link[0]))
        node = prompt.get(str(link[0]), {})
        inputs, kind = node.get("inputs", {}), node.get("class_type")
        if kind in PATCH_NODES:
            source = inputs.get("model_patch")
            loader = prompt.get(str(source[0]), {}) if isinstance(source, list) else {}
            if loader.get("class_type") != "ModelPatchLoader":
                raise TranslationError(f"the model patch of node {link[0]} ({kind}) does not come from "
                                       "ModelPatchLoader, so its file is unknown", "load it with ModelPatchLoader")
            files.append(folder_paths.get_full_path_or_raise("model_patches", loader["inputs"]["name"]))
        link = inputs.get("model")
    return files[::-1]


def model_node(prompt: dict, node_id: str) -> str:
    """The node whose model input the sampler runs: the sampler itself, or the guider it takes."""
    inputs = prompt.get(node_id, {}).get("inputs", {})
    if isinstance(inputs.get("model"), list):
        return node_id
    if isinstance(inputs.get("guider"), list):
        return model_node(prompt, str(inputs["guider"][0]))
    raise TranslationError(f"the sampler (node {node_id}) takes no model input whose patches could be followed to "
                           "their files", "use KSampler or a CFGGuider")


def running_prompt() -> tuple[dict, str]:
    """The prompt ComfyUI is running and the node it is executing (the sampler), from its executing context."""
    from comfy_execution.utils import get_executing_context

    context, prompt = get_executing_context(), None
    if context is not None:  # a prompt ComfyUI runs: its queue holds it
        import server

        running, _ = server.PromptServer.instance.prompt_queue.get_current_queue_volatile()
        prompt = next((item[2] for item in running if item[1] == context.prompt_id), None)
    if prompt is None:
        raise TranslationError("the xDiT Model's conditioning carries a ControlNet (Apply ControlNet), and the "
                               "running prompt, where its file is named, is not to be found",
                               "run the workflow from ComfyUI's queue, or use the xDiT Sampler")
    return prompt, str(context.node_id)


def conditioning_node(prompt: dict, node_id: str) -> str:
    """The node whose positive and negative inputs the sampler's conditioning came through: the sampler itself
    (KSampler, KSamplerAdvanced), or the guider it takes (SamplerCustomAdvanced's CFGGuider)."""
    inputs = prompt.get(node_id, {}).get("inputs", {})
    if any(isinstance(inputs.get(side), list) for side in CONDITIONING_SIDES):
        return node_id
    guider = inputs.get("guider")
    if isinstance(guider, list):
        return conditioning_node(prompt, str(guider[0]))
    raise TranslationError(f"the sampler (node {node_id}) takes no positive or negative conditioning whose "
                           "ControlNets could be followed to their files", "use KSampler or a CFGGuider, or the "
                           "xDiT Sampler")
