"""The per-request step cache a creator would turn on instead of Carnator, for the demo model: the EasyCache rule.

EasyCache (Zhou et al., 2025, "Training-Free Video Diffusion Acceleration via Runtime-Adaptive Caching") observes
that a video DiT's transformation rate, k = |change of output| / |change of input| between two computed steps, is
nearly constant along the trajectory. After a computed step, each later step's relative output change is estimated
as k * |x_t - x_(t-1)| / |v_last| and summed; while the sum stays below the threshold the step reuses the last
computed transformation (output = input + (v_last - x_last)) instead of running the model; once it reaches the
threshold the step is computed, k is measured again and the sum restarts. Steps before `start` (a share of the
schedule) are always computed. Written here from that description for the engine's TinyDiTRunner (the demo model
predicts the velocity v; |.| is the mean absolute value), as ComfyUI's own EasyCache node runs inside a KSampler.

Inside Carnator it behaves as Carnator runs ComfyUI's EasyCache (carnator_engine/hosts/step_caches.py): the probe
computes every step (its signature never depends on a skip) while the rule's bookkeeping runs on; a run that
continues where the previous run of the request ended (a miss after its probe) keeps the state; any other run
(a hit resuming at k) starts fresh. Its settings are part of the runner's `sampler` text, hence of the bucket.
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carnator_engine.euler import TinyDiTRunner  # noqa: E402


class StepSkippingRunner(TinyDiTRunner):
    def __init__(self, model, prompt: str, guidance_scale: float = 1.0, threshold: float = 0.1,
                 start: float = 0.15):
        if not threshold >= 0 or not 0 <= start <= 1:
            raise ValueError(f"threshold={threshold} must be >= 0 and start={start} in [0, 1]")
        super().__init__(model, prompt, guidance_scale)
        self.threshold, self.start = float(threshold), float(start)
        self.step_cache = f"EasyCache rule threshold={self.threshold:g}, start={self.start:g}"
        self.sampler += f"/{self.step_cache}"
        self._ended_at = None
        self._reset()

    def _reset(self) -> None:
        self.last_x = self.last_v = self.rate = self.previous_x = None
        self.accumulated = 0.0

    def run(self, x, sigmas, start, end, observer):
        if start != self._ended_at:          # not the continuation of this request's previous run
            self._reset()
        self._computes_every_step = getattr(observer, "signature", None) is not None   # the probe
        steps = len(sigmas) - 1
        self._start_sigma = float(sigmas[min(steps, round(self.start * steps))])
        out = super().run(x, sigmas, start, end, observer)
        self._ended_at = end
        return out

    def velocity(self, x, sigma, observer):
        previous, self.previous_x = self.previous_x, x
        if self.rate is not None and previous is not None and sigma <= self._start_sigma:
            self.accumulated += float(self.rate * (x - previous).abs().mean() / self.last_v.abs().mean().clamp_min(1e-12))
            if self.accumulated < self.threshold and not self._computes_every_step:
                observer.step_cache_skipped += 1
                return x + (self.last_v - self.last_x)
        v = super().velocity(x, sigma, observer)
        if self.last_x is not None:
            self.rate = float((v - self.last_v).abs().mean() / (x - self.last_x).abs().mean().clamp_min(1e-12))
        self.last_x, self.last_v, self.accumulated = x, v, 0.0
        return v


__all__ = ["StepSkippingRunner"]
