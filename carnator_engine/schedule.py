"""Flow-matching noise schedules and the closed-form jumps the resume path needs.

Convention shared by every runner: x_sigma = (1 - sigma) * x0 + sigma * noise, and the model
predicts the velocity v = noise - x0. Step s moves the latent from sigmas[s] to sigmas[s + 1].
"""
from __future__ import annotations

import torch


def flow_sigmas(steps: int, shift: float = 3.0) -> torch.Tensor:
    """Descending sigmas (steps + 1 values, last 0) with the time shift Wan and SD3 use."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    sigmas = shift * t / (1.0 + (shift - 1.0) * t)
    return sigmas.float()


def denoised_from_velocity(x: torch.Tensor, sigma: float, velocity: torch.Tensor) -> torch.Tensor:
    return x - sigma * velocity


def jump(x: torch.Tensor, denoised: torch.Tensor, sigma_from: float, sigma_to: float) -> torch.Tensor:
    """One deterministic Euler/DDIM jump along the straight flow path that passes through x.

    The noise implied by (x, denoised) is kept, so a jump to sigma_to lands where the
    request's own trajectory would be if its denoised estimate stopped changing.
    """
    if sigma_from <= 0:
        return denoised.clone()
    noise = (x - (1.0 - sigma_from) * denoised) / sigma_from
    return (1.0 - sigma_to) * denoised + sigma_to * noise


def schedule_fingerprint(sigmas: torch.Tensor) -> str:
    """Stable short text for a sigma schedule: entries with another schedule never match."""
    return ",".join(f"{float(s):.5f}" for s in sigmas)


class SwitchError(ValueError):
    """A two-expert switch that does not fall inside the schedule; `input_name` names the bad input."""

    def __init__(self, input_name: str, message: str):
        super().__init__(message)
        self.input_name = input_name


def expert_switch_step(sigmas: torch.Tensor, switch_step: int = 0, boundary_sigma: float = 0.0) -> int:
    """The step from which a two-expert model (Wan 2.2 A14B) runs its low-noise expert.

    Either the step itself (ComfyUI's template: the first KSamplerAdvanced ends at it, the second starts there) or,
    with switch_step 0, Wan 2.2's boundary rule: the high-noise expert runs every step whose sigma is at least
    `boundary_sigma`. Both experts must run at least one step, else one of them is not part of the generation.
    """
    steps = len(sigmas) - 1
    if int(switch_step) != 0:
        step = int(switch_step)
        if not 1 <= step < steps:
            raise SwitchError("switch_step", f"switch_step={step} is outside the schedule: with {steps} steps the "
                                             f"low-noise expert must take over at a step between 1 and {steps - 1}")
        return step
    boundary = float(boundary_sigma)
    step = next((i for i in range(steps) if float(sigmas[i]) < boundary), steps)
    if not 1 <= step < steps:
        raise SwitchError("boundary_sigma", f"boundary_sigma={boundary:g} is outside the schedule (sigmas "
                                            f"{float(sigmas[0]):.4f} .. {float(sigmas[-2]):.4f} over {steps} steps): "
                                            "one expert would run no step; pick a boundary inside that range or "
                                            "set switch_step")
    return step
