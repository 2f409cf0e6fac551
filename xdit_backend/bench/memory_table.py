"""``xdit-backend bench memory``: the memory model's table for the real full-size architectures.

Every figure here is MODELED (memory_model.py), not measured: each architecture is constructed on the
meta device from its config (no weights, no hub), its parameters are counted and checked against the
published size, and one rank's bytes are estimated for bf16, fp8 and GGUF (Q8_0, Q4_K) storage on 1,
2, 4 and 8 ranks, sharded (FSDP2 over all the ranks) or not, with the sequence split over all the
ranks (Ulysses) at 1024² (images) or 720p × 81 frames (video), batch 1, one sequence per forward.

The fit marks: a rank needs its estimate plus CONTEXT (the CUDA context and allocator slack) and, on
GPU 0, which the backend shares with ComfyUI, ComfyUI's VAE decode after sampling (the model's
``vae_decode``), when the backend's activations are free again: need = resident + max(transient +
activations + workspace, vae_decode) + CONTEXT. Text encoders run before sampling and ComfyUI
offloads them when short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..memory import model as memory_model

GiB = 2**30
CONTEXT = 1 * GiB
# ComfyUI decodes tiled when a whole decode does not fit. Its own estimate (comfy/sd.py,
# memory_used_decode) for one 512-px tile (a 64 × 64 latent) in bf16, plus the VAE's weights:
FLUX_VAE = int(1.5 * GiB)  # 2178·64·64·64·2 B = 1.14 GB + 84 M parameters (Flux.1's and Flux.2's VAEs)
WAN_VAE = 4 * GiB  # 7000·64·64·64·2 B = 3.67 GB + 127 M parameters (Wan 2.1's VAE, also Qwen-Image's)
# What the driver reports for the card classes: 16 GB (16376 MiB), 24 GB (24564 MiB: 3090, 4090),
# 48 GB (the smaller, L40/L40S: 46068 MiB) and 80 GB (H100: 81559 MiB).
CARDS = {16: 16376 * 2**20, 24: 24564 * 2**20, 48: 46068 * 2**20, 80: 81559 * 2**20}
RANKS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Architecture:
    name: str
    diffusers_class: str
    config: dict | str  # overrides of the class's defaults (the released model's, see source), or a built-in's name
    published_billions: float
    image_tokens: int  # at the table's size
    text_tokens: int  # in the joint sequence (0 where text enters by cross-attention only)
    size: str
    vae_decode: int  # bytes ComfyUI's VAE decode holds on GPU 0 (the constants above)
    source: str = field(compare=False)

    def build_on_meta(self) -> torch.nn.Module:
        import diffusers

        from ..models import registry

        config = registry.BUILTINS[self.config].config if isinstance(self.config, str) else self.config
        family = registry.family_of_class(self.diffusers_class)
        build = family.constructor() if family is not None else getattr(diffusers, self.diffusers_class)
        with torch.device("meta"):
            return build(**config)  # LTX-2's with its text connectors (ltx2.build_transformer)


# 1024²: Flux.1, Flux.2 and Qwen-Image latents are 8× smaller, patched 2×2: (1024/16)² = 4096 tokens.
# 720p × 81 frames: Wan's VAE strides (4, 8, 8) and patch (1, 2, 2): 21 × 45 × 80 = 75600 tokens;
# HunyuanVideo 1.5's VAE strides (4, 16, 16), patch 1: the same 21 × 45 × 80.
# 720p × 121 frames for LTX-2 (1280 × 704: its VAE's strides (8, 32, 32), patch 1): 16 × 22 × 40 = 14080 video tokens;
# its 121 audio tokens (25 a second at 25 fps) are whole on every rank, beside them (0.9 %: not counted).
LTX2_CONNECTOR = dict(num_attention_heads=30, attention_head_dim=128, num_layers=2)  # 2.0's (3840 wide)
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
             use_prompt_embeddings=False, rope_type="split",
             connector=dict(video=dict(num_attention_heads=32, attention_head_dim=128, num_layers=8,
                                       gated_attention=True, rope_type="split"),
                            audio=dict(num_attention_heads=32, attention_head_dim=64, num_layers=8,
                                       gated_attention=True, rope_type="split")))
ARCHITECTURES = (
    Architecture("Flux.1-dev", "FluxTransformer2DModel", "flux-dev-random", 12.0, 4096, 512, "1024²", FLUX_VAE,
                 "black-forest-labs/FLUX.1-dev transformer/config.json, as the built-in flux-dev-random "
                 "(models/registry.py); T5 text: 512 tokens"),
    Architecture("Flux.2-dev", "Flux2Transformer2DModel", {}, 32.0, 4096, 512, "1024²", FLUX_VAE,
                 "diffusers 0.42.1 Flux2Transformer2DModel's defaults (8 double + 48 single blocks, 48 heads × "
                 "128, MLP ratio 3, text width 15360): FLUX.2-dev's; Mistral text: max_sequence_length 512"),
    Architecture("Chroma1-HD", "ChromaTransformer2DModel", {}, 8.9, 4096, 512, "1024²", FLUX_VAE,
                 "diffusers 0.42.1 ChromaTransformer2DModel's defaults (19 double + 38 single blocks, 24 heads × "
                 "128, approximator 5 × 5120): lodestones/Chroma1-HD's; T5 text, unpadded: at most 512 tokens"),
    Architecture("Qwen-Image", "QwenImageTransformer2DModel", {}, 20.0, 4096, 512, "1024²", WAN_VAE,
                 "diffusers 0.42.1 QwenImageTransformer2DModel's defaults (60 blocks, 24 heads × 128, text "
                 "width 3584): Qwen/Qwen-Image's; text: the pipeline's max_sequence_length 512 (prompts are "
                 "not padded: shorter ones need less)"),
    Architecture("Wan 2.2 A14B (one expert)", "WanTransformer3DModel", {}, 14.0, 75600, 0, "720p × 81", WAN_VAE,
                 "diffusers 0.42.1 WanTransformer3DModel's defaults (40 blocks, 40 heads × 128, FFN 13824, "
                 "16 channels) = the Wan team's wan/configs/wan_t2v_A14B.py; text by cross-attention"),
    Architecture("HunyuanVideo 1.5", "HunyuanVideo15Transformer3DModel", {}, 8.3, 75600, 1256,
                 "720p × 81", WAN_VAE,
                 "diffusers 0.42.1 HunyuanVideo15Transformer3DModel's defaults (54 blocks, 16 heads × 128, "
                 "MLP ratio 4); text in the sequence: Qwen2.5-VL 1000 + byT5 256 tokens (the pipeline's); "
                 "its VAE decode budgeted as Wan's (ComfyUI's estimate for its 3-D VAE is per tile of frames)"),
    Architecture("LTX-2.0", "LTX2VideoTransformer3DModel",
                 {"connector": {"video": LTX2_CONNECTOR, "audio": LTX2_CONNECTOR}}, 19.0, 14080, 0,
                 "720p × 121", WAN_VAE,
                 "diffusers 0.42.1 LTX2VideoTransformer3DModel's defaults (48 blocks, video 32 heads × 128, audio "
                 "32 × 64, Lightricks/LTX-2) and ComfyUI's LTXAVModel connectors (2 layers, 30 heads × 128); text by "
                 "cross-attention; VAE decode budgeted as Wan's (ComfyUI tiles it)"),
    Architecture("LTX-2.3", "LTX2VideoTransformer3DModel", LTX23, 21.0, 14080, 0, "720p × 121", WAN_VAE,
                 "LTX-2.0's with 2.3's metadata (Lightricks' released header, ComfyUI av_model.py): gated attention, "
                 "the text's modulation, per-stream text features, connectors of 8 layers (32 × 128, 32 × 64); the "
                 "published 22 B counts the text features' projections too (3840·49 → 4096 and → 2048: 1.16 B), "
                 "which ComfyUI runs in its text encoder: 21 B here"),
    # 1024²: 64 × 64 latent cells, a token each; the text prefix whole on every rank (its keys and values kept per
    # prompt: 2 · 32 blocks · 4096 · 2 B = 0.5 MiB a token, 0.25 GiB for 512 tokens; not counted)
    Architecture("Qwen-Image 2.1", "QwenImage21Transformer2DModel", {}, 7.0, 4096, 0, "1024²", WAN_VAE,
                 "diffusers 0.42.1 QwenImage21Transformer2DModel's defaults (32 single blocks, 32 heads × 128, MLP "
                 "ratio 3, text width 4096) = ComfyUI's qwen_image21/model.py defaults; Qwen-Image 2.x is published "
                 "as 7 B; VAE decode budgeted as Wan's"),
    # 1344 × 768 × 124 frames (the node's default, 5 s at 24 fps): 37 latent frames of 24 × 42 tokens, and in the same
    # sequence 414 audio rows (207 stereo frames) and the prompt (up to 512 rows here)
    Architecture("MiniMax-H3", "MiniMaxH3Transformer3DModel", {}, 33.0, 37296, 414 + 512, "768p × 124", WAN_VAE,
                 "diffusers 0.42.1 MiniMaxH3Transformer3DModel's defaults (50 blocks, width 5376, 56 heads × 128, FFN "
                 "14336) = MiniMaxAI/MiniMax-H3's; one packed sequence: the text (Qwen3-VL, unpadded: up to 512 "
                 "rows here) and the audio's 414 rows beside the video's, all split; VAE decode budgeted as Wan's"),
)

STORAGES = ("bf16", "fp8", "GGUF Q8_0", "GGUF Q4_K")


def storage_rule(storage: str, transformer: torch.nn.Module) -> memory_model.StorageRule:
    if storage == "bf16":
        return 2
    if storage == "fp8":
        return memory_model.fp8_storage(torch.bfloat16)
    return memory_model.gguf_storage(storage.split()[1], torch.bfloat16, memory_model.block_lists(transformer))


def rank0_need(estimate: memory_model.Estimate, vae_decode: int) -> int:
    """GPU 0's bytes: the module docstring's rule (resident + max(run, VAE decode) + context)."""
    running = estimate.total - estimate.weights_resident
    return estimate.weights_resident + max(running, vae_decode) + CONTEXT


def smallest_card(need: int) -> str:
    return next((f"{size}" for size, capacity in CARDS.items() if need <= capacity), "—")


def tokens_per_rank(arch: Architecture, ranks: int) -> int:
    return -(-(arch.image_tokens + arch.text_tokens) // ranks)


def cell(transformer, arch: Architecture, storage: str, ranks: int, sharded: bool) -> str:
    estimate = memory_model.estimate(transformer, storage_bytes_per_value=storage_rule(storage, transformer),
                                     compute_dtype=torch.bfloat16, shard_ranks=ranks if sharded else 1,
                                     tokens_per_rank=tokens_per_rank(arch, ranks), rows=1, ulysses=ranks)
    need = rank0_need(estimate, arch.vae_decode)
    return f"{need / GiB:.1f} ({smallest_card(need)})"


def model_rows(arch: Architecture, transformer) -> list[str]:
    rows = []
    for storage in STORAGES:
        resident = memory_model.weight_bytes(transformer, storage_rule(storage, transformer), torch.bfloat16)[0]
        cells = [cell(transformer, arch, storage, 1, False)]
        for ranks in RANKS[1:]:
            cells += [cell(transformer, arch, storage, ranks, False), cell(transformer, arch, storage, ranks, True)]
        rows.append(f"| {storage} | {resident / GiB:.1f} | " + " | ".join(cells) + " |")
    return rows


def run_memory_table() -> int:
    print("MODELED (memory_model.py), GiB per rank on GPU 0: resident weights + max(gathered blocks and upcast "
          "+ activations + attention workspace, ComfyUI's VAE decode: 1.5 GiB with the Flux VAEs, 4 GiB with Wan's) + 1 GiB CUDA context; in brackets "
          "the smallest card (16/24/48/80 GB) that holds it, — for none. Compute in bf16, batch 1, the sequence "
          "split over all the ranks (Ulysses); 'sharded': FSDP2 over all the ranks, prefetching one block.\n")
    heads = " | ".join(f"{r} GPUs | {r}, sharded" for r in RANKS[1:])
    activations = []
    for arch in ARCHITECTURES:
        transformer = arch.build_on_meta()
        billions = sum(p.numel() for p in transformer.parameters()) / 1e9
        status = "ok" if abs(billions - arch.published_billions) <= 0.05 * arch.published_billions else "MISMATCH"
        print(f"### {arch.name}: {billions:.2f} B parameters counted (published {arch.published_billions:g} B: "
              f"{status}), {arch.size}, {arch.image_tokens} + {arch.text_tokens} tokens\n")
        print(f"| storage | weights, whole | 1 GPU | {heads} |\n|---|---|---|" + "---|" * (2 * len(RANKS) - 2))
        print("\n".join(model_rows(arch, transformer)) + "\n")
        widths = memory_model.Widths.of(transformer)
        per_rank = []
        for ranks in RANKS:
            t = tokens_per_rank(arch, ranks)
            run = (memory_model.activation_bytes(widths, torch.bfloat16, t, 1)
                   + memory_model.workspace_bytes(widths, torch.bfloat16, t, 1, ulysses=ranks))
            per_rank.append(f"{run / GiB:.2f}")
        activations.append(f"| {arch.name} | {arch.size} | {arch.image_tokens + arch.text_tokens} | "
                           f"{widths.hidden} | {widths.widest} | " + " | ".join(per_rank) + " |")
    print("Activations + attention workspace per rank (GiB, bf16, batch 1; CFG's two passes in one forward "
          "double it):\n")
    print("| model | size | tokens | C | F | " + " | ".join(f"{r} GPU{'s' if r > 1 else ''}" for r in RANKS)
          + " |\n|---|---|---|---|---|" + "---|" * len(RANKS))
    print("\n".join(activations))
    print("\nSources of the configs:\n" + "\n".join(f"- {a.name}: {a.source}" for a in ARCHITECTURES))
    return 0
