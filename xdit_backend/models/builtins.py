"""The built-in test and benchmark models: real architectures from a config, random weights from a fixed seed.

A family adds its tiny model here (the issue's ``<family>-tiny``): every rank and every process builds
bit-identical weights without a file (weights.py draws them module by module on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BuiltinModel:
    """A random-weight model for demos, tests and benchmarks: built from a config and a fixed seed,
    so every rank and every process builds bit-identical weights without any file, on any device
    (drawn on the CPU, module by module: weights.py; but for ``drawn_on_device``)."""

    family: str
    config: dict
    text_tokens: int  # length of the random conditioning a request without embeddings gets
    seed: int = 0
    description: str = field(default="", compare=False)
    # the latent (rows, columns) of each reference latent a request that sends none gets, drawn from its seed
    references: tuple[tuple[int, int], ...] = ()
    # drawn on the device it is built for: the same model only on one kind of device, in seconds where the CPU
    # takes a minute or more (ATen's CPU uniform_ runs on one thread: 12 B values of Flux.1-dev in 60–84 s)
    drawn_on_device: bool = False


# Flux.1-dev's transformer config (its diffusers config.json), for the full-size random-weight built-ins
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))

# the tiny Flux and Wan (the image-input variants are the same models with more input channels)
FLUX_TINY = dict(patch_size=1, in_channels=64,  # 16 latent channels × a 2×2 patch
                 num_layers=2, num_single_layers=5,  # 5 single ≈ 2 double in parameters: PipeFusion stages can balance
                 attention_head_dim=16, num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
                 guidance_embeds=True, axes_dims_rope=(4, 6, 6))  # the RoPE axes sum to attention_head_dim
WAN_TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
                text_dim=64, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

QWEN_IMAGE_TINY = dict(patch_size=2, in_channels=64,  # 16 latent channels × a 2×2 patch
                       out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                       joint_attention_dim=64,  # Qwen2.5-VL's 3584 at full size
                       axes_dims_rope=(4, 6, 6))  # sums to attention_head_dim, as (16, 56, 56) sums to 128

COGVIDEOX_TINY = dict(num_attention_heads=4,  # Ulysses 4 splits them
                      attention_head_dim=16,  # RoPE: 4 temporal + 6 + 6 spatial
                      in_channels=16, out_channels=16, time_embed_dim=32, text_embed_dim=64, num_layers=2,
                      sample_width=8, sample_height=8,  # latent cells: the RoPE's training grid, 64 px
                      sample_frames=5, patch_size=2, max_text_seq_length=8,
                      use_rotary_positional_embeddings=True)  # 5B's positions

# LTX-2.3's architecture at width 64 (video: 4 heads of 16; audio: 4 of 8), 2 blocks: gated attention, the text's
# own modulation (cross_attn_mod), per-stream text features (4096 + 2048 at full size: 64 + 32 here), split RoPE,
# connectors of 2 layers with 128 registers; positions causal and from the cells' middles (2.3's metadata)
LTX23_TINY = dict(
    num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
    audio_num_attention_heads=4, audio_attention_head_dim=8, audio_cross_attention_dim=32,
    num_layers=2, gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
    use_prompt_embeddings=False, rope_type="split", cross_attn_timestep_scale_multiplier=1000,
    connector=dict(video=dict(num_attention_heads=4, attention_head_dim=16, num_layers=2, rope_type="split",
                              gated_attention=True),
                   audio=dict(num_attention_heads=4, attention_head_dim=8, num_layers=2, rope_type="split",
                              gated_attention=True)),
    positions=dict(causal=True, middle=True))
# LTX-2.0's: one 48-wide text feature for both streams (3840 at full size), projected after the connectors
# (caption_projection), interleaved RoPE, no gates
LTX20_TINY = dict(
    num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
    audio_num_attention_heads=4, audio_attention_head_dim=8, audio_cross_attention_dim=32,
    num_layers=2, caption_channels=48, rope_type="interleaved", cross_attn_timestep_scale_multiplier=1000,
    connector=dict(video=dict(num_attention_heads=2, attention_head_dim=24, num_layers=2),
                   audio=dict(num_attention_heads=2, attention_head_dim=24, num_layers=2)),
    positions=dict(causal=True, middle=True))

BUILTINS: dict[str, BuiltinModel] = {
    "flux-tiny": BuiltinModel(
        family="flux",
        config=FLUX_TINY,
        text_tokens=8,
        description="Flux.1-dev architecture, 2+5 blocks, width 64, random weights (a test model)",
    ),
    "chroma-tiny": BuiltinModel(
        family="chroma",
        config=dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=3, attention_head_dim=16,
                    num_attention_heads=4, joint_attention_dim=64, axes_dims_rope=(4, 6, 6),
                    approximator_num_channels=64, approximator_hidden_dim=64, approximator_layers=2),
        text_tokens=8,
        description="Chroma architecture, 2+3 blocks, width 64, random weights (a test model)",
    ),
    "ltx2-tiny": BuiltinModel(
        family="ltx2",
        config=LTX23_TINY,
        text_tokens=8,
        description="LTX-2.3 architecture (video with audio), 2 blocks, width 64 (audio 32), random weights "
                    "(a test model)",
    ),
    "minimax-h3-tiny": BuiltinModel(
        family="minimax_h3",
        # MiniMax-H3's architecture at width 64: 4 heads of 32 (the attention wider than the stream, as 56 × 128 over
        # 5376), 2 blocks and 1 refiner block, SwiGLU 128, RoPE over 2·3·4 of each head's 32 channels
        config=dict(num_attention_heads=4, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=1,
                    ffn_dim=128, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=48, freq_dim=32,
                    time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4),
        text_tokens=8,
        description="MiniMax-H3 architecture (video with audio, one packed sequence), 2 blocks, width 64, random "
                    "weights (a test model)",
    ),
    "minimax-h3-pruned-tiny": BuiltinModel(
        family="minimax_h3",
        # the same in curve form (a pruned file's): a 17-row table of 8 values for the time embedder, the AdaLN
        # projections 8 wide and run without SiLU
        config=dict(num_attention_heads=4, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=1,
                    ffn_dim=128, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=48,
                    time_embed_dim=8, rope_freq_dim=4, adaln_curve_grid=17),
        text_tokens=8,
        description="MiniMax-H3 architecture in a pruned file's curve form, 2 blocks, width 64, random weights "
                    "(a test model)",
    ),
    "qwen-image-2.1-tiny": BuiltinModel(
        family="qwen_image21",
        # Qwen-Image 2.1's single blocks at width 64: 4 heads of 16 (RoPE 4 + 6 + 6), the 64-channel latent
        config=dict(in_channels=64, out_channels=64, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                    context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6)),
        text_tokens=8,
        description="Qwen-Image 2.1 architecture (a text prefix, block-causal), 2 blocks, width 64, random weights "
                    "(a test model)",
    ),
    "ltx2.0-tiny": BuiltinModel(
        family="ltx2",
        config=LTX20_TINY,
        text_tokens=8,
        description="LTX-2.0 architecture (video with audio), 2 blocks, width 64 (audio 32), random weights "
                    "(a test model)",
    ),
    "flux-fill-tiny": BuiltinModel(
        family="flux",
        # (16 latent + 16 image + 64 mask channels) × a 2×2 patch in, as Flux.1 Fill
        config={**FLUX_TINY, "in_channels": 384, "out_channels": 64},
        text_tokens=8,
        description="Flux.1 Fill architecture (the image to inpaint and its mask concatenated), 2+5 blocks, width "
                    "64, random weights (a test model)",
    ),
    "flux-kontext-tiny": BuiltinModel(
        family="flux",
        config=FLUX_TINY,
        text_tokens=8,
        description="Flux.1 Kontext (flux-tiny given a reference image: 6 × 10 latent cells, 15 more tokens beside "
                    "the image's), random weights (a test model)",
        references=((6, 10),),
    ),
    "flux-dev-random": BuiltinModel(
        family="flux",
        config=FLUX_DEV,
        text_tokens=512,
        description="the full Flux.1-dev architecture (12 B parameters) with random weights, for GPU benchmarks",
        drawn_on_device=True,
    ),
    "flux-dev-two-blocks": BuiltinModel(
        family="flux",
        config={**FLUX_DEV, "num_layers": 1, "num_single_layers": 1},
        text_tokens=512,
        description="Flux.1-dev's width (3072) with 1 double and 1 single block (545 M parameters), random weights: "
                    "full-size activations on a CPU (bench memory --measure)",
    ),
    "flux2-tiny": BuiltinModel(
        family="flux2",
        config=dict(
            patch_size=1,
            in_channels=128,  # ComfyUI's Flux.2 latent: 32 VAE channels × a 2×2 patch
            num_layers=2,
            num_single_layers=4,
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=96,  # 3 stacked text-encoder layers of 32, as dev's 3 × 5120
            timestep_guidance_channels=256,
            mlp_ratio=3.0,
            axes_dims_rope=(4, 4, 4, 4),  # sums to attention_head_dim
            rope_theta=2000,
            guidance_embeds=True,
        ),
        text_tokens=512,  # ComfyUI pads Flux.2's text to 512 tokens (flux2.MIN_TEXT_TOKENS)
        description="Flux.2-dev architecture (takes reference images), 2+4 blocks, width 64, random weights "
                    "(a test model)",
    ),
    "sd3-tiny": BuiltinModel(
        family="sd3",
        config=dict(
            sample_size=32,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=3,
            attention_head_dim=32,
            num_attention_heads=4,
            joint_attention_dim=64,
            caption_projection_dim=128,
            pooled_projection_dim=32,
            pos_embed_max_size=32,  # images up to 32 × 2 × 8 = 512 px
            qk_norm="rms_norm",
            dual_attention_layers=(0,),  # SD3.5-medium's extra image-only attention, in block 0
        ),
        text_tokens=8,
        description="SD3.5-medium architecture, 3 blocks, width 128, random weights (a test model)",
    ),
    "pixart-tiny": BuiltinModel(
        family="pixart",
        config=dict(
            num_attention_heads=2,
            attention_head_dim=72,  # PixArt's head size
            in_channels=4,
            out_channels=8,  # ε and the learned variance
            num_layers=2,
            cross_attention_dim=144,
            caption_channels=64,
            sample_size=16,
            patch_size=2,
            interpolation_scale=0.25,  # Σ's rule, sample_size / 64: this marks it PixArt-Σ
            use_additional_conditions=False,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        ),
        text_tokens=8,
        description="PixArt-Σ architecture, 2 blocks, width 144, random weights (a test model)",
    ),
    "wan-tiny": BuiltinModel(
        family="wan",
        config=WAN_TINY,
        text_tokens=8,
        description="Wan 2.1 T2V architecture, 2 blocks, width 64, random weights (a test model)",
    ),
    "wan-vace-tiny": BuiltinModel(
        family="wan_vace",
        # wan-tiny with a VACE block after each of its 2 blocks, taking WanVaceToVideo's 32 + 64 channels
        config={**WAN_TINY, "vace_layers": [0, 1], "vace_in_channels": 96},
        text_tokens=8,
        description="Wan 2.1 VACE architecture (wan-tiny with 2 VACE blocks), random weights (a test model)",
    ),
    "wan-i2v-tiny": BuiltinModel(
        family="wan",
        # the latent's 16 channels, then the mask's 4 and the start image's 16 (WanImageToVideo); CLIP-H's hidden
        # states (1280) into Wan 2.1 I2V's image embedder, their keys and values in every block's cross-attention
        config={**WAN_TINY, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 64},
        text_tokens=8,
        description="Wan 2.1 I2V architecture (concatenated start frame and mask, CLIP image tokens), 2 blocks, "
                    "width 64, random weights (a test model)",
    ),
    "wan-ti2v-tiny": BuiltinModel(
        family="wan",
        # Wan 2.2 TI2V-5B's 48-channel latent (a 16× VAE): image to video by a fixed first frame and its noise mask
        config={**WAN_TINY, "in_channels": 48, "out_channels": 48},
        text_tokens=8,
        description="Wan 2.2 TI2V-5B architecture (48 latent channels), 2 blocks, width 64, random weights (a test "
                    "model)",
    ),
    "hunyuan-video-1.5-tiny": BuiltinModel(
        family="hunyuan_video15",
        config=dict(
            in_channels=65,  # 32 latent channels, a 32-channel image latent and a mask
            out_channels=32,
            num_attention_heads=2,
            attention_head_dim=32,
            num_layers=2,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            qk_norm="rms_norm",
            text_embed_dim=64,
            text_embed_2_dim=32,
            image_embed_dim=32,
            rope_theta=256.0,
            rope_axes_dim=(4, 14, 14),  # sums to attention_head_dim, in the released (16, 56, 56)'s proportions
            task_type="t2v",
        ),
        text_tokens=8,
        description="HunyuanVideo 1.5 architecture, 2 blocks, width 64, random weights (a test model; its byT5 "
                    "projection's hidden width is fixed at 2048, 4.3 M of its parameters)",
    ),
    "z-image-tiny": BuiltinModel(
        family="z_image",
        config=dict(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=96,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=6,  # like Z-Image's 30, a head count 4 does not divide
            n_kv_heads=6,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=64,
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[4, 6, 6],  # sums to the head size 16, in Z-Image's proportions (32, 48, 48)
            axes_lens=[1536, 512, 512],
        ),
        text_tokens=8,
        description="Z-Image architecture, 1+1 refiner and 2 main blocks, width 96, 6 heads, random weights (a test model)",
    ),
    "hunyuan-dit-tiny": BuiltinModel(
        family="hunyuan_dit",
        config=dict(
            num_attention_heads=4,  # Ulysses 4 divides them
            attention_head_dim=8,  # ComfyUI's HunyuanDiT asserts a multiple of 8
            hidden_size=32,  # = heads × head size, as in every HunyuanDiT
            in_channels=4,
            patch_size=2,
            sample_size=16,
            num_layers=4,  # an even depth: block 3 takes block 0's output as its skip
            mlp_ratio=4.0,
            learn_sigma=True,
            cross_attention_dim=32,  # the CLIP (BERT) width, 1024 at full size
            cross_attention_dim_t5=16,  # the mT5 width, 2048 at full size
            pooled_projection_dim=32,  # 1024 at full size
            text_len=8,  # 77 at full size
            text_len_t5=8,  # 256 at full size
            use_style_cond_and_image_meta_size=False,  # HunyuanDiT 1.2
        ),
        text_tokens=8,
        description="HunyuanDiT 1.2 architecture, 4 blocks, width 32, random weights (a test model)",
    ),
    "qwen-image-tiny": BuiltinModel(
        family="qwen_image",
        config=QWEN_IMAGE_TINY,
        text_tokens=8,
        description="Qwen-Image architecture, 2 blocks, width 64, random weights (a test model)",
    ),
    "qwen-image-edit-2511-tiny": BuiltinModel(
        family="qwen_image",
        config={**QWEN_IMAGE_TINY, "zero_cond_t": True},
        text_tokens=8,
        description="Qwen-Image-Edit-2511 (qwen-image-tiny's weights, the reference modulated at timestep 0) given a "
                    "reference of 6 × 10 latent cells, random weights (a test model)",
        references=((6, 10),),
    ),
    "cogvideox-tiny": BuiltinModel(
        family="cogvideox",
        config=COGVIDEOX_TINY,
        text_tokens=8,
        description="CogVideoX-5B architecture, 2 blocks, width 64, random weights (a test model)",
    ),
    "cogvideox-1.5-i2v-tiny": BuiltinModel(
        family="cogvideox",
        # CogVideoX1.5-5B-I2V: time patches of 2, the start image's latent concatenated (32 in), the ofs MLP
        config={**COGVIDEOX_TINY, "patch_size_t": 2, "in_channels": 32, "ofs_embed_dim": 32},
        text_tokens=8,
        description="CogVideoX1.5-5B-I2V architecture (a start image's latent concatenated, ofs 2), 2 blocks, width "
                    "64, random weights (a test model)",
    ),
}
