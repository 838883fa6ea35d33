"""Trajectory Resume: the latent and the attention plan a hit continues with.

The latent entering resume step k is the cached trajectory's, except in the target region, where
it is the request's own: its probe state jumped along its own flow path to sigma_k.
"""
from __future__ import annotations

import torch

from .schedule import jump


def resume_latent(probe_latent: torch.Tensor, probe_denoised: torch.Tensor, sigma_probe: float,
                  sigma_resume: float, cached_latent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """target: [F, H, W] bool over the latent; cached_latent: the entry's latent entering step k."""
    cached = cached_latent.to(probe_latent.device, probe_latent.dtype)
    if cached.shape != probe_latent.shape:
        raise ValueError(f"cached latent {tuple(cached.shape)} does not match this request's latent "
                         f"{tuple(probe_latent.shape)}: the entry belongs to another latent size")
    # a host's sampler may leave the denoised estimate on the GPU while the latent comes back on the CPU
    denoised = probe_denoised.to(probe_latent.device, probe_latent.dtype)
    own = jump(probe_latent, denoised, sigma_probe, sigma_resume)
    return torch.where(target.to(own.device)[None, None], own, cached)

