"""One fingerprint of everything on a ComfyUI MODEL that can change what it outputs.

`model_key(model, backbone)` walks the ModelPatcher: the diffusion model's weights as loaded, weight patches
(LoRAs) with their strengths, hook patches, object patches, the model_sampling in use (ModelSamplingSD3's
shift...), the patcher's wrappers and callbacks, and every entry of model_options (transformer_options:
wrappers, callbacks, patches, patches_replace, attention overrides, step caches such as ComfyUI's EasyCache /
LazyCache; guidance functions such as sampler_cfg_function). Each option is fingerprinted by value:
functions by their code, defaults and closure values, modules by their class, buffers/parameters and plain
attributes, known step caches by their settings; code from a custom node by its pack's name and its place in the
pack, never by the folder it is installed in (portable_module_name). Anything else (an object of a class Carnator does not know,
a closure over one) is *named* in `ModelKey.unknown`: reusing across such a model could serve a result that a
different option produced, so the pipeline generates that request plainly instead (no lookup, no repeat,
nothing stored).

A node author whose option Carnator cannot read (a closure over an object, or over state that changes while it
runs) may set `carnator_fingerprint` on the function or object: a string naming it and whatever in it changes
the outputs ("" for a pure observer, such as a call counter; two observers are then alike).

The bucket, the exact-repeat key and the "why a new bucket" text all come from the ModelKey.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import math
import os
import re
import sys
import tomllib
import types
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ..fingerprint import hash_values, module_fingerprint

MAX_DEPTH = 12
WHOLE_TENSOR = 1 << 16          # option tensors up to this many elements are hashed whole,
SAMPLED = 4096                  # larger ones (LoRA weights) by this many evenly strided values
STEP_CACHE_KEY = "easycache"    # where ComfyUI's EasyCache and LazyCache nodes put their holder
_STEP_CACHE_CLASSES = {"EasyCacheHolder": "EasyCache", "LazyCacheHolder": "LazyCache"}
STEP_CACHE_SETTINGS = ("reuse_threshold", "start_percent", "end_percent", "subsample_factor")


@dataclass(frozen=True)
class StepCache:
    """A step cache Carnator knows how to fingerprint and run (ComfyUI's EasyCache / LazyCache)."""
    name: str
    settings: tuple     # ((name, value), ...) in STEP_CACHE_SETTINGS order

    def text(self) -> str:
        return f"{self.name} " + ", ".join(f"{k}={v:g}" for k, v in self.settings)


@dataclass(frozen=True)
class ModelKey:
    digest: str
    described: tuple            # one line per option that is set, for people
    unknown: tuple = ()         # options that could not be fingerprinted (path: why)
    step_cache: Optional[StepCache] = None

    def uncacheable(self) -> str:
        """Empty when the key is complete; otherwise why the request must be generated without the cache."""
        if not self.unknown:
            return ""
        places = "; ".join(dict.fromkeys(map(_for_people, self.unknown)))
        return (f"Carnator cannot compare the settings of {places}, so a cached result could come from other "
                "settings: this request is generated in full without the cache (nothing looked up, repeated or "
                "stored). Bypass that node to use the cache; its author can make it comparable (docs/composing.md)")

    def text(self) -> str:
        return "; ".join(self.described)


# Where an option sits on the MODEL, as the walk names it, and the same in the words of the node that put it there.
_PLACES = [(re.compile(r"^(wrapper|callback)s\['(\w+)'\]\['([^']*)'\](\[\d+\])?"),
            lambda m: f"another node's {m[1]} on the {m[2].replace('_', ' ')} ('{m[3]}')"),
           (re.compile(r"^(wrapper|callback)s\['(\w+)'\]\[None\](\[\d+\])?"),     # registered without a key
            lambda m: f"another node's {m[1]} ({m[2]})"),
           (re.compile(r"^object patches\['([^']*)'\]"), lambda m: f"the {m[1].replace('_', ' ')} patch"),
           (re.compile(r"^model_options\['transformer_options'\]\['([^']*)'\]"),
            lambda m: f"transformer option {m[1].replace('_', ' ')}"),
           (re.compile(r"^model_options\['([^']*)'\]"), lambda m: f"model option {m[1].replace('_', ' ')}"),
           # what the walk says for the node's author (the closure, the class) means nothing to a creator
           (re.compile(r" \(closure \w+\)"), lambda m: ""),
           (re.compile(r" \(an object of type [^)]*\)"), lambda m: ""),
           (re.compile(r" \(nested too deep to read\)"), lambda m: " (settings nested too deep to read)")]


def _object_for_people(value) -> str:
    """An object whose settings cannot be read: a ComfyUI node (a class with INPUT_TYPES or a V3 schema) by the
    name the creator sees in the graph, any other by its type for the node's author."""
    kind = type(value)
    if hasattr(kind, "INPUT_TYPES") or hasattr(kind, "define_schema"):
        return f"set by the {kind.__name__} node"
    made = f" made in {_origin(value)}" if "<locals>" in _qualname(value) else ""
    return f"an object of type {kind.__name__}{made}"


def _for_people(unknown: str) -> str:
    """An option Carnator cannot read, named as a creator knows it: "another node's wrapper on the diffusion model
    ('third_party')" for wrappers['diffusion_model']['third_party'][0] (closure opaque) (an object of type
    Opaque); a step cache's setting it cannot read keeps its name and value."""
    for pattern, words in _PLACES:
        unknown = pattern.sub(words, unknown)
    return unknown


class _Walk:
    """Digest of option values; what it cannot read is collected by name."""

    def __init__(self, own: frozenset = frozenset()):
        self.own = own              # ids of the model's own modules (their weights are keyed as the model's)
        self.digest = hashlib.sha256()
        self.unknown: list = []
        self.step_cache: Optional[StepCache] = None
        self._seen: set = set()

    def add(self, path: str, value, depth: int = 0) -> None:
        self.digest.update(f"<{path}>".encode())
        self._value(path, type(value)() if _observer(value) else value, depth)

    def _text(self, text: str) -> None:
        self.digest.update(text.encode())

    def _value(self, path: str, value, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.unknown.append(f"{path} (nested too deep to read)")
            return
        declared = _declared(value)
        if declared is not None:
            self._text(f"declared:{declared}")     # the author's word: two pure observers ("") are alike
        elif value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                                  enum.Enum)):
            self._text(f"{type(value).__name__}:{value!r}")
        elif torch.is_tensor(value):
            self._tensor(value)
        elif isinstance(value, (list, tuple)):
            items = [item for item in value if not _observer(item)]
            self._text(f"{type(value).__name__}[{len(items)}")
            for i, item in enumerate(items):
                self._value(f"{path}[{i}]", item, depth + 1)
        elif isinstance(value, (set, frozenset)):
            self._text(f"set[{len(value)}")
            for item in sorted(value, key=repr):
                self._value(path, item, depth + 1)
        elif isinstance(value, dict):
            keys = [key for key in sorted(value, key=str) if not _observer(value[key])]
            self._text(f"dict[{len(keys)}")
            for key in keys:
                self._text(f"key:{key!s}")
                self._value(f"{path}[{key!r}]", value[key], depth + 1)
        elif _step_cache_name(value):
            self._step_cache(path, value)
        elif isinstance(value, functools.partial):
            self._text("partial")
            self._value(path, value.func, depth + 1)
            self._value(f"{path}.args", value.args, depth + 1)
            self._value(f"{path}.keywords", value.keywords, depth + 1)
        elif isinstance(value, types.MethodType):
            self._value(path, value.__func__, depth + 1)
            self._value(f"{path}.__self__", value.__self__, depth + 1)
        elif isinstance(value, types.FunctionType):
            self._function(path, value, depth)
        elif isinstance(value, types.ModuleType):     # a closure over an imported module: its name says it
            self._text(f"pymodule:{portable_module_name(value.__name__)}")
        elif isinstance(value, (types.BuiltinFunctionType, type)):
            self._text(f"{portable_module_name(getattr(value, '__module__', None) or '')}.{_qualname(value)}")
        elif isinstance(value, torch.nn.Module):
            self._module(path, value, depth)
        elif hasattr(value, "weights") and type(value).__module__.startswith("comfy.weight_adapter"):
            self._text(_qualname(value))   # LoRA, LoHa, LoKr adapters: their weights decide
            self._value(path, value.weights, depth + 1)
        else:
            self.unknown.append(f"{path} ({_object_for_people(value)})")

    def _tensor(self, value: torch.Tensor) -> None:
        flat = value.detach().reshape(-1)
        self._text(f"T{tuple(value.shape)}{value.dtype}")
        if flat.numel():
            sample = flat if flat.numel() <= WHOLE_TENSOR else flat[::flat.numel() // SAMPLED]
            hash_values(self.digest, sample)

    def _function(self, path: str, function: types.FunctionType, depth: int) -> None:
        self._text(f"fn:{portable_module_name(function.__module__ or '')}.{function.__qualname__}")
        if id(function) in self._seen:     # recursion through a closure that refers to itself
            return
        self._seen.add(id(function))
        self._code(function.__code__)
        self._value(f"{path}.__defaults__", function.__defaults__, depth + 1)
        self._value(f"{path}.__kwdefaults__", function.__kwdefaults__, depth + 1)
        for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
            try:
                content = cell.cell_contents
            except ValueError:          # a cell not yet filled
                content = None
            self._value(f"{path} (closure {name})", content, depth + 1)

    def _code(self, code: types.CodeType) -> None:
        self.digest.update(code.co_code)
        self._text(repr(code.co_names))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const)
            else:
                self._text(repr(const))

    def _module(self, path: str, module: torch.nn.Module, depth: int) -> None:
        compiled = getattr(module, "_orig_mod", None)
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) and isinstance(compiled, torch.nn.Module):
            # torch.compile of a module: what it compiles. The model's own diffusion model or block (compile nodes)
            # is keyed by the model's weights and patches already; its weights read now would be whichever LoRA
            # ComfyUI last patched into them in place
            self._text("compiled")
            if id(compiled) in self.own:
                self._text(f"own:{portable_module_name(type(compiled).__module__)}.{_qualname(compiled)}")
            else:
                self._module(path, compiled, depth + 1)
            return
        self._text(f"module:{portable_module_name(type(module).__module__)}.{_qualname(module)}")
        self._text(module_fingerprint(module))
        for name, buffer in module.named_buffers():    # non-persistent buffers (a schedule's sigmas) too
            self._text(name)
            self._tensor(buffer)
        for name, attribute in sorted(vars(module).items()):
            if not name.startswith("_") and (attribute is None or isinstance(attribute, (bool, int, float, str))):
                self._text(f"{name}={attribute!r}")

    def _step_cache(self, path: str, holder) -> None:
        name = _step_cache_name(holder)
        settings = []
        for setting in STEP_CACHE_SETTINGS:
            value = getattr(holder, setting, None)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                self.unknown.append(f"{path} ({name} {setting}={value!r} is not a number Carnator can read)")
                return
            settings.append((setting, float(value)))
        cache = StepCache(name, tuple(settings))
        self._text(f"stepcache:{cache.text()}")
        if self.step_cache is not None and self.step_cache != cache:
            self.unknown.append(f"{path} (a second step cache)")
        self.step_cache = cache


