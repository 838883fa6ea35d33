"""Carnator's ComfyUI nodes (V1 API). Thin: check and parse inputs, call the engine, return.

The four stages of carnator_engine.pipeline as separate nodes (Early Probe -> Signature Cache Lookup ->
Compatibility Gate -> Trajectory Resume), the store they share (Carnator Cache), and the all-in-one
Carnator Sampler. Objects passed between the stage nodes carry the probe's token, so a Gate or Resume fed
from another probe's outputs is refused instead of silently mixing requests.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Optional

from carnator_engine import pipeline
from carnator_engine.gate import RISK_LEVELS, RISK_POLICIES, SWITCHES, Decision
from carnator_engine.store import MIN_SIZE_LIMIT, CarnatorStore, StoreError

from .inputs import (PreparedLatent, check_attention_density, check_latent, check_model, check_number, fail,
                     make_config, progress_callback, prompt_text, send_decision, summary_text, to_json)
from .stores import open_store

CATEGORY = "Carnator"
_SAMPLER_FALLBACK = ["euler"]
_SCHEDULER_FALLBACK = ["simple"]


def _samplers() -> list:
    try:
        import comfy.samplers
        return list(comfy.samplers.KSampler.SAMPLERS)
    except ImportError:  # the node module imported without ComfyUI (docs, host-free tests)
        return list(_SAMPLER_FALLBACK)


def _schedulers() -> list:
    try:
        import comfy.samplers
        return list(comfy.samplers.KSampler.SCHEDULERS)
    except ImportError:
        return list(_SCHEDULER_FALLBACK)


def _request_inputs(probe_steps_default: int = 3) -> dict:
    return {
        "model": ("MODEL", {"tooltip": "A Wan 2.1/2.2, HunyuanVideo or LTX-Video model (LoRAs and patches are part of the cache key); with a low_noise_model, Wan 2.2 A14B's high-noise expert."}),
        "positive": ("CONDITIONING",),
        "negative": ("CONDITIONING",),
        "latent_image": ("LATENT", {"tooltip": "An empty video latent, e.g. EmptyHunyuanLatentVideo for Wan 2.1."}),
        "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF, "control_after_generate": True}),
        "steps": ("INT", {"default": 30, "min": 2, "max": 10000}),
        "cfg": ("FLOAT", {"default": 6.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01}),
        "sampler_name": (_samplers(), {"default": "euler"}),
        "scheduler": (_schedulers(), {"default": "simple"}),
        "probe_steps": ("INT", {"default": probe_steps_default, "min": 1, "max": 1000,
                                "tooltip": "Steps run before the cache is consulted (the Early Signature)."}),
    }


# Wan 2.2 A14B: the second expert and where it takes over (ComfyUI's template: 20 steps, switch at step 10)
_EXPERT_INPUTS = {
    "low_noise_model": ("MODEL", {"tooltip": "Wan 2.2 A14B's low-noise expert: runs the steps from the switch on "
                                             "('model' is then the high-noise expert). Leave unconnected for one model."}),
    "switch_step": ("INT", {"default": 0, "min": 0, "max": 10000, "tooltip":
                            "Step at which the low-noise expert takes over (the first KSamplerAdvanced's end_at_step "
                            "in ComfyUI's template). 0 = from boundary_sigma."}),
    "boundary_sigma": ("FLOAT", {"default": 0.875, "min": 0.0, "max": 1.0, "step": 0.001, "tooltip":
                                 "With switch_step 0: the high-noise expert runs every step whose sigma is at least "
                                 "this (Wan 2.2 T2V: 0.875)."}),
}
_HIDDEN = {"unique_id": "UNIQUE_ID", "prompt": "PROMPT"}
_RISK = (list(RISK_LEVELS), {"default": "balanced",
                             "tooltip": "safe: reuse only close matches, resume early; aggressive: reuse more, resume later."})
_ATTENTION_DENSITY = ("FLOAT", {"default": 1.0, "min": 0.05, "max": 1.0, "step": 0.05, "tooltip":
                                "Budget of the attention connectivity a miss records for later hits: the share of key "
                                "blocks each query block keeps (its largest). 1 = keep 90 % of the attention mass, "
                                "however many blocks that takes; 0.3 made a Wan 1.3B-size hit 2.3x faster on an H200."})


@dataclass
class ProbeBundle:
    """CARNATOR_PROBE: a request after its probe steps, ready for lookup and resume."""
    runner: object
    probed: pipeline.ProbeResult
    config: pipeline.CarnatorConfig
    seed: int
    prompt: str
    latent_extra: dict
    directory: Optional[str] = None   # the cache the probe checked for an exact repeat
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class MatchesBundle:
    """CARNATOR_MATCHES: nearest cached generations for one probe."""
    probe_token: str
    directory: str
    candidates: list


@dataclass
class DecisionBundle:
    """CARNATOR_DECISION: the gate's decision for one probe."""
    probe_token: str
    directory: str
    decision: Decision
    config: pipeline.CarnatorConfig


