"""``xdit-backend bench control``: what a model patch (Qwen-Image's DiffSynth ControlNet) costs one rank per step, at
Qwen-Image's width (3072, 24 heads of 128), split as the backend splits it and as the multi-GPU peers run a control.

Per block and step, on this process's device: one Qwen-Image transformer block over a 1/P share of the image and
text tokens (its attention over the share only: the linear layers' work is exact, the attention a proxy), the
patch's control block over the same share (the backend: each rank controls its own tokens), and the control block
over all the image tokens (the peers' way: every rank runs the whole control, then keeps its slice). Bytes: the
patch is per token, so the backend sends none for it (its hint is cut like the image, once per call); nor do the
peers, who compute everything everywhere instead.

A ControlNet's blocks are the model's own kind (InstantX's Qwen-Image Union: 5 of them beside the model's 60), so
its cost per rank follows from the same measured block times, which the second table derives: split as the model
(the backend), 5 blocks over the rank's share; whole on every rank (the peers'), 5 blocks over every token.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..models.model_patch import ControlBlock

HEADS, HEAD = 24, 128  # Qwen-Image's: width 3072
TEXT_TOKENS = 256
MODEL_BLOCKS, CONTROLNET_BLOCKS = 60, 5  # Qwen-Image's, and InstantX's Union ControlNet's


def _seconds(run, device: torch.device, repeats: int) -> float:
    """The median of ``repeats`` timed calls after one untimed call."""
    def synced():
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    synced()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        synced()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_control_bench(side: int = 512, ranks: tuple[int, ...] = (1, 2, 4), device: str = "cpu",
                      dtype: str = "float32", repeats: int = 3, heads: int = HEADS) -> int:
    """The table above; ``heads`` of 128 (Qwen-Image's 24 unless a test asks for fewer)."""
    from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

    where, kind = torch.device(device), getattr(torch, dtype)
    width = heads * HEAD
    torch.manual_seed(0)
    block = QwenImageTransformerBlock(width, heads, HEAD).to(where, kind).eval()
    control = ControlBlock(width).to(where, kind).eval()
    image_tokens = (side // 16) ** 2  # 2×2 patches of a 1/8 latent
    rows = []
    with torch.no_grad():
        whole = torch.randn(1, image_tokens, width, device=where, dtype=kind)
        every = _seconds(lambda: control(whole, whole), where, repeats)  # the peers' way, on every rank
        for parts in ranks:
            share, text = -(-image_tokens // parts), -(-TEXT_TOKENS // parts)
            image = torch.randn(1, share, width, device=where, dtype=kind)
            words = torch.randn(1, text, width, device=where, dtype=kind)
            temb = torch.randn(1, width, device=where, dtype=kind)
            step = _seconds(lambda: block(image, words, None, temb), where, repeats)
            ours = _seconds(lambda: control(image, image), where, repeats)
            rows.append((parts, share, step, ours, every))
    print(f"DiffSynth ControlNet at width {width} (Qwen-Image's: 3072), {side}² ({image_tokens} image tokens, "
          f"{TEXT_TOKENS} text), {dtype}, {device}; per block and step, one rank\n")
    print("| ranks | image tokens a rank | Qwen-Image block ms | control block ms (ours: its share) | its share of the "
          "block | control block ms (peers: all tokens) | their share | control bytes sent |\n"
          "|---|---|---|---|---|---|---|---|")
    for parts, share, step, ours, every in rows:
        print(f"| {parts} | {share} | {step * 1e3:.1f} | {ours * 1e3:.1f} | {ours / step:.0%} | {every * 1e3:.1f} | "
              f"{every / step:.0%} | 0 |")
    whole_block = rows[0][2] if rows[0][0] == 1 else None
    if whole_block is not None:
        print(f"\nA ControlNet of {CONTROLNET_BLOCKS} such blocks beside the model's {MODEL_BLOCKS}, per step and rank "
              "(derived from the block times above)\n")
        print("| ranks | ControlNet ms, split as the model | its share of the step | ControlNet ms, every token on "
              "every rank | their share |\n|---|---|---|---|---|")
        for parts, _, step, _, _ in rows:
            model, ours, theirs = MODEL_BLOCKS * step, CONTROLNET_BLOCKS * step, CONTROLNET_BLOCKS * whole_block
            print(f"| {parts} | {ours * 1e3:.0f} | {ours / (model + ours):.0%} | {theirs * 1e3:.0f} | "
                  f"{theirs / (model + theirs):.0%} |")
    return 0
