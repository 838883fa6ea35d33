"""Options on a ComfyUI MODEL that Carnator refuses, each with why: they cannot run inside Carnator's split runs.

Carnator runs a request as several sampler runs (the probe, then the rest or a resume) with its own hooks on the
model. These options break under that, and are refused with an error naming the input rather than giving results
that differ from KSampler's:
- KJNodes' WanVideo TeaCache (native) keeps its state on the diffusion model from one model call to the next: a hit
  resumes another request's latent at step k while TeaCache goes on from the state the probe left at step p, so it
  would skip steps from another step's state (and the probe's signature depends on what it skipped). ComfyUI's
  EasyCache is handled (step_caches.py).
- the torch.compile options compiled.py names (fullgraph, CUDA graphs); a compiled model is otherwise supported.
"""
from __future__ import annotations

from .compiled import compile_refusal


def refusal(model) -> str:
    """Why Carnator cannot run `model` ("" when it can)."""
    options = model.model_options
    transformer_options = options.get("transformer_options") or {}
    wrapper = options.get("model_function_wrapper")
    if "teacache_device" in transformer_options or "TeaCache" in getattr(wrapper, "__qualname__", ""):
        return ("the model carries KJNodes' WanVideo TeaCache (native), which keeps its state on the diffusion "
                "model from one model call to the next: a hit resumes another generation at a later step, where "
                "TeaCache would go on from the state of this request's probe and skip other steps than in one "
                "KSampler run. Use ComfyUI's EasyCache node (it runs inside Carnator's steps), or a KSampler for "
                "TeaCache")
    return compile_refusal(model)


__all__ = ["refusal"]
