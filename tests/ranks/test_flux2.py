"""Flux.2 fed as ComfyUI feeds it: the wrapper against diffusers' own forward with ComfyUI's positions
written out here; text shorter than 512 tokens padded with zeros in front once per generation; reference latents as more
tokens that change the result, split and attended exactly like the image's under Ulysses."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from spawned import on_ranks

from xdit_backend.models import registry
from xdit_backend.parallel import attention, sequence
from xdit_backend.service.request import SampleRequest
from xdit_backend.wire.protocol import Message

SIGMA = torch.tensor([0.7])


def tiny():
    return registry.build("flux2-tiny", torch.device("cpu"))


def inputs(seed=0, text=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 128, 4, 8, generator=g), torch.randn(1, text, 96, generator=g)


def comfy_ids(h, w, index=0.0):
    """ComfyUI's process_img positions, written out here: (index, row, column, 0), row-major."""
    return torch.tensor([[index, r, c, 0.0] for r in range(h) for c in range(w)])


def diffusers_forward(model, tokens, context, ids):
    """diffusers' own forward (float32: its rounding of σ is then exact) on [image; references] tokens."""
    text_ids = torch.tensor([[0.0, 0.0, 0.0, l] for l in range(context.shape[1])])  # ComfyUI: text on axis 3
    with torch.no_grad():
        return model.transformer(hidden_states=tokens, encoder_hidden_states=context, timestep=SIGMA,
                                 img_ids=ids, txt_ids=text_ids, guidance=torch.tensor([3.5]), return_dict=False)[0]


def test_output_is_diffusers_forward_on_comfyui_positions():
    model = tiny()
    x, context = inputs()
    with torch.no_grad():
        out = model.output(x, SIGMA, {"context": context}, 3.5)
    expected = diffusers_forward(model, x.flatten(2).transpose(1, 2), context, comfy_ids(4, 8))  # [1, 32, 128]
    assert (out - expected.transpose(1, 2).reshape(1, 128, 4, 8)).abs().max() <= 1e-6


def test_short_text_is_padded_to_512_with_zeros_in_front_once_per_generation():
    """As ComfyUI's Flux2.extra_conds: 8 tokens become 504 zero tokens and then those 8, on each side (its own
    length each), when the request becomes a generation; text of 512 tokens or more is left as it is."""
    spec = registry.spec("flux2-tiny")
    g = torch.Generator().manual_seed(3)
    positive, negative, long = (torch.randn(1, n, 96, generator=g) for n in (8, 20, 600))
    tensors = {"context": positive, "negative_context": negative}
    request = SampleRequest.parse(Message("sample", {"model": "flux2-tiny", "width": 128, "height": 64}, tensors))
    gen = request.generation(spec, *request.conditioning(spec))
    assert torch.equal(gen.positive["context"], torch.cat([torch.zeros(1, 504, 96), positive], dim=1))
    assert torch.equal(gen.negative["context"], torch.cat([torch.zeros(1, 492, 96), negative], dim=1))
    assert torch.equal(spec.prepare_conditioning({"context": long})["context"], long)


def test_a_reference_is_more_tokens_at_index_10_and_changes_the_result():
    model = tiny()
    x, context = inputs()
    reference = torch.randn(1, 128, 2, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model.output(x, SIGMA, {"context": context}, 3.5)
        edited = model.output(x, SIGMA, {"context": context, "reference_0": reference}, 3.5)
    tokens = torch.cat([x.flatten(2).transpose(1, 2), reference.flatten(2).transpose(1, 2)], dim=1)  # [1, 40, 128]
    expected = diffusers_forward(model, tokens, context, torch.cat([comfy_ids(4, 8), comfy_ids(2, 4, 10.0)]))
    assert (edited - expected[:, :32].transpose(1, 2).reshape(1, 128, 4, 8)).abs().max() <= 1e-6
    assert (edited - plain).abs().max() > 1e-4  # 8 of 552 keys, random weights: small, but 100× the rounding


def test_a_pipefusion_chunk_carrying_a_reference_equals_the_forward():
    """PipeFusion's stage methods on one chunk of the whole latent, the reference's tokens ahead of the image's (as
    the first chunk of a step carries them, their positions after the image sequence's): the forward's velocity."""
    model = tiny()
    x, context = inputs()
    cond = {"context": context, "reference_0": torch.randn(1, 128, 2, 4, generator=torch.Generator().manual_seed(6))}
    shape, tokens = tuple(x.shape), torch.arange(32)  # [1, 128, 4, 8]: 32 image tokens
    with torch.no_grad():
        step = model.step_inputs(shape, SIGMA, cond, 3.5)
        references, positions = model.stage_references(cond, model.positions(shape))  # [1, 8, 128], [40, 4]
        placed = torch.cat([torch.arange(32, 40), tokens])  # the references' indices, then the chunk's
        image = torch.cat([model.embed_references(references), model.embed(x, tokens, step, positions)], dim=1)
        text = model.embed_text(step)
        kwargs = model.block_kwargs(step, positions, placed, text.shape[1])
        for name in model.spec.stage_plan.block_lists:
            for block in getattr(model.transformer, name):
                image, text = model.run_block(block, image, text, kwargs)
        out = model.unpatchify(model.head(image[:, 8:], step, tokens), shape)
        expected = model.output(x, SIGMA, cond, 3.5)
    assert (out - expected).abs().max() <= 1e-5


def _ulysses_rank(rank, x, cond):
    group = dist.group.WORLD
    layout = SimpleNamespace(sequence_group=group, sequence_index=rank, config=SimpleNamespace(sequence=2),
                             group=lambda name: group if name == "ulysses" else None)
    model = tiny()
    attached = sequence.attach(model.transformer, model.spec.sequence_plan, layout,
                               attention.local_attention(torch.device("cpu")))
    try:
        with torch.no_grad():
            return model.output(x, SIGMA, cond, 3.5).numpy()  # by value: the rank exits after answering
    finally:
        attached.detach()


def test_a_reference_under_ulysses_2_equals_serial():
    """32 image + 8 reference tokens and 512 text tokens split over two ranks: exact."""
    x, context = inputs()
    cond = {"context": context, "reference_0": torch.randn(1, 128, 2, 4)}
    with torch.no_grad():
        serial = tiny().output(x, SIGMA, cond, 3.5)
    for out in on_ranks(_ulysses_rank, 2, x, cond):
        assert (torch.from_numpy(out) - serial).abs().max() <= 1e-5
