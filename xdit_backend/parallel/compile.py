"""torch.compile of a model's transformer blocks, one block at a time, sharing the model's weights.

The compiled forwards sit next to the eager ones on the same blocks (no second copy of any weight):
``use_compiled(model, on)`` picks per request, and compiles on the first request that asks.
LoRAs are forward hooks on the Linear modules inside the blocks (models/lora.py), added, removed and
re-weighted between requests: dynamo does not guard on submodule hooks by default
(``skip_nnmodule_hook_guards``), so a graph traced without a LoRA would keep running without it.
The guard is turned on: a new set of patched modules compiles again; a strength change (a 0-dim
tensor written in place) or another file of the same shape compiles nothing.

Only the blocks are compiled, never the whole transformer: sequence parallelism attaches its
forward hooks (patch embedding, RoPE, output projection, Wan's first block) and attention
processors from outside, per request (parallel/sequence.py), and a graph break stays inside
one block. The blocks' ``forward`` is replaced, not ``__call__``: module hooks run eagerly
around the compiled forward, so a hook attached after compiling is never traced away.
(``nn.Module.compile`` would trace the hooks too, and dynamo does not guard on them by default.)

Shapes: every dimension of every tensor a block gets, except the last (the features, fixed by
the weights), is marked dynamic before the call: image tokens change with the resolution and
the sequence-parallel degree, text tokens with the prompt, rows with the batch and CFG. So the
first request compiles graphs with symbolic sizes that later sizes reuse. Marked dimensions are
not "duck sized" (two sizes that happen to be equal are not assumed equal, as dynamic=True
would), and a dimension the code pins to a constant (a size 1, a weight's size) is specialized
without an error (``maybe_mark_dynamic``). No padding: attention over padded tokens would change
the result unless masked.

What still compiles, once each: a new path through a block (another attention processor: each
sequence-parallel or PipeFusion layout; a batch of 1, where size 1 is a constant, versus 2 or
more; another stride, as Flux's first single-stream block gets a whole tensor and the next ones a
slice). Where a layout's own code breaks the graph (yunchang's ring P2P, PipeFusion's K/V buffer
bookkeeping), the frames after the break start static and become dynamic at their second size.
Those paths add up to more than dynamo's default 8 cached graphs per code object (measured: a
world-2 mix of cfg, ulysses, ring, PipeFusion at batch 1 and 2 reached it, and past it dynamo
runs the block eagerly), so the limit is raised to RECOMPILE_LIMIT.

What compiles nothing: a new prompt length (the processors read it from a dynamic size), the
attention processors sequence parallelism attaches anew for each request, a profiled
request (its traffic is not counted for a compiled model: parallel/traffic.py says why), and the
step cache's decisions (parallel/step_cache.py: a Python branch around the blocks' forwards, so
another threshold or another reused step runs the same graphs; tests/backend/test_compile.py).
"""

from __future__ import annotations

import torch

from ..models.storage import FLOAT8, StoredLinear

RECOMPILE_LIMIT = 64  # cached graphs per code object (a block class's forward), all layouts and batches


def use_compiled(model, on: bool):
    """Run ``model``'s blocks compiled (compiling them on the first call that asks) or eagerly."""
    if on and model.compiled_blocks is None:
        compile_blocks(model)
    if model.compiled_blocks is not None:
        model.compiled_blocks["on"] = on
    return model


def compile_blocks(model):
    """Give each block of ``model``'s transformer (its family's StagePlan block lists) a compiled
    forward next to its eager one, and run the compiled ones; returns the model. Compilation itself
    happens on the first call of each block."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.skip_nnmodule_hook_guards = False  # see the module docstring: LoRA hooks
    switch = {"on": True}
    transformer = model.transformer
    blocks = [block for name in model.spec.stage_plan.block_lists for block in getattr(transformer, name)]
    device = next(transformer.parameters()).device
    if device.type == "cuda":
        upcasts_left_eager(blocks, torch.cuda.get_device_capability(device))
    for block in blocks:
        block.forward = _switched(block.forward, _dynamic(torch.compile(block.forward)), switch)
    model.compiled_blocks = switch
    return model


TRITON_FLOAT8 = (8, 9)  # the compute capability from which Triton has float8 types (Ada, Hopper and later)


def upcasts_left_eager(blocks, capability: tuple[int, int]) -> int:
    """Below TRITON_FLOAT8 (A100, RTX 30xx, A6000), keep each float8-stored layer's upcast out of the graph,
    and return how many: Inductor would fuse the float8 → bf16 conversion into a Triton kernel, which
    fails to build there ("type fp8e4nv not supported in this architecture"), while eager casts run. Each
    such layer then breaks the graph around its upcast (gpu-paths-2.md B9)."""
    if capability >= TRITON_FLOAT8:
        return 0
    layers = [module for block in blocks for module in block.modules()
              if isinstance(module, StoredLinear) and module.weight.dtype in FLOAT8]
    for layer in layers:
        layer.upcast = torch.compiler.disable(layer.upcast)  # this instance's; the class's stays traceable
    return len(layers)


def _switched(eager, compiled, switch: dict):
    def forward(*args, **kwargs):
        return (compiled if switch["on"] else eager)(*args, **kwargs)

    return forward


def _dynamic(compiled):
    """``compiled``, called with all but the last dimension of each tensor argument marked dynamic."""

    def forward(*args, **kwargs):
        for value in (*args, *kwargs.values()):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):  # RoPE: (cos, sin)
                if isinstance(tensor, torch.Tensor):
                    for dim in range(tensor.dim() - 1):
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)
        return compiled(*args, **kwargs)

    return forward