def _prepare(node: str, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
             probe_steps, experts: dict):
    """Checks a request's inputs; returns (runner, noise, prepared latent). Nothing is run or stored yet.
    The runner reports its steps to ComfyUI's progress bar (and latent previews when enabled)."""
    import comfy.sample
    from carnator_engine.hosts.comfyui import ComfyRunner
    backbone = check_model(node, model)
    latent: PreparedLatent = check_latent(node, model, latent_image, backbone)
    cfg = check_number(node, "cfg", cfg)
    if cfg < 0:
        raise fail(node, "cfg", f"cfg={cfg} must be >= 0")
    try:
        runner = ComfyRunner(model, positive, negative, cfg, sampler_name, scheduler=scheduler, steps=int(steps),
                             seed=int(seed), **experts)
    except ValueError as error:
        name = getattr(error, "input_name", None) or (
            "sampler_name" if "sampler_name" in str(error) else "scheduler" if "scheduler" in str(error) else "model")
        raise fail(node, name, str(error)) from None
    if runner.switch_step is not None and int(probe_steps) > runner.switch_step:
        raise fail(node, "probe_steps", f"probe_steps={probe_steps} is beyond the switch to the low-noise expert "
                                        f"(step {runner.switch_step}): the probe runs on the high-noise expert")
    noise = comfy.sample.prepare_noise(latent.samples, int(seed), latent.extra.get("batch_index"))
    runner = runner.with_step_callback(progress_callback(model, int(steps)))
    return runner, noise, latent


def _default_block_size(model) -> int:
    device = getattr(getattr(model, "load_device", None), "type", "cpu")
    return 128 if device == "cuda" else 64   # FlexAttention's tile on GPUs


class CarnatorCache:
    DESCRIPTION = ("The store of earlier generations (survives restarts): a folder, or a redis:// URL for one store "
                   "shared by many ComfyUI workers. Leave cache_dir empty for ComfyUI's user directory.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "cache_dir": ("STRING", {"default": "", "tooltip": "Folder of the cache (empty = <user dir>/carnator_cache), or redis://[:password@]host:port/db (rediss:// with TLS; the password may also come from CARNATOR_REDIS_PASSWORD)."}),
            "size_limit_gb": ("FLOAT", {"default": 8.0, "min": 0.001, "max": 100000.0, "step": 0.5,
                                        "tooltip": "Least useful entries are evicted beyond this size."}),
        }}

    RETURN_TYPES = ("CARNATOR_CACHE",)
    RETURN_NAMES = ("cache",)
    FUNCTION = "open"
    CATEGORY = CATEGORY

    def open(self, cache_dir: str, size_limit_gb: float):
        node = "Carnator Cache"
        size = check_number(node, "size_limit_gb", size_limit_gb)
        limit = int(size * (1 << 30))
        if limit < MIN_SIZE_LIMIT:
            raise fail(node, "size_limit_gb", f"size_limit_gb={size} is below the minimum of "
                                              f"{MIN_SIZE_LIMIT / (1 << 30):.4f} GB (1 MiB): raise it")
        if not isinstance(cache_dir, str):
            raise fail(node, "cache_dir", "must be a folder path or a redis:// URL (text)")
        try:
            store = open_store(cache_dir, limit)
        except (StoreError, OSError) as error:
            raise fail(node, "cache_dir", str(error)) from None
        return (store,)


