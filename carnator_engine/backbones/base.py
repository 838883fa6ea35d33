"""What the engine must know about a video DiT backbone: how latents become tokens.

Every supported backbone patchifies a latent [B, C, F, H, W] into a frame-major token sequence
(frames x rows x cols). Knowing the patch size is enough to map a space-time region of the latent
to the tokens (and attention blocks) that carry it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BackboneLayout:
    name: str
    latent_channels: int
    patch_size: tuple  # (t, h, w) latent cells per token

    def token_grid(self, latent_shape) -> tuple:
        """(frames, rows, cols) of tokens for a latent of shape [B, C, F, H, W]."""
        if len(latent_shape) != 5:
            raise ValueError(
                f"{self.name} expects a video latent [batch, channels, frames, height, width], "
                f"got shape {tuple(latent_shape)}")
        _, channels, frames, height, width = latent_shape
        if channels != self.latent_channels:
            raise ValueError(
                f"{self.name} expects {self.latent_channels} latent channels, got {channels}: "
                "is this latent from another model's VAE?")
        pt, ph, pw = self.patch_size
        return (-(-frames // pt), -(-height // ph), -(-width // pw))

    def tokens_from_latent_mask(self, latent_mask: torch.Tensor) -> torch.Tensor:
        """A [F, H, W] boolean latent mask -> [L] token mask (a token is marked if any cell is)."""
        pooled = F.max_pool3d(latent_mask[None, None].float(), kernel_size=self.patch_size,
                              stride=self.patch_size, ceil_mode=True)
        return pooled.flatten() > 0
