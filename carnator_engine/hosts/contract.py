"""What Carnator needs of its ComfyUI host, checked in one place: the names and signatures comfyui.py relies on.

ComfyUI moves fast (0.3.64 to 0.38 added arguments, wrapper kinds, dynamic VRAM). A host that lacks one of these
would give a traceback in the middle of sampling, or worse, hooks that are never called (reuse silently off). So the
nodes check them when they load and before each request: when something is missing, `refusal()` says in one line what
and that reuse is off, and the Carnator Sampler samples as a KSampler does. Model classes are a separate matter: one
ComfyUI lacks only makes that model unsupported (`missing_models`), as any other unknown model is.

Signatures are checked where Carnator reads or passes arguments by position; arguments the host adds after those are
passed through untouched by every wrapper (comfyui.py).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import sys

from .model_key import host_version

log = logging.getLogger("carnator.host")


def _get(module: str, path: str):
    value = importlib.import_module(module)
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _exists(module: str, path: str) -> bool:
    _get(module, path)
    return True


def _takes(module: str, path: str, positional: tuple, keywords: tuple = ()) -> bool:
    """Whether the function at `path` takes `positional` first, in this order (after self), and `keywords` anywhere."""
    parameters = [name for name in inspect.signature(_get(module, path)).parameters if name != "self"]
    return parameters[:len(positional)] == list(positional) and all(name in parameters for name in keywords)


def _attention_override_key() -> bool:
    """Whether the host's attention functions still hand themselves to transformer_options' override."""
    wrap = _get("comfy.ldm.modules.attention", "wrap_attn")
    try:
        return "optimized_attention_override" in inspect.getsource(wrap)
    except (OSError, TypeError):      # no source shipped: the name is all that can be checked
        return True


# (what Carnator needs, as the one line names it; how to check it). Each check raises or returns False when missing.
NEEDS = (
    ("WrappersMP.PREDICT_NOISE", lambda: _exists("comfy.patcher_extension", "WrappersMP.PREDICT_NOISE")),
    ("WrappersMP.SAMPLER_SAMPLE", lambda: _exists("comfy.patcher_extension", "WrappersMP.SAMPLER_SAMPLE")),
    ("add_wrapper_with_key(wrapper_type, key, wrapper, transformer_options, is_model_options)",
     lambda: _takes("comfy.patcher_extension", "add_wrapper_with_key",
                    ("wrapper_type", "key", "wrapper", "transformer_options"), ("is_model_options",))),
    ("ModelPatcher.clone()", lambda: _exists("comfy.model_patcher", "ModelPatcher.clone")),
    ("ModelPatcher.set_model_patch_replace(patch, name, block_name, number)",
     lambda: _takes("comfy.model_patcher", "ModelPatcher.set_model_patch_replace",
                    ("patch", "name", "block_name", "number"))),
    ("ModelPatcher.get_model_object(name)",
     lambda: _takes("comfy.model_patcher", "ModelPatcher.get_model_object", ("name",))),
    ("CFGGuider.predict_noise(x, timestep, model_options)",
     lambda: _takes("comfy.samplers", "CFGGuider.predict_noise", ("x", "timestep", "model_options"))),
    ("KSAMPLER.sample(model_wrap, sigmas, extra_args)",
     lambda: _takes("comfy.samplers", "KSAMPLER.sample", ("model_wrap", "sigmas", "extra_args"))),
    ("comfy.sample.sample_custom(model, noise, cfg, sampler, sigmas, positive, negative, latent_image)",
     lambda: _takes("comfy.sample", "sample_custom",
                    ("model", "noise", "cfg", "sampler", "sigmas", "positive", "negative", "latent_image"),
                    ("noise_mask", "callback", "disable_pbar", "seed"))),
    ("transformer_options['optimized_attention_override'] (comfy.ldm.modules.attention.wrap_attn)",
     _attention_override_key),
    ("comfy.model_sampling.CONST", lambda: _exists("comfy.model_sampling", "CONST")),
    ("comfy.model_management.get_free_memory", lambda: _exists("comfy.model_management", "get_free_memory")),
)


def missing() -> list:
    """What of NEEDS this host lacks (empty when it has everything)."""
    absent = []
    for name, check in NEEDS:
        try:
            present = check()
        except (ImportError, AttributeError, TypeError, ValueError):
            present = False
        if not present:
            absent.append(name)
    return absent


def missing_models(model_classes) -> list:
    """The model_base classes of `model_classes` this host does not have."""
    return [name for name in model_classes if not _present("comfy.model_base", name)]


def _present(module: str, path: str) -> bool:
    try:
        return _exists(module, path)
    except (ImportError, AttributeError):
        return False


def refusal() -> str:
    """One line when this host lacks what Carnator needs ("" when it has it all): what is missing, and that reuse is
    off."""
    absent = missing()
    if not absent:
        return ""
    return (f"Carnator: this ComfyUI ({host_version()}) lacks {'; '.join(absent)}, which Carnator's hooks need: reuse "
            "is off, the Carnator Sampler samples as a KSampler does and stores nothing (update Carnator, or report "
            "the ComfyUI version)")


def nested_latent_refusal(latent_image) -> str:
    """What is wrong with a LATENT holding a nested latent, for the node to say with its fix ("" for any other):
    audio-video models (LTX-2 / LTXAV, MiniMax H3) sample a video latent and an audio latent together, which
    Carnator's signature, store and resume do not cover."""
    samples = latent_image.get("samples") if isinstance(latent_image, dict) else None
    if type(samples).__name__ != "NestedTensor" and not getattr(samples, "is_nested", False):
        return ""
    return ("is a nested latent (video with audio, as LTX-2 / LTXAV and MiniMax H3 sample it): Carnator reuses "
            "video-only latents")


def dynamic_vram(model) -> str:
    """Why a region-only hit keeps no kept keys and values on the GPU ("" when it may): ComfyUI's dynamic VRAM
    (comfy-aimdo, ModelPatcherDynamic; the default since 0.16) pages weights in on demand and does not count what a
    node holds on the GPU, so held tensors would take memory its plan gives the weights (docs/dynamic-vram.md)."""
    is_dynamic = getattr(model, "is_dynamic", None)
    memory = sys.modules.get("comfy.memory_management")
    dynamic = bool(is_dynamic()) if callable(is_dynamic) else bool(getattr(memory, "aimdo_enabled", False))
    if not dynamic and not any(kind.__name__ == "ModelPatcherDynamic" for kind in type(model).__mro__):
        return ""
    return ("dynamic VRAM is on (comfy-aimdo): ComfyUI pages the weights in on demand and plans without what a node "
            "holds on the GPU, so the other tokens' keys and values stay in host memory, streamed block by block")


def check_at_load(model_classes) -> str:
    """The check as the nodes load: the one line (logged as a warning) when reuse is off, else ""; model classes the
    host lacks are logged too, as unsupported."""
    why = refusal()
    if why:
        log.warning("%s", why)
    absent = missing_models(model_classes)
    if absent:
        log.warning("carnator: this ComfyUI has no model class %s: Carnator does not reuse for those models",
                    ", ".join(absent))
    return why


__all__ = ["NEEDS", "missing", "missing_models", "refusal", "nested_latent_refusal", "dynamic_vram",
           "check_at_load"]
