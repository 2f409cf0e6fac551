"""Sequence parallelism (USP: Ulysses × Ring), attached to a model from its family's SequencePlan.

Every rank of a ``ring × ulysses`` group holds 1/P of the sequence: of the image tokens and, for
a joint text+image (MM-DiT) model, of the text tokens too, so no rank carries the whole text
through every block. Attention over the local [text share; image share] tokens is exact:

- Ulysses all-to-all (yunchang ``SeqAllToAll4D``) swaps the sequence split for a head split;
- yunchang's ring passes K/V blocks around the ring, merging with our kernel's log-sum-exp;
- Ulysses swaps back. Attention is not causal, so the order in which the ranks' shares are laid
  side by side does not matter, as long as queries, keys and values agree (they come from the
  same all-to-all) and each token's position (RoPE, absolute embedding) is its own.

yunchang's ``LongContextAttention`` (0.6.4) reads its groups from yunchang's module globals, so
its two building blocks are composed here with our groups. The model runs unchanged on its share:
``attach`` cuts the tensors the plan names with forward hooks, gathers the output once per model
call, and gives each attention module the plan names its family's processor (the plan's class)
with USPAttention as its core.
Everything is undone by ``Attached.detach``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..models.base import Cut, SequencePlan
from . import attention


class USPAttention:
    """Attention over this rank's share of one sequence, exact across the ring × ulysses ranks.

    Any head count and any token count: heads that ``ulysses`` does not divide are padded with
    zero heads for the all-to-all (their output is dropped), and a share padded by ``Shard`` (token
    counts that ring × ulysses does not divide) has its padded keys left out of every attention
    call, so no token ever attends to padding (``PaddedKeys``).
    """

    def __init__(self, ulysses_group, ring_group, kernel: attention.Kernel, shard: Shard):
        from yunchang.comm.all_to_all import SeqAllToAll4D  # once per request, not per attention call
        from yunchang.ring import ring_flash_attn_func

        self.ulysses_group = ulysses_group  # None when ulysses = 1
        self.ring_group = ring_group  # None when ring = 1
        self.kernel = kernel
        self.shard = shard
        self.ulysses = dist.get_world_size(ulysses_group) if ulysses_group is not None else 1
        self.all_to_all, self.ring_attention = SeqAllToAll4D.apply, ring_flash_attn_func
        self.padded_keys: dict[tuple, PaddedKeys] = {}  # by (local length, text tokens, whole lengths)

    def __call__(self, q, k, v, text_tokens: int = 0, prefix: tuple | None = None):
        """q, k, v: [B, S/P, H, D], this rank's share of the sequence laid out [text share (``text_tokens``,
        or the whole text share when it is there and 0 is given: Flux's single-stream blocks); image
        share]; returns the same shape. ``prefix``: keys and values [B, Lp, H, D] whole on every rank that
        every query attends to besides the sequence's (Qwen-Image 2.1's text, computed once per prompt)."""
        padding = self.shard.padding  # None unless a share is padded (set by the cuts, outside compiled blocks)
        keys = None if padding is None else self._padded_keys(padding, q.shape[1], text_tokens, q.device)
        heads = q.shape[2]
        ug = self.ulysses_group
        if ug is not None:
            padded = -heads % self.ulysses  # zero heads, so every Ulysses rank gets H/U of them
            if padded:
                q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, padded)) for t in (q, k, v))  # [B, S/P, H', D]
            # scatter heads (dim 2), gather sequence (dim 1): [B, S/P, H', D] → [B, S/R, H'/U, D]
            q, k, v = (self.all_to_all(ug, t.contiguous(), 2, 1, False) for t in (q, k, v))
            if prefix is not None:  # this Ulysses rank's heads of it, as the all-to-all gave it q's
                share = q.shape[2]
                first = dist.get_rank(ug) * share
                prefix = tuple((torch.nn.functional.pad(t, (0, 0, 0, padded)) if padded else t)[:, :, first:first + share]
                               for t in prefix)  # [B, Lp, H'/U, D]: no copy of the whole prefix unless padded
        kernel = self.kernel if prefix is None else with_prefix(self.kernel, *prefix)
        kernel = kernel if keys is None else keys.kernel(kernel)
        if self.ring_group is not None:
            out, _, _ = self.ring_attention(q, k, v, causal=False, return_attn_probs=True, group=self.ring_group,
                                             attn_type=None, attn_processor=kernel)  # [B, S/R, H'/U, D]
        else:
            out, _ = kernel(q, k, v)  # [B, S/R, H'/U, D]
        out = out.to(q.dtype)
        if ug is not None:
            # scatter sequence (dim 1), gather heads (dim 2): [B, S/R, H'/U, D] → [B, S/P, H', D]
            out = self.all_to_all(ug, out.contiguous(), 1, 2, False)[:, :, :heads]  # [B, S/P, H, D]
        return out

    def _padded_keys(self, padding: tuple, local: int, text_tokens: int, device: torch.device) -> PaddedKeys:
        """Which keys are real in each ring rank's K/V block (built once per request and layout of the
        local sequence, on the device: no copy per attention call)."""
        key = (local, text_tokens, padding)
        if key not in self.padded_keys:
            self.padded_keys[key] = PaddedKeys.build(self.shard, local, text_tokens, self.ulysses, self.ring_group,
                                                     device)
        return self.padded_keys[key]


def with_prefix(kernel: attention.Kernel, prefix_k: torch.Tensor, prefix_v: torch.Tensor) -> attention.Kernel:
    """``kernel`` whose first call (a ring's own K/V block, or the one call without a ring) attends over the prefix
    [B, Lp, h, D] too, joined before the block's keys: every query then sees the prefix once, exactly."""
    first = [True]

    def attend(q, k, v, **kwargs):
        if first[0]:
            first[0] = False
            k, v = torch.cat([prefix_k, k], dim=1), torch.cat([prefix_v, v], dim=1)  # [B, Lp + s, h, D]
        return kernel(q, k, v, **kwargs)

    return attend


class PaddedKeys:
    """The real (unpadded) keys of every ring rank's K/V block after the Ulysses all-to-all, and a kernel
    that attends to those only.

    Sequence rank i = ring index × U + ulysses index holds [text share; image share], each padded at
    its end to the share length. After the all-to-all a ring rank's block is its U ranks' shares side by
    side, in ulysses order. yunchang's ring (``ring_flash_attn_forward``, 0.6.4) calls the kernel once
    per step, step s on the block of ring rank (r − s) mod R (it sends to r + 1 and receives from
    r − 1); the parity tests (tests/backend/test_parity.py) hold every padded layout to the serial result,
    so a change of that order fails there.
    """

    def __init__(self, real: list[torch.Tensor], ring_rank: int):
        self.real = real  # [ring ranks] × [real keys] indices into the block
        self.ring_rank = ring_rank

    @classmethod
    def build(cls, shard: Shard, local: int, text_tokens: int, ulysses: int, ring_group,
              device: torch.device) -> PaddedKeys:
        image, text = shard.lengths.get("image", 0), shard.lengths.get("text", 0)
        image_share, text_share = shard.share(image), shard.share(text)
        if local == image_share and not text_tokens:
            layout = (("image", image),)
        elif local == text_share + image_share and text_tokens in (0, text_share):
            layout = (("text", text), ("image", image))
        else:
            raise RuntimeError(f"sequence parallel attention got {local} tokens ({text_tokens} text), but this rank's "
                               f"shares are {text_share} text and {image_share} image tokens: the family's processor "
                               "and its sequence plan disagree")
        real = []
        for ring_index in range(shard.parts // ulysses):
            mask = torch.cat([torch.cat([torch.arange(shard.share(length)) < shard.counts(length)[ring_index * ulysses + u]
                                         for _, length in layout]) for u in range(ulysses)])  # [S/R] bool
            real.append(mask.nonzero().squeeze(1).to(device))
        ring_rank = dist.get_rank(ring_group) if ring_group is not None else 0
        return cls(real, ring_rank)

    def kernel(self, kernel: attention.Kernel) -> attention.Kernel:
        """``kernel`` on the real keys of each block, in the order yunchang's ring hands the blocks over."""
        blocks = len(self.real)
        calls = iter(range(blocks))

        def attend(q, k, v, **kwargs):
            real = self.real[(self.ring_rank - next(calls)) % blocks]
            return kernel(q, k.index_select(1, real), v.index_select(1, real), **kwargs)  # keys [B, real, H, D]

        return attend


class Shard:
    """This rank's share of a sequence, and the gather that undoes the cut.

    A sequence of S tokens is split into P shares as evenly as possible: rank i takes
    ⌊S/P⌋ tokens, one more when i < S mod P, contiguous and in rank order. When P does not divide S,
    every share is padded at its end to ⌈S/P⌉ with zeros (so the collectives see equal shapes);
    attention leaves the padding out (PaddedKeys) and the gather drops it. ``lengths`` holds the
    whole length of the text and of the image tokens cut in the current model call.
    """

    def __init__(self, group, index: int, parts: int):
        self.group, self.index, self.parts = group, index, parts
        self.lengths: dict[str, int] = {}  # "text" / "image" → S
        # The lengths when some share is padded, else None: what attention (inside compiled blocks) reads,
        # so an unpadded request of any prompt length compiles nothing new (a guard on None).
        self.padding: tuple | None = None

    def clear(self) -> None:
        """Before each model call: its cuts record the lengths anew."""
        self.lengths.clear()
        self.padding = None

    def counts(self, length: int) -> list[int]:
        """The real tokens of each rank's share."""
        return [length // self.parts + (rank < length % self.parts) for rank in range(self.parts)]

    def share(self, length: int) -> int:
        """The padded length of every share: ⌈S/P⌉."""
        return -(-length // self.parts)

    def cut(self, tensor: torch.Tensor, dim: int, what: str, kind: str = "image") -> torch.Tensor:
        """[..., S, ...] → [..., ⌈S/P⌉, ...] along ``dim``: this rank's share, zero-padded at its end."""
        length = tensor.shape[dim]
        if self.lengths.setdefault(kind, length) != length:
            raise ValueError(f"{what}: {length} {kind} tokens, but another {kind} tensor of this model call has "
                             f"{self.lengths[kind]}: the sequence plan cuts tensors that do not match")
        if length < self.parts and kind == "image":  # validation refuses such requests first (config.py)
            raise ValueError(f"{what}: {length} tokens cannot give each of ring × ulysses = {self.parts} ranks one")
        if length % self.parts or self.padding is not None:
            self.padding = tuple(sorted(self.lengths.items()))  # every length cut so far in this call
        if length % self.parts == 0:
            return tensor.chunk(self.parts, dim=dim)[self.index]
        counts = self.counts(length)
        mine = tensor.narrow(dim, sum(counts[: self.index]), counts[self.index])  # [..., real, ...]
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, self.share(length) - counts[self.index]]
        return torch.nn.functional.pad(mine, pad)  # [..., ⌈S/P⌉, ...]

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[B, ⌈N/P⌉, C] on every rank → [B, N, C] on every rank (shares in sequence-index order, padding dropped)."""
        parts = [torch.empty_like(local) for _ in range(self.parts)]
        dist.all_gather(parts, local.contiguous(), group=self.group)  # P × [B, ⌈N/P⌉, C]
        length = self.lengths.get("image", local.shape[1] * self.parts)
        if length % self.parts:
            parts = [part[:, :real] for part, real in zip(parts, self.counts(length))]
        return torch.cat(parts, dim=1)


class Attached:
    """The hooks and processors a plan put on a transformer; ``detach`` restores it as it was."""

    def __init__(self, transformer, hooks: list, shard: Shard):
        self.transformer, self.hooks, self.shard = transformer, hooks, shard
        # every attention module's processor, taken before any is replaced (by the modules themselves: diffusers
        # 0.42's HunyuanDiT2DControlNetModel.attn_processors reports None for each)
        self.saved = {module: module.processor for module in transformer.modules()
                      if hasattr(module, "set_processor") and hasattr(module, "processor")}

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for module, processor in self.saved.items():
            module.set_processor(processor)


def attach(transformer, plan: SequencePlan, layout, kernel: attention.Kernel) -> Attached:
    """Make ``transformer`` sequence parallel under ``layout`` as ``plan`` says, until ``detach``."""
    shard = Shard(layout.sequence_group, layout.sequence_index, layout.config.sequence)
    modules = dict(transformer.named_modules())
    attached = Attached(transformer, [transformer.register_forward_pre_hook(lambda module, args: shard.clear())], shard)
    for name in dict.fromkeys(cut.module for cut in plan.cuts):  # one hook per module, in plan order
        cuts = [cut for cut in plan.cuts if cut.module == name]
        inputs = [cut for cut in cuts if cut.arg is not None]
        outputs = [cut for cut in cuts if cut.arg is None]
        for module in _named(modules, name):
            if inputs:
                attached.hooks.append(module.register_forward_pre_hook(
                    lambda module, args, kwargs, inputs=inputs: _cut_inputs(shard, inputs, args, kwargs),
                    with_kwargs=True))
            for cut in outputs:
                attached.hooks.append(module.register_forward_hook(
                    lambda module, args, out, cut=cut: _cut_output(shard, cut, out)))
    if plan.gather is not None:  # None: the outputs stay split (a ControlNet's residuals, added on each rank)
        attached.hooks.append(modules[plan.gather].register_forward_hook(
            lambda module, args, out: shard.gather(out)))  # [B, N/P, C] → [B, N, C]
    usp = USPAttention(layout.group("ulysses"), layout.group("ring"), kernel, shard)
    processors = dict(plan.attention)
    for name, module in modules.items():
        path = ".".join(part for part in name.split(".") if not part.isdigit())  # "transformer_blocks.attn1"
        processor = processors.get(name.rsplit(".", 1)[-1], processors.get(path))
        if processor is not None:
            module.set_processor(processor(usp))
    return attached


def attach_model(model, layout, kernel: attention.Kernel) -> list[Attached]:
    """The model's transformer made sequence parallel by its family's plan, and each of the running generation's
    ControlNets (``model.controlnets``, each network once) by its family's control plan: its hint cut like the
    image, its residuals left split. The model's Attached first (its ``shard`` is the tokens')."""
    attached = [attach(model.transformer, model.spec.sequence_plan, layout, kernel)]
    networks = {id(control.network): control.network for control in getattr(model, "controlnets", ())}
    attached += [attach(network, model.spec.control_plan, layout, kernel) for network in networks.values()]
    return attached


def _named(modules: dict, name: str) -> list:
    """The module ``name`` names, or for ``list.*`` every block of that ModuleList (an input each block is given)."""
    if not name.endswith(".*"):
        return [modules[name]]
    return list(modules[name[:-2]])


def _cut_inputs(shard: Shard, cuts: list[Cut], args: tuple, kwargs: dict):
    """A module's inputs with the planned ones cut to this rank's share (by position or keyword)."""
    args = list(args)
    for cut in cuts:
        where = f"{cut.module or 'the transformer'}'s input {cut.arg!r}"
        given = args[cut.arg] if isinstance(cut.arg, int) and cut.arg < len(args) else kwargs.get(cut.arg)
        if cut.optional and (given is None or given.dim() <= cut.dim):
            continue
        if isinstance(cut.arg, int) and cut.arg < len(args):
            args[cut.arg] = shard.cut(args[cut.arg], cut.dim, where, _kind(cut))
        elif isinstance(cut.arg, str) and kwargs.get(cut.arg) is not None:
            kwargs[cut.arg] = shard.cut(kwargs[cut.arg], cut.dim, where, _kind(cut))
        else:
            raise RuntimeError(f"the sequence plan cuts {where}, but the forward call did not pass it "
                               f"(positional {len(args)}, keywords {sorted(kwargs)})")
    return tuple(args), kwargs


def _cut_output(shard: Shard, cut: Cut, out):
    """This rank's share of a module output, or of each tensor of a tuple output (RoPE's cos, sin)."""
    where = f"{cut.module}'s output"
    if isinstance(out, tuple):
        return tuple(shard.cut(t, cut.dim, where, _kind(cut)) for t in out)
    return shard.cut(out, cut.dim, where, _kind(cut))


def _kind(cut: Cut) -> str:
    return "text" if cut.text else "image"
