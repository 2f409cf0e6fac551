"""ComfyUI's resize of an image input to the latent it joins (comfy/utils.py ``common_upscale`` with "bilinear",
"center"), which its models' ``concat_cond`` apply to the start frame, the image to inpaint and their masks."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def upscale(latent: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, C, h', w'] or a video's [B, C, T, h', w'] → the same at (height, width): each frame cropped to the
    target's aspect at the centre, then resized bilinearly."""
    if latent.dim() == 5:
        b, c, frames = latent.shape[:3]
        flat = upscale(latent.movedim(2, 1).reshape(b * frames, c, *latent.shape[-2:]), height, width)
        return flat.reshape(b, frames, c, height, width).movedim(1, 2)  # [B, C, T, height, width]
    old_h, old_w = latent.shape[-2:]
    x = y = 0
    if old_w / old_h > width / height:
        x = round((old_w - old_w * ((width / height) / (old_w / old_h))) / 2)
    elif old_w / old_h < width / height:
        y = round((old_h - old_h * ((old_w / old_h) / (width / height))) / 2)
    cropped = latent[..., y:old_h - y, x:old_w - x]
    return F.interpolate(cropped, size=(height, width), mode="bilinear")