def _expect(node: str, name: str, value, kind: type, source: str):
    """The output of another Carnator node, or an error saying which node to connect."""
    if not isinstance(value, kind):
        raise fail(node, name, f"is not what a {source} node gives: connect a {source} node")
    return value


def _check_store(node: str, cache) -> CarnatorStore:
    return _expect(node, "cache", cache, CarnatorStore, "Carnator Cache")


class CarnatorEarlyProbe:
    DESCRIPTION = "Runs the first probe_steps of the request with hooks that record its Early Signature."

    @classmethod
    def INPUT_TYPES(cls):
        inputs = _request_inputs()
        inputs["block_size"] = ("INT", {"default": 0, "min": 0, "max": 1024, "step": 16,
                                        "tooltip": "Tokens per attention block; 0 picks FlexAttention's 128 "
                                                   "on GPUs and 64 on the CPU."})
        optional = {"cache": ("CARNATOR_CACHE", {"tooltip": "Connect the Carnator Cache to answer an exact repeat "
                                                            "with its stored result before any probe step runs."}),
                    **_EXPERT_INPUTS}
        return {"required": inputs, "optional": optional, "hidden": dict(_HIDDEN)}

    RETURN_TYPES = ("CARNATOR_PROBE",)
    RETURN_NAMES = ("probe",)
    FUNCTION = "probe"
    CATEGORY = CATEGORY

    def probe(self, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
              probe_steps, block_size, unique_id=None, prompt=None, cache=None, **experts):
        node = "Carnator Early Probe"
        store = None if cache is None else _check_store(node, cache)
        config = make_config(node, steps, probe_steps, block_size=block_size or _default_block_size(model))
        runner, noise, latent = _prepare(node, model, positive, negative, latent_image, seed, steps, cfg,
                                         sampler_name, scheduler, probe_steps, experts)
        probed = pipeline.probe(runner, noise, runner.sigmas, config, store=store)
        return (ProbeBundle(runner, probed, config, int(seed), prompt_text(prompt, unique_id), latent.extra,
                            None if store is None else store.location),)


def _check_probe(node: str, probe) -> ProbeBundle:
    return _expect(node, "probe", probe, ProbeBundle, "Carnator Early Probe")


class CarnatorSignatureCacheLookup:
    DESCRIPTION = "Finds the cached generations nearest to the probe (same model, patches, shape and schedule)."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"cache": ("CARNATOR_CACHE",), "probe": ("CARNATOR_PROBE",),
                             "limit": ("INT", {"default": 3, "min": 1, "max": 64})}}

    RETURN_TYPES = ("CARNATOR_MATCHES",)
    RETURN_NAMES = ("matches",)
    FUNCTION = "lookup"
    CATEGORY = CATEGORY

    def lookup(self, cache, probe, limit):
        node = "Carnator Signature Cache Lookup"
        store = _check_store(node, cache)
        bundle = _check_probe(node, probe)
        if int(limit) < 1:
            raise fail(node, "limit", f"limit={limit} must be >= 1")
        if bundle.directory is not None and bundle.directory != store.location:
            raise fail(node, "cache", f"is {store.location!r} but the probe checked {bundle.directory!r}: connect "
                                      "the same Carnator Cache to the Early Probe, Lookup and Resume")
        config = dataclasses.replace(bundle.config, lookup_limit=int(limit))
        candidates = pipeline.lookup(store, bundle.probed, config)
        repeat = bundle.probed.repeat
        lines = [f"exact repeat of entry {repeat[0]}: no lookup needed"] if repeat is not None else \
            [f"{len(candidates)} candidate(s)"] + [
            f"{c.record.entry_id}: denoised {c.distance.denoised:.3f}, hidden {c.distance.hidden:.4f}, "
            f"attention {c.distance.attention:.3f}" for c in candidates]
        return {"ui": {"text": ["\n".join(lines)]},
                "result": (MatchesBundle(bundle.token, store.location, candidates),)}


