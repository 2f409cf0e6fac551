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

The third table does the same at Flux.1's width (``--family flux``: it measures a Flux double-stream and a
single-stream block over each share, and over every token): InstantX's Flux Union ControlNet, 5 double and 10 single
blocks beside the model's 19 and 38. Its residuals are never sent (each rank adds its own tokens'); what it sends is
its attention's Ulysses all-to-alls (q, k, v and the output, each rank keeping 1/P of each), computed from the
shapes: under Ring instead, K and V pass around the ring.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..models.model_patch import ControlBlock

HEADS, HEAD = 24, 128  # Qwen-Image's and Flux.1's: width 3072
TEXT_TOKENS = 256
MODEL_BLOCKS, CONTROLNET_BLOCKS = 60, 5  # Qwen-Image's, and InstantX's Union ControlNet's
FLUX_MODEL, FLUX_CONTROLNET = (19, 38), (5, 10)  # double and single blocks: Flux.1's, InstantX's Flux Union's
FLUX_TEXT_TOKENS = 512  # T5's 512 (Flux.1-dev), and the union's type token beside them


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


def run_flux_controlnet_bench(side: int = 512, ranks: tuple[int, ...] = (1, 2, 4), device: str = "cpu",
                              dtype: str = "float32", repeats: int = 3, heads: int = HEADS) -> int:
    """The third table: a Flux ControlNet per rank and step, split as the model against whole on every rank."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock

    where, kind = torch.device(device), getattr(torch, dtype)
    width = heads * HEAD
    torch.manual_seed(0)
    double = FluxTransformerBlock(width, heads, HEAD).to(where, kind).eval()
    single = FluxSingleTransformerBlock(width, heads, HEAD).to(where, kind).eval()
    image_tokens = (side // 16) ** 2  # 2×2 patches of a 1/8 latent

    def times(image: int, text: int) -> tuple[float, float]:
        """Seconds of one double and one single block over ``image`` and ``text`` tokens (attention over them only)."""
        x = torch.randn(1, image, width, device=where, dtype=kind)
        words = torch.randn(1, text, width, device=where, dtype=kind)
        temb = torch.randn(1, width, device=where, dtype=kind)
        kinds = (lambda: double(x, words, temb), lambda: single(x, words, temb))
        return _seconds(kinds[0], where, repeats), _seconds(kinds[1], where, repeats)

    rows = []
    with torch.no_grad():
        whole = times(image_tokens, FLUX_TEXT_TOKENS + 1)  # the peers': every token on every rank
        for parts in ranks:
            share, text = -(-image_tokens // parts), -(-FLUX_TEXT_TOKENS // parts)
            model = times(share, text)
            ours = times(share, -(-(FLUX_TEXT_TOKENS + 1) // parts))
            rows.append((parts, share, model, ours))
    itemsize = kind.itemsize
    print(f"\nA Flux ControlNet (InstantX's Union: {FLUX_CONTROLNET[0]} double and {FLUX_CONTROLNET[1]} single blocks "
          f"beside Flux.1's {FLUX_MODEL[0]} and {FLUX_MODEL[1]}) at width {width}, {side}² ({image_tokens} image "
          f"tokens, "
          f"{FLUX_TEXT_TOKENS} text), {dtype}, {device}; per step, one rank, from one measured block of each kind\n")
    print("| ranks | image tokens a rank | model ms | ControlNet ms, split as the model | its share of the step | "
          "ControlNet ms, every token on every rank | their share | ControlNet MB a rank sends (Ulysses) | residual "
          "bytes sent |\n|---|---|---|---|---|---|---|---|---|")
    for parts, share, model, ours in rows:
        model_ms = _blocks_ms(model, FLUX_MODEL)
        ours_ms, theirs_ms = _blocks_ms(ours, FLUX_CONTROLNET), _blocks_ms(whole, FLUX_CONTROLNET)
        tokens = share + -(-(FLUX_TEXT_TOKENS + 1) // parts)
        sent = sum(FLUX_CONTROLNET) * 4 * tokens * width * itemsize * (parts - 1) / parts  # q, k, v, out
        print(f"| {parts} | {share} | {model_ms:.0f} | {ours_ms:.0f} | {ours_ms / (model_ms + ours_ms):.0%} | "
              f"{theirs_ms:.0f} | {theirs_ms / (model_ms + theirs_ms):.0%} | {sent / 1e6:.1f} | 0 |")
    return 0


def _blocks_ms(one_of_each: tuple[float, float], blocks: tuple[int, int]) -> float:
    return 1e3 * sum(count * seconds for count, seconds in zip(blocks, one_of_each))