# a module ComfyUI's custom-node loader imported under its install path: (the path of the pack, the module in it)
_INSTALLED = re.compile(r"^(.*[/\\][^./\\]+)(?:\.(.*))?$")


def portable_module_name(name: str) -> str:
    """A module's name as every install of its code gives it. ComfyUI imports a custom node under the path of its
    folder ("/srv/ComfyUI/custom_nodes/comfyui-pack.nodes.wrap", dots of the path as "_x_"), which differs between
    machines and workers: the key takes the pack's identity instead, with the module's name inside the pack
    ("custom node comfyui-pack: nodes.wrap"). Other modules (ComfyUI's own, installed packages) keep their name."""
    match = _INSTALLED.match(name)
    if match is None:
        return name
    return f"custom node {_pack_identity(match[1])}: {match[2] or ''}"


@functools.lru_cache(maxsize=None)
def _pack_identity(loaded_as: str) -> str:
    """The name a custom-node pack gives itself, whatever folder it sits in: the project name of its pyproject.toml
    (the registry's id, the same for a git clone and a registry install), else its folder's (or file's) name."""
    path = getattr(sys.modules.get(loaded_as), "__file__", None) or loaded_as
    folder = os.path.dirname(path) if os.path.basename(path) == "__init__.py" else ""
    if folder:
        try:
            with open(os.path.join(folder, "pyproject.toml"), "rb") as handle:
                name = tomllib.load(handle)["project"]["name"]
            if isinstance(name, str) and name:
                return name
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return os.path.splitext(os.path.basename(folder or path.replace("\\", "/")))[0]


