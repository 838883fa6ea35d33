"""A compiled MODEL (torch.compile) under Carnator: the compile options it cannot honour, and recompile storms.

Compiled models come from ComfyUI's TorchCompileModel and KJNodes' TorchCompileModel*V2 nodes (both mark the MODEL
with `torch_compile_kwargs`), and from KJNodes' other compile nodes, which put compiled blocks on the model as object
patches and note their settings in `compile_settings` on the model. Carnator's hooks (comfyui.py) are the same objects
in every run and run outside traced code, so one compilation serves the probe, the rest of a miss, a resume and the
next requests. Two options cannot work with them, and are refused before any model call (as is a compiled copy in
place of the whole diffusion model, KJNodes' deprecated TorchCompileModelWanVideo, whose backbone Carnator cannot see):
- fullgraph=True: the hooks are graph breaks between compiled graphs, which fullgraph turns into errors;
- CUDA graphs (mode "reduce-overhead" or "max-autotune", backend "cudagraphs"): a graph replay reuses its output
  memory, while the hooks keep tensors from one model call to the next (the signature, a region's keys and values).

`CompileWatch` counts what torch compiles while Carnator samples (dynamo's compile-start callback, and its counter of
frames it gave up on at the recompile limit). A run of a model, latent shape and schedule that already ran compiled
in this process should compile nothing: when it does, when torch hits its recompile limit, and in every later request
of a model it gave up on (those parts then run uncompiled), the request says so in a warning on the node.
"""
from __future__ import annotations

import contextlib
import re
from typing import Optional

import torch

from ..gate import RegionFallback

TORCH_COMPILE_KWARGS = "torch_compile_kwargs"      # comfy_api.torch_helpers' mark of a compiled MODEL
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
_LIMIT_HIT = "Dynamo recompile limit exceeded"     # torch's counters["unimplemented"] entry when it gives up a frame


def eager_frame(function):
    """`function` with its own frame never compiled by dynamo, while what it calls still is (a compiled block):
    decided once per code object, where torch.compiler.disable(recursive=False) would try to compile the frame again
    on every call. For hooks whose state must stay out of traced code."""
    skip = getattr(getattr(torch._dynamo, "decorators", None), "skip", None)
    return skip(function) if skip is not None else torch.compiler.disable(function, recursive=False)


def _compiled_patches(model) -> list:
    """Object patches of `model` that are torch.compile'd modules (KJNodes' blocks-only compile nodes)."""
    patches = getattr(model, "object_patches", None) or {}
    return [name for name, value in patches.items() if isinstance(value, torch._dynamo.eval_frame.OptimizedModule)]


def compile_settings(model) -> Optional[dict]:
    """The torch.compile settings of a MODEL (backend, mode, fullgraph, dynamic), or None when it is not compiled."""
    options = getattr(model, "model_options", None) or {}
    if TORCH_COMPILE_KWARGS in options:
        return dict(options[TORCH_COMPILE_KWARGS] or {})
    if _compiled_patches(model):
        return dict(getattr(getattr(model, "model", None), "compile_settings", None) or {})
    return None


def whole_model_refusal(model) -> str:
    """Why Carnator cannot find the diffusion model of a MODEL whose diffusion model is itself replaced by a compiled
    copy ("" otherwise): KJNodes' deprecated TorchCompileModelWanVideo with compile_transformer_blocks_only off."""
    if "diffusion_model" not in _compiled_patches(model):
        return ""
    return ("the model's diffusion model is replaced by a compiled copy (KJNodes' deprecated TorchCompileModelWanVideo "
            "with compile_transformer_blocks_only off): use TorchCompileModelWanVideoV2 or ComfyUI's "
            "TorchCompileModel in front of Carnator")


def compile_refusal(model) -> str:
    """Why Carnator cannot run this compiled MODEL ("" when it can, or when it is not compiled)."""
    settings = compile_settings(model)
    if settings is None:
        return ""
    if settings.get("fullgraph"):
        return ("the model is compiled with fullgraph=True (a KJNodes compile node's fullgraph input): Carnator's "
                "hooks run between compiled graphs, which fullgraph turns into an error. Set fullgraph to false")
    mode, backend = settings.get("mode") or "default", settings.get("backend") or "inductor"
    if mode in CUDA_GRAPH_MODES or backend == "cudagraphs":
        what = f"backend {backend}" if backend == "cudagraphs" else f"mode {mode}"
        return (f"the model is compiled with {what}, which captures CUDA graphs: a graph replay reuses its output "
                "memory, while Carnator keeps tensors from one model call to the next. Choose the inductor backend "
                "with mode default or max-autotune-no-cudagraphs")
    return ""


