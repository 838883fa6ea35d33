"""Target regions: where the new request's own early estimate disagrees with the cached one.

The per-cell difference of the two denoised estimates (from the signatures) marks the space-time
cells that are specific to the new request; a one-cell dilation covers the halo a moving or
reshaped object leaves. Those cells are recomputed from the request's own state, never copied.
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class TargetSettling:
    """How fast the request's own x0-hat was still moving, per cell, at the end of the probe.

    A hit jumps its target region from the probe's last estimate straight to the resume step, as if that
    estimate stopped changing. `rate` is the last probe step's change per unit of sigma, so a jump from the
    estimate's sigma to sigma_k is predicted to miss the trajectory by about rate * (sigma_estimate - sigma_k).
    """

    rate: torch.Tensor        # [Tg, Hg, Wg] x0-hat change per unit sigma (noise units)
    sigmas: torch.Tensor      # the request's schedule
    estimate_step: int        # the probe step whose x0-hat the jump holds

    def drift(self, cells: torch.Tensor, resume_step: int) -> float:
        """Predicted RMS drift over the target cells of a jump to resume_step."""
        if not bool(cells.any()):
            return 0.0
        span = float(self.sigmas[self.estimate_step]) - float(self.sigmas[resume_step])
        return float(self.rate[cells].pow(2).mean().sqrt()) * max(span, 0.0)