def _declared(value) -> Optional[str]:
    declared = getattr(value, "carnator_fingerprint", None) if not isinstance(value, (dict, str)) else None
    return declared if isinstance(declared, str) else None


def _observer(value) -> bool:
    """A declared pure observer (carnator_fingerprint ""), or a non-empty container of nothing else: left out of
    the key, so a model with a call counter is the model without it."""
    if _declared(value) == "":
        return True
    if isinstance(value, (list, tuple, dict)) and value:
        return all(_observer(item) for item in (value.values() if isinstance(value, dict) else value))
    return False


def _qualname(value) -> str:
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def _step_cache_name(value) -> Optional[str]:
    cls = type(value)
    if cls.__module__.endswith("nodes_easycache"):
        return _STEP_CACHE_CLASSES.get(cls.__name__)
    return None


def _origin(value) -> str:
    """Where a function or class comes from, as a creator knows it: the node class (or function) it was defined in
    ("ModelSamplingSD3" for ModelSamplingSD3.patch.<locals>.ModelSamplingAdvanced), else its own name."""
    return _qualname(value).split(".<locals>")[0].split(".")[0]


def _settings(module: torch.nn.Module) -> str:
    """A patched module's settings as its node's inputs name them: `shift` where it has one (model sampling
    patches: the rest are ComfyUI's internals), else every plain number it holds."""
    numbers = {k: v for k, v in sorted(vars(module).items())
               if not k.startswith("_") and isinstance(v, (int, float)) and not isinstance(v, bool)}
    shown = {"shift": numbers["shift"]} if "shift" in numbers else numbers
    return ", ".join(f"{k}={v:g}" for k, v in shown.items())


