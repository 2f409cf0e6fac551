"""Latent cells into patch tokens, for the families that share a patching.

``pack`` / ``unpack``: 2×2 patches of a latent as tokens, channel-major within a patch, the layout
Flux's and Qwen-Image's transformers take (their ``x_embedder`` / ``img_in`` is a Linear on them).

diffusers' ``PatchEmbed`` (SD3, PixArt) for a band of latent rows, with the whole latent's positions:
``PatchEmbed.forward`` takes the positions of the latent it is given: for a band of rows that is
the wrong grid (SD3 crops the centre of its table; PixArt re-derives a table for the band's
size). PipeFusion embeds one band at a time, so it takes the table of the whole latent once
(``table``) and adds the rows of the band's tokens (``embed_rows``); the projection is the
module's own.
"""

from __future__ import annotations

import torch


def pad_to_patch(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """[B, C, (T,) h, w] padded circularly at the end of each patched axis to a multiple of the family's patch
    (frames, rows, columns), as comfy/ldm/common_dit.py pad_to_patch_size pads a latent before patchifying."""
    sizes = patch if latent.dim() == 5 else patch[1:]
    pad = ()
    for axis, size in enumerate(sizes):
        pad = (0, -latent.shape[axis + 2] % size) + pad  # F.pad lists the last axis first
    return latent if not any(pad) else torch.nn.functional.pad(latent, pad, mode="circular")


def pack(latent: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] → [B, (h/2)·(w/2), C·4]: 2×2 patches as tokens, channel-major within a patch."""
    b, c, h, w = latent.shape
    patches = latent.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)  # [B, h/2, w/2, C, 2, 2]
    return patches.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, (h/2)·(w/2), C·4] → [B, C, h, w], the inverse of ``pack``."""
    b, _, packed = tokens.shape
    c = packed // 4
    patches = tokens.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)  # [B, C, h/2, 2, w/2, 2]
    return patches.reshape(b, c, h, w)


def table(embed, h: int, w: int) -> torch.Tensor | None:
    """The positions ``embed`` (a diffusers PatchEmbed) adds for a whole [.., h, w] latent: [1, N, D], or None."""
    if embed.pos_embed is None:
        return None
    if embed.pos_embed_max_size:
        return embed.cropped_pos_embed(h, w)
    rows, columns = h // embed.patch_size, w // embed.patch_size
    if (embed.height, embed.width) == (rows, columns):
        return embed.pos_embed
    from diffusers.models.embeddings import get_2d_sincos_pos_embed

    grid = get_2d_sincos_pos_embed(embed_dim=embed.pos_embed.shape[-1], grid_size=(rows, columns),
                                   base_size=embed.base_size, interpolation_scale=embed.interpolation_scale,
                                   device=embed.pos_embed.device, output_type="pt")
    return grid.float().unsqueeze(0)


def embed_rows(embed, x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """PatchEmbed's forward for a band x [B, C, rows, w] whose tokens are ``tokens`` [n] of the whole
    latent: [B, n, D], with the whole latent's positions of those tokens."""
    latent = embed.proj(x).flatten(2).transpose(1, 2)  # [B, D, rows/p, w/p] → [B, n, D]
    if embed.layer_norm:
        latent = embed.norm(latent)
    if positions is None:
        return latent
    return (latent + positions[:, tokens]).to(latent.dtype)  # [1, N, D] cut to [1, n, D]
