"""The cost model: the bytes a layout sends per step (its traffic formula) and its modeled step time.

Every number it gives is MODELED, not measured. Inputs:
- ``t1``: one GPU's step time for the model and size (measured where a GPU was lent; else a
  published figure, labelled as such);
- the bytes each rank sends per step, from the method's algebra (traffic_formula below, the same
  formulas the CPU bench checks against counted traffic, in bf16);
- a link: bandwidth per GPU and latency per collective (datasheet-class values, below).

Formulas (N GPUs, C_N the compute share of the tokens a rank holds, V bytes sent per rank per
step, K collectives per step, W bandwidth, λ latency). C_N counts tokens: a sequence rank holds
(T+L)/P of the T image and L text tokens, so C_N = t1/P (the text is cut with the image; while it
was replicated a rank held L + T/P: 1536 of Flux's 4608 tokens at P = 4, a 3.0× ceiling):
- Ulysses (blocking all-to-alls): T = C_N + V/W + K·λ.
- Ring (K/V blocks passed while the previous block computes): the attention share α of the
  compute hides communication: T = C_N + max(0, V/W − α·C_N) + K·λ.
- CFG parallel (N = 2: one all-gather of the output per step): T = t1/2 + V/W + λ.
- PipeFusion (N stages, M patches; steps overlap, so the pipeline fills once per generation, not
  at every step): T = C_N per step after warm-up, activations sent during compute (assumed hidden).

``ParallelConfig.auto`` runs the same model with measured figures (topology.py): t1 from the step's
FLOPs and the ranks' matmul rate (serial_step), W the slowest link a layout's groups span, λ = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

SAMPLER_BYTES = 4  # the samplers work in float32: x0, latents


def traffic_formula(degrees: dict, dims: dict, fields: dict, element_bytes: int = 4) -> tuple[int, str]:
    """Bytes one rank sends per step by the methods' algebra, and the formula as text.

    A attention layers, B batch per forward, N image tokens, L text tokens, C hidden width,
    U ulysses, R ring, P = U·R; the velocity tokens carry 64 channels. Bytes per element: e, the
    compute dtype's (4 for float32, 2 for bfloat16 and float16), for what the model computes
    (activations, attention inputs, its velocity); 4 for what the sampler holds in float32 whatever
    the compute dtype (x0 exchanged by CFG, latents gathered by dp and returned by PipeFusion).
    Sequence parallelism cuts the joint sequence, text included: a rank holds (N+L)/P tokens.
    """
    u, r, cfg, dp, pf = (degrees.get(k, 1) for k in ("ulysses", "ring", "cfg", "dp", "pipefusion"))
    p = u * r
    a, c, e, f = dims["attention_layers"], dims["hidden"], element_bytes, SAMPLER_BYTES
    n = (fields["width"] // 16) * (fields["height"] // 16)
    text = dims["text_tokens"]
    two_passes = fields["cfg"] != 1.0
    b = fields["batch"] // dp * (2 if two_passes and cfg == 1 else 1)
    total, terms = 0, []
    if pf > 1:
        if p > 1 or cfg > 1:
            return 0, "not modelled for PipeFusion hybrids"
        images = fields["batch"] // dp
        activations, returned = b * (n + text) * c * e, images * n * 64 * f
        return max(activations, returned), ("PipeFusion max(B·(N+L)·C·e activations to the next stage, "
                                            "(B/dp)·N·64·4 patches back to stage 0); no factor of A")
    if u > 1:  # q, k, v in and the output back: four all-to-alls of a rank's (N+L)/P tokens
        total += 4 * a * b * ((n + text) // p) * c * e * (u - 1) // u
        terms.append("Ulysses 4·A·B·((N+L)/P)·C·e·(U−1)/U")
    if r > 1:  # K and V, R−1 times; after Ulysses a ring rank holds (N+L)/R tokens of C/U channels
        total += 2 * a * b * ((n + text) // r) * (c // u) * e * (r - 1)
        terms.append("Ring 2·A·B·((N+L)/R)·(C/U)·e·(R−1)")
    if p > 1:
        total += b * (n // p) * 64 * e * (p - 1)
        terms.append("velocity B·(N/P)·64·e·(P−1)")
    if cfg > 1:
        total += b * n * 64 * f
        terms.append("CFG B·N·64·4")
    if dp > 1:
        total += fields["batch"] // dp * n * 64 * f * (dp - 1) // fields["steps"]
        terms.append("dp (B/dp)·N·64·4·(dp−1)/steps")
    return total, " + ".join(terms) or "0"


def audio_traffic(layers: int, audio_width: int, audio_heads: int, video_tokens: int, audio_tokens: int,
                  rows: int, ulysses: int, ring: int, element_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per forward for LTX-2's audio under sequence parallelism (U·R = P ranks), by the two ways
    to place it: whole on every rank (models/ltx2.py: each rank's video-to-audio attention over its video share,
    merged by log-sum-exp: an all-gather of the audio-sized output and its LSE per block), or split with the video
    (audio self-attention, audio-to-video and video-to-audio cross-attention through Ulysses and Ring; the cross
    attentions then move the video's side at the audio's width Da). A blocks, B rows, N video and Na audio tokens.
    The video's own self-attention costs the same both ways and is left out."""
    a, b, da, e, u, r = layers, rows, audio_width, element_bytes, ulysses, ring
    p = u * r
    n, na = video_tokens, audio_tokens
    whole = a * b * (na * da * e + audio_heads * na * 4) * (p - 1)  # out (e) and LSE (float32), to P − 1 ranks
    split = 0
    if u > 1:  # all-to-alls of q, k, v and out: audio self (all audio), a2v and v2a (2 video- + 2 audio-sized each)
        split += a * b * (4 * na + 2 * (2 * n + 2 * na)) * da * e * (u - 1) // (u * p)
    if r > 1:  # K and V around the ring: the audio's (self and a2v), the video's at width Da (v2a)
        split += a * b * 2 * (2 * na + n) * (da // u) * e * (r - 1) // r
    split += b * (na // p) * 128 * e * (p - 1)  # the audio's velocity gathered once
    return {"whole": whole, "split": split}


def packed_audio_traffic(layers: int, attention_width: int, audio_rows: int, rows: int, ulysses: int, ring: int,
                         element_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per forward for MiniMax-H3's audio rows (Na) in its one packed sequence (A blocks, attention
    width C, B rows, U·R = P ranks): split with the rest (models/minimax_h3.py: their share of every Ulysses all-to-all
    of q, k, v and the output, and of the ring's K and V), or whole on every rank (their keys and values local for
    every head, but each Ulysses rank attends with its H/U heads only, so the audio rows' output is all-gathered across
    the Ulysses group; the ring passes the split rows' K/V past them anyway)."""
    a, b, c, e, u, r = layers, rows, attention_width, element_bytes, ulysses, ring
    p = u * r
    split = 0
    if u > 1:
        split += 4 * a * b * (audio_rows // p) * c * e * (u - 1) // u
    if r > 1:
        split += 2 * a * b * (audio_rows // r) * (c // u) * e * (r - 1)
    whole = a * b * audio_rows * c * e * (u - 1) // u
    return {"whole": whole, "split": split}


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s per GPU, one direction, as collectives achieve it
    latency: float  # seconds per collective


# Datasheet-class values: NVLink 4 (H100/H200 SXM) moves 450 GB/s per direction per GPU, of which
# NCCL all-to-all reaches roughly 350 GB/s; PCIe 4.0 ×16 (L40 class) is 32 GB/s per direction, ~20 GB/s
# achieved, less when peer-to-peer is disabled and traffic crosses the host.
NVLINK = Link("NVLink (H100/H200 class)", 350e9, 10e-6)
PCIE = Link("PCIe 4.0 ×16 (L40 class)", 20e9, 25e-6)

# Flux.1-dev at 1024² in bf16: 19 double + 38 single blocks, width 3072, 4096 image tokens, 512 text tokens.
FLUX_DEV = {"attention_layers": 57, "hidden": 3072, "text_tokens": 512}
FLUX_1024 = {"width": 1024, "height": 1024, "batch": 1, "cfg": 1.0, "steps": 28}


def image_tokens(fields: dict) -> int:
    """N as traffic_formula reads it: (W/16)·(H/16)."""
    return (fields["width"] // 16) * (fields["height"] // 16)


def attention_share(tokens: int, hidden: int) -> float:
    """α = S/(S + 6C): attention's share of a block's FLOPs at S tokens of width C (per token, 4·S·C
    for QKᵀ and PV against 24·C² for the projections and a 4× MLP)."""
    return tokens / (tokens + 6 * hidden)


def step_flops(dims: dict, fields: dict) -> float:
    """One step's FLOPs on one GPU: A layers × B·passes forwards × S tokens × 4·C·(6·C + S)."""
    tokens = image_tokens(fields) + dims["text_tokens"]
    forwards = fields["batch"] * (2 if fields["cfg"] != 1.0 else 1)
    return dims["attention_layers"] * forwards * tokens * 4 * dims["hidden"] * (6 * dims["hidden"] + tokens)


# A whole DiT step runs well below a large matmul's rate (attention, norms, RoPE, modulation, launch
# gaps): xDiT's eager 1-GPU Flux.1-dev step on an H100 (PUBLISHED["t1"], 240 ms) is step_flops = 7.4e13
# FLOPs, 310 TFLOP/s, where a large bf16 matmul runs at roughly 700 on that GPU.
MODEL_EFFICIENCY = 0.45


def serial_step(dims: dict, fields: dict, matmul_tflops: float) -> float:
    """t1 estimated from a measured matmul rate (topology.py's compute probe): the step's FLOPs at
    MODEL_EFFICIENCY of that rate."""
    return step_flops(dims, fields) / (MODEL_EFFICIENCY * matmul_tflops * 1e12)


def collectives(degrees: dict, layers: int) -> int:
    """Collectives per step: Ulysses 4 all-to-alls per layer; Ring R−1 exchanges per layer; the
    velocity gather; CFG's output gather."""
    u, r, cfg = (degrees.get(k, 1) for k in ("ulysses", "ring", "cfg"))
    return (4 * layers if u > 1 else 0) + ((r - 1) * layers if r > 1 else 0) + (u * r > 1) + (cfg > 1)


def tokens_per_rank(degrees: dict, image_tokens: int, text_tokens: int) -> float:
    """Tokens one rank runs through the blocks: a 1/P share of the joint [text; image] sequence."""
    return (image_tokens + text_tokens) / (degrees.get("ulysses", 1) * degrees.get("ring", 1))


def compute_share(t1: float, degrees: dict, image: int, text: int) -> float:
    """C_N: one GPU's step time scaled by the share of the tokens a rank holds (and by 1/cfg, 1/stages, 1/dp)."""
    share = tokens_per_rank(degrees, image, text) / (image + text)
    return t1 * share / (degrees.get("cfg", 1) * degrees.get("pipefusion", 1) * degrees.get("dp", 1))


def predict(t1: float, degrees: dict, link: Link, dims: dict = FLUX_DEV, fields: dict = FLUX_1024,
            value_bytes: int = 2) -> float:
    """Modeled step time (s) of one layout (see the module doc); by default Flux.1-dev at 1024² in bf16."""
    world = 1
    for name in ("ulysses", "ring", "cfg", "pipefusion", "dp"):
        world *= degrees.get(name, 1)
    if world == 1:
        return t1
    image, text = image_tokens(fields), dims["text_tokens"]
    share = compute_share(t1, degrees, image, text)
    sent, _ = traffic_formula(degrees, dims, fields, element_bytes=value_bytes)
    lag = collectives(degrees, dims["attention_layers"]) * link.latency
    stages = degrees.get("pipefusion", 1)
    if stages > 1:  # the pipeline stays full from step to step (parallel/schedule.py)
        return share
    if degrees.get("ring", 1) > 1:
        hidden = attention_share(image + text, dims["hidden"]) * share  # K/V passes overlap the attention
        return share + max(0.0, sent / link.bandwidth - hidden) + lag
    return share + sent / link.bandwidth + lag