_OVERRIDES = ("max_hidden", "max_attention", "max_context", "cell_threshold", "max_target_fraction",
              "max_resume_fraction")


class CarnatorCompatibilityGate:
    DESCRIPTION = ("Decides, from the model's own early states, whether to reuse a cached trajectory and from "
                   "which step. Threshold inputs at 0 use the risk level's preset.")

    @classmethod
    def INPUT_TYPES(cls):
        optional = {name: ("FLOAT", {"default": 0.0, "min": 0.0, "max": 10.0, "step": 0.001,
                                     "tooltip": f"0 = preset ({RISK_POLICIES['balanced'].__dict__[name]} "
                                                "for balanced)"}) for name in _OVERRIDES}
        optional["min_saved_steps"] = ("INT", {"default": 0, "min": 0, "max": 10000,
                                               "tooltip": "0 = preset: a hit must save at least this many steps."})
        optional["refine_target"] = ("BOOLEAN", {"default": RISK_POLICIES["balanced"].refine_target, "tooltip":
                                     "Spend one model call midway re-estimating the region that differs from the "
                                     "cached generation, instead of extrapolating it from the probe (fewer wrong "
                                     "reuses; off saves that call)."})
        optional["shrink_with_risk"] = ("BOOLEAN", {"default": RISK_POLICIES["balanced"].shrink_with_risk, "tooltip":
                                        "Resume earlier the closer the match is to a limit. Off: every accepted "
                                        "match resumes at the furthest step the risk level allows."})
        return {"required": {"probe": ("CARNATOR_PROBE",), "matches": ("CARNATOR_MATCHES",), "risk": _RISK},
                "optional": optional, "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("CARNATOR_DECISION", "STRING")
    RETURN_NAMES = ("decision", "decision_json")
    FUNCTION = "decide"
    CATEGORY = CATEGORY

    def decide(self, probe, matches, risk, unique_id=None, **thresholds):
        node = "Carnator Compatibility Gate"
        bundle = _check_probe(node, probe)
        _expect(node, "matches", matches, MatchesBundle, "Carnator Signature Cache Lookup")
        if matches.probe_token != bundle.token:
            raise fail(node, "matches", "comes from another probe: feed the Signature Cache Lookup with this probe")
        # a switch left unset keeps the risk preset's value
        overrides = {name: bool(thresholds.pop(name)) for name in SWITCHES if name in thresholds}
        for name, value in thresholds.items():
            if name not in _OVERRIDES and name != "min_saved_steps":
                continue
            value = check_number(node, name, value)
            if value < 0:
                raise fail(node, name, f"{name}={value} must be >= 0 (0 uses the risk preset)")
            if value > 0:
                overrides[name] = int(value) if name == "min_saved_steps" else value
        config = make_config(node, bundle.probed.steps, bundle.config.probe_steps, risk,
                             bundle.config.block_size, bundle.config.sparse_attention, overrides)
        decision = pipeline.decide(bundle.probed, matches.candidates, config)
        summary = decision.summary()
        send_decision(unique_id, summary)
        return {"ui": {"text": [summary_text(summary)]},
                "result": (DecisionBundle(bundle.token, matches.directory, decision, config), to_json(summary))}


def _latent_out(runner, bundle_extra: dict, latent) -> dict:
    return {**bundle_extra, "samples": runner.to_latent_format(latent).cpu()}


class CarnatorTrajectoryResume:
    DESCRIPTION = ("Finishes the request: from the cached trajectory on a hit, from the probe on a miss; "
                   "then stores it for later requests.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"cache": ("CARNATOR_CACHE",), "probe": ("CARNATOR_PROBE",),
                             "decision": ("CARNATOR_DECISION",),
                             "sparse_attention": ("BOOLEAN", {"default": True, "tooltip":
                                                  "Resume with the cached block-sparse attention (dense where the "
                                                  "request differs)."})},
                "optional": {"attention_density": _ATTENTION_DENSITY},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    RETURN_TYPES = ("LATENT", "STRING")
    RETURN_NAMES = ("latent", "summary_json")
    FUNCTION = "resume"
    CATEGORY = CATEGORY

    def resume(self, cache, probe, decision, sparse_attention, attention_density=1.0, unique_id=None):
        node = "Carnator Trajectory Resume"
        store = _check_store(node, cache)
        bundle = _check_probe(node, probe)
        _expect(node, "decision", decision, DecisionBundle, "Carnator Compatibility Gate")
        if decision.probe_token != bundle.token:
            raise fail(node, "decision", "was made for another probe: feed the Gate and this node the same probe")
        if decision.decision.reuse and decision.directory != store.location:
            raise fail(node, "cache", f"is {store.location!r} but the decision reuses an entry of "
                                      f"{decision.directory!r}: connect the same Carnator Cache to Lookup and Resume")
        config = dataclasses.replace(decision.config, sparse_attention=bool(sparse_attention),
                                     max_density=check_attention_density(node, attention_density))
        runner = bundle.runner.with_step_callback(progress_callback(bundle.runner.model, bundle.probed.steps))
        result = pipeline.resume(runner, bundle.probed, decision.decision, store, config, bundle.prompt, bundle.seed)
        summary = result.summary()
        send_decision(unique_id, summary)
        return {"ui": {"text": [summary_text(summary)]},
                "result": (_latent_out(runner, bundle.latent_extra, result.latent), to_json(summary))}


class CarnatorSampler:
    DESCRIPTION = ("KSampler with cross-request reuse: probes the request, looks up earlier generations, and "
                   "resumes a compatible one's trajectory (or runs the rest and stores it).")

    @classmethod
    def INPUT_TYPES(cls):
        inputs = _request_inputs()
        inputs = {"model": inputs.pop("model"), "cache": ("CARNATOR_CACHE",), **inputs}
        inputs["risk"] = _RISK
        inputs["sparse_attention"] = ("BOOLEAN", {"default": True})
        return {"required": inputs, "optional": {"attention_density": _ATTENTION_DENSITY, **_EXPERT_INPUTS},
                "hidden": dict(_HIDDEN)}

    RETURN_TYPES = ("LATENT", "STRING")
    RETURN_NAMES = ("latent", "summary_json")
    FUNCTION = "sample"
    CATEGORY = CATEGORY

    def sample(self, model, cache, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
               probe_steps, risk, sparse_attention, attention_density=1.0, unique_id=None, prompt=None, **experts):
        node = "Carnator Sampler"
        store = _check_store(node, cache)
        config = make_config(node, steps, probe_steps, risk, _default_block_size(model), sparse_attention,
                             max_density=check_attention_density(node, attention_density))
        runner, noise, latent = _prepare(node, model, positive, negative, latent_image, seed, steps, cfg,
                                         sampler_name, scheduler, probe_steps, experts)
        result = pipeline.generate(runner, noise, runner.sigmas, store, config,
                                   prompt=prompt_text(prompt, unique_id), seed=int(seed))
        summary = result.summary()
        send_decision(unique_id, summary)
        return {"ui": {"text": [summary_text(summary)]},
                "result": (_latent_out(runner, latent.extra, result.latent), to_json(summary))}


NODE_CLASS_MAPPINGS = {
    "CarnatorCache": CarnatorCache,
    "CarnatorEarlyProbe": CarnatorEarlyProbe,
    "CarnatorSignatureCacheLookup": CarnatorSignatureCacheLookup,
    "CarnatorCompatibilityGate": CarnatorCompatibilityGate,
    "CarnatorTrajectoryResume": CarnatorTrajectoryResume,
    "CarnatorSampler": CarnatorSampler,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "CarnatorCache": "Carnator Cache",
    "CarnatorEarlyProbe": "Carnator Early Probe",
    "CarnatorSignatureCacheLookup": "Carnator Signature Cache Lookup",
    "CarnatorCompatibilityGate": "Carnator Compatibility Gate",
    "CarnatorTrajectoryResume": "Carnator Trajectory Resume",
    "CarnatorSampler": "Carnator Sampler",
}
