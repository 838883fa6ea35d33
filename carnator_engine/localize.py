"""Target regions: where the new request's own early estimate disagrees with the cached one.

The per-cell difference of the two denoised estimates (from the signatures) marks the space-time
cells that are specific to the new request; a one-cell dilation covers the halo a moving or
reshaped object leaves. Those cells are recomputed from the request's own state, never copied.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def target_cells(cell_map: torch.Tensor, threshold: float, dilation: int = 1) -> torch.Tensor:
    """[Tg, Hg, Wg] x0-hat differences (noise units) -> boolean target cells."""
    if threshold <= 0:
        raise ValueError(f"target cell threshold must be > 0, got {threshold}")
    cells = (cell_map > threshold).float()[None, None]
    if dilation > 0:
        size = 2 * dilation + 1
        cells = F.max_pool3d(cells, kernel_size=size, stride=1, padding=dilation)
    return cells[0, 0] > 0


def latent_mask(cells: torch.Tensor, latent_fhw) -> torch.Tensor:
    """Coarse cells -> [F, H, W] boolean mask over the latent (nearest neighbour)."""
    upsampled = F.interpolate(cells.float()[None, None], size=tuple(int(d) for d in latent_fhw), mode="nearest")
    return upsampled[0, 0] > 0.5