def region_only_unfit(settings: Optional[dict]) -> Optional[RegionFallback]:
    """Why a model compiled with `settings` resumes a hit whole-clip rather than region-only ("" when it can): with
    static shapes (dynamic=False, KJNodes' default) every target size would compile the blocks' graphs again, up to
    torch's recompile limit. With dynamic shapes (dynamic=True, or ComfyUI's TorchCompileModel, which leaves it to
    torch) the first region-only hit compiles them once for any size."""
    if settings is None or settings.get("dynamic") is not False:
        return None
    return RegionFallback("the model is compiled with static shapes",
                          "the model is compiled with static shapes (dynamic false on the compile node), which would "
                          "compile it again for every target size; set dynamic to true on the compile node for "
                          "region-only hits")


def _limit_hits() -> int:
    from torch._dynamo.utils import counters
    return sum(n for reason, n in counters["unimplemented"].items() if reason.startswith(_LIMIT_HIT))


class CompileWatch:
    """What torch compiled during Carnator's runs, for one request. `seen` (shared by every request of the process)
    holds the runs that already ran compiled: (model fingerprint, latent shape, schedule length, ...)."""

    seen: set = set()
    gave_up: set = set()        # models (fingerprints) some frames of which torch stopped compiling at its limit

    def __init__(self):
        self.compiles = 0           # frames dynamo compiled during this request's runs (recompiles included)
        self.recompiles = 0         # of them, frames it had compiled before (a guard failed)
        self.again = 0              # compiles in runs that had run compiled before: a storm when not 0
        self.limit_hits = 0         # frames torch gave up compiling at its recompile limit
        self.models: set = set()    # the models this request ran

    @staticmethod
    def _since_reset() -> None:
        """Forgets what ran compiled when torch._dynamo.reset() emptied its caches since (it also drops every
        compile callback, the sentinel registered here among them)."""
        from torch._dynamo import callback_handler
        if _sentinel not in callback_handler.start_callbacks:
            CompileWatch.seen.clear()
            CompileWatch.gave_up.clear()
            callback_handler.register_start_callback(_sentinel)

    @contextlib.contextmanager
    def run(self, key: tuple):
        """Counts the compiles while the block runs one sampler run identified by `key`."""
        from torch._dynamo import callback_handler
        self._since_reset()
        ids = []

        def started(args) -> None:
            ids.append(str(args.compile_id))
        callback_handler.register_start_callback(started)
        hits = _limit_hits()
        try:
            yield
        finally:
            callback_handler.remove_start_callback(started)
            compiled = len(ids)
            self.compiles += compiled
            self.recompiles += sum(1 for i in ids if _frame_compile_index(i) > 0)
            hit_limit = _limit_hits() - hits
            self.limit_hits += hit_limit
            if key in CompileWatch.seen:
                self.again += compiled
            CompileWatch.seen.add(key)
            self.models.add(key[0])
            if hit_limit:
                CompileWatch.gave_up.add(key[0])

    def warnings(self) -> list:
        said = []
        if self.again:
            said.append(f"torch.compile compiled parts of the model again {self.again} times in this request, "
                        "although runs of the same model, latent shape and steps had run compiled before: something "
                        "the compiled model reads changes from run to run (TORCH_LOGS=recompiles names it); past "
                        f"torch's recompile limit ({torch._dynamo.config.recompile_limit}) those parts run uncompiled")
        if self.limit_hits:
            said.append("torch.compile hit its recompile limit "
                        f"({torch._dynamo.config.recompile_limit}) during this request: part of the model runs "
                        "uncompiled from now on (TORCH_LOGS=recompiles says why; KJNodes' compile nodes raise the "
                        "limit with dynamo_cache_size_limit)")
        elif self.models & CompileWatch.gave_up:
            said.append("torch.compile stopped compiling parts of this model at its recompile limit earlier in this "
                        "process: they run uncompiled (TORCH_LOGS=recompiles says why)")
        return said


def _sentinel(_args) -> None:
    """A compile callback that does nothing: while registered, dynamo has not been reset (CompileWatch)."""


def _frame_compile_index(compile_id: str) -> int:
    """How many times dynamo had compiled the frame before ("3/1" -> 1; "3/1_2", a restart, -> 1)."""
    match = re.search(r"(\d+)/(\d+)(?:_\d+)?$", compile_id)
    return int(match.group(2)) if match else 0


__all__ = ["eager_frame", "compile_settings", "compile_refusal", "whole_model_refusal", "region_only_unfit",
           "CompileWatch", "TORCH_COMPILE_KWARGS"]
