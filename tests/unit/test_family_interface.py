"""Every family implements one interface, and its sequence plan names modules its model really has."""

from dataclasses import dataclass

import pytest
import torch

from xdit_backend.models import registry
from xdit_backend.models.base import CachePlan, Cut, FamilySpec, SequencePlan, StagePlan
from xdit_backend.service.request import CONDITIONING_NAME, REFERENCE

TINY = {}  # family → its first tiny built-in (wan-tiny, not wan-i2v-tiny)
for _name, _builtin in registry.BUILTINS.items():
    if _name.endswith("-tiny"):
        TINY.setdefault(_builtin.family, _name)
EVERY_TINY = sorted(name for name in registry.BUILTINS if name.endswith("-tiny"))


def test_every_family_has_a_tiny_builtin():
    """The parity tests cover each family through its tiny model."""
    assert set(TINY) == set(registry.FAMILIES)


@pytest.mark.parametrize("family", sorted(registry.FAMILIES))
def test_spec_implements_the_interface(family):
    """The spec is a FamilySpec with every required attribute, and its plan's processor kinds exist."""
    spec = registry.spec(TINY[family])
    assert isinstance(spec, FamilySpec) and spec.family == family
    for name in FamilySpec.REQUIRED:
        assert getattr(spec, name) is not None, name
    assert isinstance(spec.sequence_plan, SequencePlan)
    assert all(isinstance(processor, type) for _, processor in spec.sequence_plan.attention)
    assert spec.conditioning_shapes(1, 8)["context"] == (1, 8, spec.context_dim)


@pytest.mark.parametrize("name", EVERY_TINY)
def test_the_conditioning_a_family_declares_is_one_the_request_can_carry(name):
    """Its keys are request tensor names; each optional key is shaped or masks a shaped key; each
    ComfyUI option it names becomes one of its keys, or of the keys another variant of the family takes (Wan's
    image inputs, which a text-to-video file refuses by name) — not the context or pooled output, which the
    conditioning entry carries itself."""
    spec = registry.spec(name)
    shapes = spec.conditioning_shapes(1, 8)
    variants = [registry.spec(other) for other in EVERY_TINY if registry.BUILTINS[other].family == spec.family]
    family_keys = {key for variant in variants
                   for key in [*variant.conditioning_shapes(1, 8), *variant.optional_conditioning]}
    for key in [*shapes, *spec.optional_conditioning]:
        assert CONDITIONING_NAME.fullmatch(key) and not REFERENCE.fullmatch(key), key
        assert len(f"negative_{key}") <= 64, key  # protocol: tensor names of 1 to 64 characters
    for key in spec.optional_conditioning:
        assert key in shapes or key.removesuffix("_mask") in shapes, key
    for option, key in spec.comfy_conditioning.items():
        assert key not in ("context", "pooled") and key in family_keys, option


@pytest.mark.parametrize("family", sorted(registry.FAMILIES))
def test_the_plans_name_modules_the_model_has(family):
    """Every cut, the gather, the stage plan's block lists and each attention name exist in the built model."""
    model = registry.build(TINY[family], torch.device("cpu"))
    plan = model.spec.sequence_plan
    modules = dict(model.transformer.named_modules())
    for cut in plan.cuts:
        assert cut.module.removesuffix(".*") in modules, cut  # "blocks.*": each block of that list
    assert plan.gather in modules
    attention_names = {name.rsplit(".", 1)[-1] for name in modules}
    paths = {".".join(part for part in name.split(".") if not part.isdigit()) for name in modules}  # "layers.attention"
    for name, _ in plan.attention:
        assert name in attention_names | paths, name
    stages = model.spec.stage_plan
    assert sum(len(getattr(model.transformer, name)) for name in stages.block_lists) == model.spec.blocks
    for name, _, _ in stages.attention:
        assert name in attention_names | paths, name


def test_joint_models_cut_their_text_and_the_others_do_not():
    """Flux, Chroma, Flux.2, SD3, HunyuanVideo 1.5, Qwen-Image and CogVideoX attend to text and image together, so
    their text is split; PixArt, Wan, HunyuanDiT and LTX-2 cross-attend; Z-Image's one sequence is cut as two segments, its
    caption (with the image's pad tokens) as the text; MiniMax-H3's packed sequence is cut as one segment, its text
    rows with the rest; Qwen-Image 2.1's text is a prefix whole on every rank (its keys joined to each rank's)."""
    cuts_text = {family: registry.spec(TINY[family]).sequence_plan.cuts_text for family in registry.FAMILIES}
    assert cuts_text == {"flux": True, "chroma": True, "sd3": True, "pixart": False, "wan": False,
                         "wan_vace": False, "hunyuan_video15": True, "z_image": True, "hunyuan_dit": False,
                         "flux2": True, "qwen_image": True, "cogvideox": True, "ltx2": False,
                         "minimax_h3": False, "qwen_image21": False}


def family(**attributes):
    """A FamilySpec subclass with these class attributes and the heads/blocks fields, as a family module writes one."""
    namespace = {"__annotations__": {"heads": "int", "blocks": "int"}, **attributes}
    return dataclass(frozen=True)(type("Family", (FamilySpec,), namespace))


BASICS = {"family": "test", "latent_format": None, "parallel_methods": frozenset()}


def test_a_family_that_leaves_a_required_attribute_unset_fails_where_it_is_defined():
    """The missing attributes are named at class creation, not in a request."""
    with pytest.raises(TypeError, match="does not set sequence_plan, stage_plan, cache_plan"):
        family(**BASICS)


def test_a_family_without_its_methods_cannot_be_built():
    """model_sampling, conditioning_shapes and from_config are abstract."""
    incomplete = family(**BASICS, sequence_plan=SequencePlan(cuts=(Cut("pos_embed", None, 1),), attention=()),
                        stage_plan=StagePlan(block_lists=("transformer_blocks",), attention=()),
                        cache_plan=CachePlan(blocks=("transformer_blocks",), returns={"transformer_blocks": ("hidden_states",)},
                                             probe="temb", teacache=(1.0, 0.0)))
    with pytest.raises(TypeError, match="abstract"):
        incomplete(4, 2)
