"""Options on a ComfyUI MODEL that Carnator refuses, each with why: they cannot run inside Carnator's split runs.

Carnator runs a request as several sampler runs (the probe, then the rest or a resume) with its own hooks on the
model. Two kinds of option break under that, and are refused with an error naming the input rather than giving
results that differ from KSampler's:
- KJNodes' WanVideo TeaCache (native) keeps its state on the diffusion model, resets it at the first step of every
  sampler run and places its start and end within that run: the split request would skip other steps than one
  KSampler run does (and store what it skipped). ComfyUI's EasyCache is handled (step_caches.py).
- torch.compile (ComfyUI's TorchCompileModel, KJNodes' compile nodes; both set `torch_compile_kwargs`): Carnator's
  hooks are new functions for every sampler run and run inside the compiled model, so dynamo recompiles on every run
  until its recompile limit (8 by default) and then runs the model uncompiled: the first requests are slow and no
  compiled speed is left (measured on the host tests' tiny Wan).
"""
from __future__ import annotations

TORCH_COMPILE_KWARGS = "torch_compile_kwargs"      # comfy_api.torch_helpers' mark of a compiled MODEL


def refusal(model) -> str:
    """Why Carnator cannot run `model` ("" when it can)."""
    options = model.model_options
    transformer_options = options.get("transformer_options") or {}
    wrapper = options.get("model_function_wrapper")
    if "teacache_device" in transformer_options or "TeaCache" in getattr(wrapper, "__qualname__", ""):
        return ("the model carries KJNodes' WanVideo TeaCache (native), which counts steps within each sampler run "
                "and keeps its state on the diffusion model: Carnator runs a request as a probe and then the rest "
                "(or a resume), so it would skip other steps than in one KSampler run. Use ComfyUI's EasyCache node "
                "(it runs inside Carnator's steps), or a KSampler for TeaCache")
    if TORCH_COMPILE_KWARGS in options:
        return ("the model is compiled with torch.compile (TorchCompileModel or a KJNodes compile node): Carnator's "
                "hooks run inside the compiled model and are new for every sampler run, so torch recompiles on every "
                "run until its recompile limit and then runs the model uncompiled (slow first requests, no compiled "
                "speed). Remove the compile node in front of Carnator, or use a KSampler for a compiled model")
    return ""


__all__ = ["refusal"]
