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


def region_cells(cell_map: torch.Tensor, mass: float, dilation: int = 1) -> torch.Tensor:
    """The fewest cells that hold `mass` of the early estimates' squared difference, dilated as target_cells does:
    what a region-only resume adds to the gate's target cells. An absolute threshold does not carry across models
    (on one a nudged request differs by 0.1 everywhere, marking nothing; on another by more than it everywhere); the
    share of the difference does, so the target is where this request differs most, whatever the model's scale. A
    difference spread evenly gives a large target (over the region-only limit: whole-clip resume), one concentrated
    in a region gives that region; none at all (or mass 0) gives no cell."""
    if not 0.0 <= mass <= 1.0:
        raise ValueError(f"region target mass must be in [0, 1], got {mass}")
    squared = cell_map.float().flatten().pow(2)
    total = float(squared.sum())
    top = torch.zeros_like(squared, dtype=torch.bool)
    if mass > 0 and total > 0:
        values, order = squared.sort(descending=True)
        top[order[:int((values.cumsum(0) < mass * total).sum()) + 1]] = True
    marked = top.reshape(cell_map.shape).float()[None, None]
    if dilation > 0:
        marked = F.max_pool3d(marked, kernel_size=2 * dilation + 1, stride=1, padding=dilation)
    return marked[0, 0] > 0


def latent_mask(cells: torch.Tensor, latent_fhw) -> torch.Tensor:
    """Coarse cells -> [F, H, W] boolean mask over the latent (nearest neighbour)."""
    upsampled = F.interpolate(cells.float()[None, None], size=tuple(int(d) for d in latent_fhw), mode="nearest")
    return upsampled[0, 0] > 0.5
