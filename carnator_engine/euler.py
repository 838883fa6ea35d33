"""The engine's own sampler: Euler steps on a flow-matching velocity model.

It drives the tiny reference DiT in the demo, the benchmarks and the tests. ComfyUI runs its own
samplers instead (see carnator_engine/hosts/comfyui.py); both honour the same Runner contract:
run steps [start, end) from the latent entering `start`, calling the observer around each step.
"""
from __future__ import annotations

import hashlib

import torch

from .fingerprint import hash_values, module_fingerprint
from .schedule import denoised_from_velocity


class TinyDiTRunner:
    def __init__(self, model, prompt: str, guidance_scale: float = 1.0):
        if guidance_scale < 1.0:
            raise ValueError(f"guidance_scale must be >= 1 (1 disables guidance), got {guidance_scale}")
        self.model = model
        self.layout = model.layout
        self.guidance_scale = guidance_scale
        device = next(model.parameters()).device
        self.device = device
        prompts = [prompt, ""] if guidance_scale != 1.0 else [prompt]
        with torch.no_grad():
            self.text = model.encode_prompts(prompts)
        self.model_fingerprint = module_fingerprint(model)
        self.sampler = f"euler/cfg={guidance_scale:g}"
        self.counts_forwards = True     # one batched forward per step (velocity)
        digest = hashlib.sha256()
        for tensor in self.text:
            hash_values(digest, tensor)
        self.request_fingerprint = digest.hexdigest()

    @staticmethod
    def preview(latent: torch.Tensor) -> torch.Tensor:
        """The tiny DiT works in pixel space: the middle frame is the preview."""
        return latent[0, :, latent.shape[2] // 2].clamp(-1, 1)

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, sigma: float, observer) -> torch.Tensor:
        batch = x.shape[0] * (2 if self.guidance_scale != 1.0 else 1)
        context, padding = self.text
        context = context.repeat_interleave(x.shape[0], dim=0)
        padding = padding.repeat_interleave(x.shape[0], dim=0)
        model_in = x if batch == x.shape[0] else torch.cat([x, x])
        sigmas = torch.full((batch,), float(sigma), device=x.device)
        observer.forward()
        v = self.model(model_in, sigmas, (context, padding), observer)
        if batch == x.shape[0]:
            return v
        cond, uncond = v.chunk(2)
        return uncond + self.guidance_scale * (cond - uncond)

    @torch.no_grad()
    def run(self, x: torch.Tensor, sigmas: torch.Tensor, start: int, end: int, observer) -> torch.Tensor:
        x = x.to(self.device, torch.float32)
        for step in range(start, end):
            sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
            observer.begin_step(step, x)
            v = self.velocity(x, sigma, observer)
            denoised = denoised_from_velocity(x, sigma, v)
            x = x + (sigma_next - sigma) * v
            observer.step_end(step, x, denoised)
        return x
