"""ComfyUI's own ControlNet nodes before an xDiT sampler: the controls Apply ControlNet put on the conditioning, as
the backend runs them.

Apply ControlNet (Advanced) / ControlNetApplySD3 (comfy nodes.py, snapshot v0.3.64) attach a ControlNet object to
each conditioning entry: the loaded network, the control image (``cond_hint_original``), the VAE, the strength, the
percent range, a union type (``extra_args``), and the ControlNet applied before it (``previous_controlnet``). The
object does not know its file, which the backend loads itself: the prompt graph does. From the sampler's positive
input, up through the conditioning, each Apply ControlNet node met (the last applied first, as the objects chain)
names its ControlNet through Load ControlNet Model (and Set Union ControlNet Type) — its file.

Both prompts must carry the same ControlNets: the backend runs a control on every row, as Apply ControlNet
(Advanced) applies it to both sides; the old Apply ControlNet, which controls the positive side only, is refused.
"""

from __future__ import annotations

from .choices import ControlChoice
from .translate import TranslationError

# Apply nodes → their conditioning inputs by output slot (0: positive, 1: negative)
APPLY = {"ControlNetApplyAdvanced": ("positive", "negative"), "ControlNetApplySD3": ("positive", "negative"),
         "ControlNetApply": ("conditioning",)}
LOADERS = ("ControlNetLoader", "DiffControlNetLoader")  # control_net_name: a file in models/controlnet
PASSING = {"SetUnionControlNetType": "control_net"}  # a ControlNet in, the same file out
CONDITIONING_INPUTS = ("conditioning", "positive", "negative")  # what other nodes pass a prompt through


def chain(control) -> list:
    """The ControlNet objects on one conditioning entry, the last applied first."""
    out = []
    while control is not None:
        out.append(control)
        control = control.previous_controlnet
    return out


def apply_nodes(prompt: dict, node_id: str, side: str) -> list[str]:
    """The Apply ControlNet nodes on the way up from ``node_id``'s ``side`` input, nearest first. A node with more
    than one conditioning input (Conditioning Combine) ends the way: its controls are not followed."""
    found, link, seen = [], prompt[node_id]["inputs"].get(side), set()
    while isinstance(link, list) and link[0] not in seen:
        source, slot = str(link[0]), link[1]
        seen.add(source)
        node = prompt.get(source, {})
        inputs, kind = node.get("inputs", {}), node.get("class_type")
        if kind in APPLY:
            if inputs.get("strength") != 0:  # at strength 0 ComfyUI attaches nothing
                found.append(source)
            names = APPLY[kind]
            link = inputs.get(names[min(slot, len(names) - 1)])
        else:
            passed = [inputs[name] for name in CONDITIONING_INPUTS if isinstance(inputs.get(name), list)]
            link = passed[0] if len(passed) == 1 else None
    return found


def control_file(prompt: dict, apply_id: str) -> str:
    """The ControlNet file an Apply ControlNet node applies, through Set Union ControlNet Type to its loader."""
    import folder_paths

    link = prompt[apply_id]["inputs"].get("control_net")
    while isinstance(link, list):
        node = prompt.get(str(link[0]), {})
        kind, inputs = node.get("class_type"), node.get("inputs", {})
        if kind in LOADERS:
            return folder_paths.get_full_path_or_raise("controlnet", inputs["control_net_name"])
        if kind not in PASSING:
            break
        link = inputs.get(PASSING[kind])
    raise TranslationError(f"the ControlNet of Apply ControlNet node {apply_id} does not come from Load ControlNet "
                           "Model (through Set Union ControlNet Type at most), so its file is unknown",
                           "load it with Load ControlNet Model, or use xDiT ControlNet")


def choices(positive, negative, prompt: dict | None, node_id: str | None) -> list[ControlChoice]:
    """The ControlNets on the conditioning (each side's one entry) as the xDiT ControlNet node would choose them,
    first applied first; [] without any."""
    from .control import preprocess

    from xdit_backend.models.model_patch import PatchSpec, takes_pixels

    sides = {which: chain(entries[0][1].get("control")) for which, entries in (("positive", positive),
                                                                                ("negative", negative))
             if entries}
    if not any(sides.values()):
        return []
    if prompt is None or node_id is None:
        raise TranslationError("the conditioning carries a ControlNet (Apply ControlNet), and the sampler was not "
                               "given the prompt to find its file in", "use xDiT ControlNet")
    nodes = {which: apply_nodes(prompt, node_id, which) for which in sides}
    if len(sides) == 2 and nodes["positive"] != nodes["negative"]:
        raise TranslationError("the positive and negative prompts carry different ControlNets (the old Apply "
                               "ControlNet controls the positive side only); the backend runs each control on both",
                               "use Apply ControlNet (Advanced) with both prompts, or xDiT ControlNet")
    objects, found = sides["positive"] if "positive" in sides else sides["negative"], nodes[next(iter(nodes))]
    if len(objects) != len(found):
        raise TranslationError(f"the conditioning carries {len(objects)} ControlNets and {len(found)} Apply "
                               "ControlNet nodes lead to the sampler", "apply ControlNets on the prompts' own path, "
                               "or use xDiT ControlNet")
    out = []
    for control, apply_id in zip(reversed(objects), reversed(found)):
        if control.extra_concat_orig:
            raise TranslationError(f"Apply ControlNet node {apply_id} gives its ControlNet an inpainting mask, which "
                                   "the backend does not send yet", "use an xDiT ControlNet without the mask")
        path = control_file(prompt, apply_id)
        types = control.extra_args.get("control_type") or []
        image = control.cond_hint_original.movedim(1, -1)  # as the node was given it: [B, H, W, 3]
        out.append(ControlChoice(path, control.strength, image, control.vae, start=control.timestep_percent_range[0],
                                 end=control.timestep_percent_range[1], resize=control.upscale_algorithm,
                                 mode=types[0] if types else None, preprocess=preprocess(path),
                                 pixels=takes_pixels(PatchSpec(path, 1.0))))
    return out
