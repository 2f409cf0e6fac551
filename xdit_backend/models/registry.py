"""Resolving a model argument (a built-in name or a file path) and building the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import UserError
from .flux import FluxModel, FluxSpec


class ModelError(UserError):
    """A model argument that cannot be resolved or loaded; the hint says what to pass instead."""


@dataclass(frozen=True)
class BuiltinModel:
    """A tiny random-weight model for demos and tests: built from a config and a fixed seed, so
    every rank and every process builds bit-identical weights without any file."""

    family: str
    config: dict
    text_tokens: int  # length of the random conditioning a request without embeddings gets
    seed: int = 0
    description: str = field(default="", compare=False)


BUILTINS: dict[str, BuiltinModel] = {
    "flux-tiny": BuiltinModel(
        family="flux",
        config=dict(
            patch_size=1,
            in_channels=64,  # 16 latent channels × a 2×2 patch
            num_layers=2,
            num_single_layers=5,  # 5 single ≈ 2 double in parameters: PipeFusion stages can balance
            attention_head_dim=16,
            num_attention_heads=4,
            joint_attention_dim=64,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
        ),
        text_tokens=8,
        description="Flux.1-dev architecture, 2+5 blocks, width 64, random weights (a test model)",
    ),
}


def resolve_builtin(name: str) -> BuiltinModel:
    if name in BUILTINS:
        return BUILTINS[name]
    raise ModelError(
        f"unknown model {name!r}: it is not a built-in model, and this version loads no model files yet",
        f"use one of the built-in models: {', '.join(BUILTINS)}",
    )


def block_sizes(name: str) -> list[int]:
    """Parameter count of each block, double-stream then single-stream, counted on the meta device."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**resolve_builtin(name).config)
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return [sum(p.numel() for p in block.parameters()) for block in blocks]


def spec(name: str) -> FluxSpec:
    """What the model takes and allows, from its config: nothing is built or loaded."""
    return FluxSpec.from_config(resolve_builtin(name).config)


def build(name: str, device: torch.device, dtype: torch.dtype = torch.float32) -> FluxModel:
    """Build a built-in model with its seeded weights on ``device``."""
    builtin = resolve_builtin(name)
    from diffusers import FluxTransformer2DModel  # heavy import, on first use only

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(builtin.seed)
        transformer = FluxTransformer2DModel(**builtin.config).to(device)
    if dtype != transformer.dtype:
        transformer = transformer.to(dtype)
    return FluxModel(transformer, name, FluxSpec.from_config(builtin.config))


def random_conditioning(name: str, batch: int, seed: int, spec: FluxSpec) -> tuple[dict, dict]:
    """Deterministic stand-in text embeddings for a built-in model, derived from the seed.

    Positive and negative sides come from one generator (seeded apart from the noise), so the same
    seed always gives the same prompt and a different seed a different one.
    """
    generator = torch.Generator().manual_seed((seed * 2654435761 + 97) % 2**63)
    shapes = spec.conditioning_shapes(batch, resolve_builtin(name).text_tokens)
    positive = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    negative = {key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    return positive, negative