def _label(value) -> str:
    """A short name of an option for the "why a new bucket" text, in a creator's words: the node it comes from and
    its settings, never a Python qualified name ("" for a declared observer)."""
    declared = _declared(value)
    if declared is not None:
        return declared
    if _step_cache_name(value):
        return ""       # described from the step cache's settings
    if isinstance(value, torch.nn.Module):
        settings = _settings(value)
        return f"from {_origin(value)}" + (f", {settings}" if settings else "")
    if isinstance(value, (list, tuple)):
        return "; ".join(label for label in map(_label, value) if label)
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_label(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
    if isinstance(value, functools.partial):
        return _label(value.func)
    if isinstance(value, types.MethodType):
        return _label(value.__func__)
    if callable(value):
        return f"from {_origin(value)}"
    return repr(value)


def _patch_text(name: str, value) -> str:
    """An object patch for people: "model sampling patch (from ModelSamplingSD3, shift=8)"."""
    return f"{name.replace('_', ' ')} patch ({_label(value)})"


def _hook_text(kind: str, stage: str, functions) -> str:
    """A wrapper or callback another node put on the model: "another node's wrapper on the diffusion model (from
    ScaleOutputNode)"."""
    label = _label(functions)
    return f"another node's {kind} on the {stage.replace('_', ' ')} ({label})" if label else ""


# ---- the diffusion model's own weights -------------------------------------------------------------

_BASE_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _LoadedWeights:
    """The diffusion model's weights as loaded from disk. While a patched clone (a LoRA) is loaded, ComfyUI
    patches the shared weights in place and keeps the originals in the patcher's `backup`: those are read
    instead, so every clone of one model sees the same base weights."""

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        backup = getattr(self.model, "backup", None) or {}
        diffusion = self.model.model.diffusion_model
        weights = diffusion.state_dict()
        parameters = None
        for name in list(weights):
            saved = backup.get("diffusion_model." + name)
            if saved is not None:
                weights[name] = saved.weight
            elif weights[name].device.type == "meta":
                # ComfyUI-GGUF's layers give a state dict of empty (meta) tensors, a size estimate: their parameters
                # hold the quantized bytes, which are what identifies the weights
                parameters = parameters if parameters is not None else dict(diffusion.named_parameters())
                if name in parameters:
                    weights[name] = parameters[name]
                else:
                    del weights[name]
        return weights


def weight_formats(diffusion) -> str:
    """The quantized formats of the weights ("Q8_0 x 20, F32 x 41"), from the `tensor_type` that ComfyUI-GGUF's
    weights carry; "" for plain tensors. Their bytes are in the weights' fingerprint already; the format is named as
    well, so the "why a new bucket" text says it."""
    counts: dict = {}
    for parameter in diffusion.parameters():
        kind = getattr(parameter, "tensor_type", None)
        if kind is not None:
            name = getattr(kind, "name", str(kind))
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{name} x {count}" for name, count in sorted(counts.items()))


def host_version() -> str:
    try:
        import comfyui_version
        return str(comfyui_version.__version__)
    except Exception:  # a ComfyUI checkout without the generated version file
        return "unknown"


def model_key(model, backbone) -> ModelKey:
    """The ModelKey of a ComfyUI MODEL (ModelPatcher) whose backbone is `backbone` (comfyui.backbone_for)."""
    diffusion = model.model.diffusion_model
    weights = _BASE_WEIGHTS.get(diffusion)
    if weights is None:
        weights = _BASE_WEIGHTS[diffusion] = module_fingerprint(_LoadedWeights(model))
    base = model.model
    walk = _Walk(own=frozenset(id(m) for m in base.modules()))
    formats = weight_formats(diffusion)
    walk.add("base", [weights, backbone.model_class, type(diffusion).__name__, backbone.layout.name,
                      str(backbone.layout.patch_size), str(model.model_dtype()),
                      str(getattr(base, "manual_cast_dtype", None)), type(base.latent_format).__name__,
                      f"comfyui={host_version()}"] + ([f"weights={formats}"] if formats else []))
    described = [f"GGUF weights: {formats}"] if formats else []
    options = {
        "weight patches": model.patches,
        "hook patches": list((getattr(model, "hook_patches", None) or {}).values()),  # keys are per-process refs
        "weight wrapper patches": getattr(model, "weight_wrapper_patches", None) or {},
        "object patches": model.object_patches,
        "wrappers": getattr(model, "wrappers", None) or {},
        "callbacks": getattr(model, "callbacks", None) or {},
        "attachments": getattr(model, "attachments", None) or {},
        "model_options": model.model_options,
    }
    for name, value in options.items():
        walk.add(name, value)
    walk.add("model_sampling", model.get_model_object("model_sampling"))
    for name in ("additional_models", "injections"):
        if getattr(model, name, None):
            walk.unknown.append(f"{name} {sorted(getattr(model, name))} (models or code injected into the MODEL)")

    if model.patches:
        described.append(f"weight patches on {len(model.patches)} weights (LoRA-style)")
    if options["hook patches"]:
        described.append(f"hook patches: {len(options['hook patches'])}")
    for name in ("weight wrapper patches", "attachments"):
        if options[name]:
            described.append(f"{name}: {', '.join(sorted(map(str, options[name])))}")
    for name, value in sorted(model.object_patches.items()):
        described.append(_patch_text(name, value))
    for kind in ("wrappers", "callbacks"):
        for stage, keyed in sorted(options[kind].items()):
            for functions in keyed.values():
                described.append(_hook_text(kind[:-1], stage, functions))
    _describe_model_options(model.model_options, described)
    if walk.step_cache is not None:
        described.append(walk.step_cache.text())
    return ModelKey(walk.digest.hexdigest()[:24], tuple(d for d in described if d), tuple(walk.unknown),
                    walk.step_cache)


def _describe_model_options(model_options: dict, described: list) -> None:
    for name, value in sorted(model_options.items()):
        if name == "transformer_options":
            for key, option in sorted(value.items()):
                if key in ("wrappers", "callbacks") and isinstance(option, dict):
                    for stage, keyed in sorted(option.items()):
                        for functions in keyed.values():
                            described.append(_hook_text(key[:-1], stage, functions))
                elif (option or option == 0) and _label(option):
                    described.append(f"transformer option {key.replace('_', ' ')} ({_label(option)})")
        elif (value or value == 0) and _label(value):
            described.append(f"model option {name.replace('_', ' ')} ({_label(value)})")


__all__ = ["ModelKey", "StepCache", "model_key", "host_version", "STEP_CACHE_KEY", "STEP_CACHE_SETTINGS"]
