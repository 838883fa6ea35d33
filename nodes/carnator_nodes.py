"""Carnator's ComfyUI nodes, on ComfyUI's versioned node API (comfy_api.latest, "V3"). Thin: check and parse
inputs, call the engine, return.

The four stages of carnator_engine.pipeline as separate nodes (Early Probe -> Signature Cache Lookup ->
Compatibility Gate -> Trajectory Resume), the store they share (Carnator Cache), and the all-in-one
Carnator Sampler. Objects passed between the stage nodes carry the probe's token, so a Gate or Resume fed
from another probe's outputs is refused instead of silently mixing requests.

Node ids, input names and their order are those of the V1 nodes before them, so saved workflows keep loading
(their widgets_values are positional). Only ComfyUI imports this module (the plugin's comfy_entrypoint).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Optional

import comfy.samplers
from comfy_api.latest import ComfyExtension, io, ui

from carnator_engine import pipeline
from carnator_engine.gate import BELOW_HIGH, RISK_LEVELS, RISK_POLICIES, SETTING_RANGES, SWITCHES, Decision
from carnator_engine.hosts import contract
from carnator_engine.store.backends import is_redis_url
from carnator_engine.store.store import MIN_SIZE_LIMIT, CarnatorStore, StoreError
from carnator_engine.typed_paths import control_character

from .inputs import (PreparedLatent, check_attention_density, check_block_size, check_in_range, check_latent,
                     check_model, check_number, check_risk, check_switch, explained, fail, make_config, model_label,
                     progress_callback, prompt_text, restaged, send_decision, summary_text, to_json)
from .stores import DEFAULT_SIZE_LIMIT_GB, check_cache_dir, open_store

CATEGORY = "Carnator"

# The types that travel between Carnator's nodes (links of these types only connect Carnator nodes).
CacheType = io.Custom("CARNATOR_CACHE")
ProbeType = io.Custom("CARNATOR_PROBE")
MatchesType = io.Custom("CARNATOR_MATCHES")
DecisionType = io.Custom("CARNATOR_DECISION")

_HIDDEN = [io.Hidden.unique_id, io.Hidden.prompt]


def _cache_input() -> io.Input:
    return CacheType.Input("cache", tooltip="The store of earlier generations: connect a Carnator Cache node.")


def _probe_input() -> io.Input:
    return ProbeType.Input("probe", tooltip="The request after its probe steps: connect a Carnator Early Probe node.")


def _request_inputs(probe_steps_default: int = 0) -> list:
    """model, positive, ..., probe_steps: a request as KSampler takes it, plus the probe's length."""
    return [
        io.Model.Input("model", tooltip="A Wan 2.1/2.2, HunyuanVideo or LTX-Video model (LoRAs and patches are "
                                        "part of the cache key); with a low_noise_model, Wan 2.2 A14B's high-noise "
                                        "expert."),
        io.Conditioning.Input("positive", tooltip="What the video should show (the text encoder's output); compared "
                                                  "through the model's early states, never as text."),
        io.Conditioning.Input("negative", tooltip="What the video should avoid, as for KSampler."),
        io.Latent.Input("latent_image", tooltip="An empty video latent, e.g. EmptyHunyuanLatentVideo for Wan 2.1; for "
                                                "image-to-video, WanImageToVideo's or Wan22ImageToVideoLatent's latent "
                                                "(the start image is part of the cache key)."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, control_after_generate=True,
                     tooltip="The noise seed. Another seed is another request: it may still reuse a close one."),
        io.Int.Input("steps", default=30, min=2, max=10000,
                     tooltip="Denoising steps N. Only entries with the same steps, sampler and schedule are reused."),
        io.Float.Input("cfg", default=6.0, min=0.0, max=100.0, step=0.1, round=0.01,
                       tooltip="Classifier-free guidance scale, as for KSampler; part of the cache key."),
        io.Combo.Input("sampler_name", options=list(comfy.samplers.KSampler.SAMPLERS), default="euler",
                       tooltip="The sampler, as for KSampler; part of the cache key. A miss is KSampler's result "
                               "with every sampler (SDE and CFG++ ones evaluate up to the probe's steps again); a "
                               "hit's resumed steps start multistep samplers' history afresh."),
        io.Combo.Input("scheduler", options=list(comfy.samplers.KSampler.SCHEDULERS), default="simple",
                       tooltip="The sigma schedule, as for KSampler; part of the cache key."),
        io.Int.Input("probe_steps", default=probe_steps_default, min=0, max=1000,
                     tooltip="Steps run before the cache is consulted (the Early Signature). 0 = auto: 1 at 8 "
                             "steps or fewer (a distilled LoRA's first step already shows the layout), else 3."),
    ]


def _expert_inputs() -> list:
    """Wan 2.2 A14B: the second expert and where it takes over (ComfyUI's template: 20 steps, switch at step 10)."""
    return [
        io.Model.Input("low_noise_model", optional=True, tooltip=(
            "Wan 2.2 A14B's low-noise expert: runs the steps from the switch on ('model' is then the high-noise "
            "expert). Leave unconnected for one model.")),
        io.Int.Input("switch_step", default=0, min=0, max=10000, optional=True, tooltip=(
            "Step at which the low-noise expert takes over (the first KSamplerAdvanced's end_at_step in ComfyUI's "
            "template). 0 = from boundary_sigma.")),
        io.Float.Input("boundary_sigma", default=0.875, min=0.0, max=1.0, step=0.001, optional=True, tooltip=(
            "With switch_step 0: the high-noise expert runs every step whose sigma is at least this (Wan 2.2 T2V: "
            "0.875).")),
    ]


def _risk_input() -> io.Input:
    return io.Combo.Input("risk", options=list(RISK_LEVELS), default="balanced",
                          tooltip="safe: reuse only close matches, resume early; aggressive: reuse more, resume "
                                  "later.")


def _sparse_attention_input() -> io.Input:
    return io.Boolean.Input("sparse_attention", default=True,
                            tooltip="Resume with the cached block-sparse attention (dense where the request "
                                    "differs).")


def _attention_density_input() -> io.Input:
    return io.Float.Input("attention_density", default=1.0, min=0.05, max=1.0, step=0.05, optional=True, tooltip=(
        "Budget of the attention connectivity a miss records for later hits: the share of key blocks each query "
        "block keeps (its largest). 1 = keep 90 % of the attention mass, however many blocks that takes; 0.3 made "
        "a Wan 1.3B-size hit 2.3x faster on an H200."))


def _region_only_input() -> io.Input:
    return io.Boolean.Input("region_only", default=False, optional=True, tooltip=(
        "On a hit, the resumed steps run only the tokens that differ from the cached request (and a ring around "
        "them); the rest of the clip is the cached clip, unchanged. Faster, within about the GPU memory plain "
        "sampling needs; a target over half the clip resumes the whole clip. Off (default): every hit resumes the "
        "whole clip, closer to a fresh generation at cfg 1 (docs/region-resume.md)."))


def _latent_output() -> io.Output:
    return io.Latent.Output("latent", display_name="latent",
                            tooltip="The finished latent (decode it with the model's VAE), as KSampler gives it.")


def _summary_output() -> io.Output:
    return io.String.Output("summary_json", display_name="summary_json",
                            tooltip="What happened, as JSON: hit/miss/repeat, resume step, model calls, the gate's "
                                    "numbers and reasons, the entry stored.")


def _floats_checked(cls, **values) -> bool:
    """ComfyUI's check of a prompt, before any of its nodes runs (each node's validate_inputs names its float
    inputs): each must be a finite number in its widget's range. ComfyUI's own min/max check lets NaN through (every
    comparison with it is false) and the node's own check comes only when it runs: for the Gate and the Resume, after
    the Early Probe's model calls. Raised, not returned: ComfyUI repeats a returned error once per input the check
    names, and shows an exception once, on this node. A linked value (None here) is checked when the node runs."""
    schema = cls.define_schema()
    for spec in schema.inputs:
        value = values.get(spec.id)
        if isinstance(spec, io.Float.Input) and value is not None:
            hint = ", or 0 for the risk level's preset" if spec.id in _OVERRIDES + _LATER_OVERRIDES else ""
            check_in_range(schema.display_name, spec.id, value, spec.min, spec.max, hint)
    return True


def _hidden(cls, name: str):
    """A hidden input (unique_id, prompt) as ComfyUI's executor fills it in; None when called outside it."""
    return getattr(cls.hidden, name, None) if cls.hidden is not None else None


def _noted(runner, summary: dict) -> dict:
    """The summary with how the host shaped the run: under dynamic VRAM, a region-only hit's kept keys and values were
    all in host memory (kept_kv), with the reason."""
    paged = getattr(getattr(runner, "memory", None), "paged", "")
    if paged and (summary.get("numbers") or {}).get("region_streamed_bytes"):
        return {**summary, "notes": [paged]}
    return summary


def _given_out(unique_id, summary: dict, result=None, store: Optional[CarnatorStore] = None) -> tuple:
    """(summary_json, node text) of a decision, sent to the node's web widget too: all three from one summary,
    with the deciding reasons of a miss (inputs.explained). With the generation `result`: its write's outcome is
    this request's to tell, never the next one's: a write already failed is a warning here; one still under way
    updates the widget once it is done (written, or not with its warning)."""
    storing = getattr(result, "storing", None)
    if storing is not None and not summary.get("store_pending") and storing.failure is not None:
        store.withdraw_problem(storing.failure)
        summary = {**summary, "warnings": list(dict.fromkeys(summary["warnings"] + [storing.failure]))}
    summary = explained(summary)
    _shown_last[str(unique_id)] = summary
    send_decision(unique_id, summary)
    if storing is not None and summary.get("store_pending"):
        _when_stored(unique_id, summary, storing, store)
    return to_json(summary), ui.PreviewText(summary_text(summary))


_shown_last: dict = {}   # node id -> the summary its widget shows last (a late write's update is for that one only)


def _when_stored(unique_id, summary: dict, storing, store: CarnatorStore) -> None:
    """Once the write is done, the widget of the node that queued it says so: "stored as", or its failure (taken
    back from the warnings waiting for the next request). Not when the node shows a newer request by then."""
    key = str(unique_id)

    def tell():
        storing.wait()
        # write_done: this event updates the node's last decision, it is no request of its own
        if storing.failure is not None:
            done = {**summary, "stored_as": None, "store_pending": False, "write_done": True,
                    "warnings": list(dict.fromkeys(summary["warnings"] + [storing.failure]))}
        else:
            done = {**summary, "store_pending": False, "write_done": True}
        if _shown_last.get(key) is summary and send_decision(unique_id, done):
            _shown_last[key] = done
            if storing.failure is not None:     # shown where it belongs: not again on the next request
                store.withdraw_problem(storing.failure)
    threading.Thread(target=tell, name="carnator-stored-notice", daemon=True).start()


@dataclass
class ProbeBundle:
    """CARNATOR_PROBE: a request after its probe steps, ready for lookup and resume."""
    runner: object
    probed: pipeline.ProbeResult
    config: pipeline.CarnatorConfig
    seed: int
    prompt: str
    latent_extra: dict
    model_name: str = ""        # the model's file name, the cache browser's label
    directory: Optional[str] = None   # the cache the probe checked for an exact repeat (its location)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass
class MatchesBundle:
    """CARNATOR_MATCHES: nearest cached generations for one probe."""
    probe_token: str
    directory: str
    candidates: list
    bucket_reasons: list        # why there are none, when the probe's bucket holds no entry
    config: pipeline.CarnatorConfig   # the probe's, with the lookup's limit


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
    nested = contract.nested_latent_refusal(latent_image)
    if nested:
        raise fail(node, "latent_image", f"{nested}; sample it with the Carnator Sampler or a KSampler")
    backbone = check_model(node, model)
    latent: PreparedLatent = check_latent(node, model, latent_image, backbone)
    cfg = check_number(node, "cfg", cfg)
    if cfg <= 0:
        raise fail(node, "cfg", f"cfg={cfg:g} must be > 0: 1 runs without guidance (as step-distilled LoRAs do), "
                                "higher values guide with the negative prompt")
    try:
        runner = ComfyRunner(model, positive, negative, cfg, sampler_name, scheduler=scheduler, steps=int(steps),
                             seed=int(seed), latent_image=latent.samples, noise_mask=latent.noise_mask, **experts)
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


def _sampled_plain(unique_id, why: str, model, positive, negative, latent_image, seed, steps, cfg, sampler_name,
                   scheduler, risk) -> io.NodeOutput:
    """The Carnator Sampler where reuse is off (`why`: the host lacks what Carnator needs, or a latent it cannot
    reuse): ComfyUI's own KSampler sampling, previews and progress bar included, with the one line on the node."""
    import nodes as host_nodes   # ComfyUI's nodes.py (this plugin's own nodes package is only imported relatively)
    latent, = host_nodes.common_ksampler(model, int(seed), int(steps), cfg, sampler_name, scheduler, positive,
                                         negative, latent_image)
    summary = {**Decision(False, risk, int(steps), 0, 0, reasons=[why]).summary(), "plain": True,
               "steps_run": int(steps), "warnings": []}
    summary_json, text = _given_out(unique_id, summary)
    return io.NodeOutput(latent, summary_json, ui=text)


def _default_block_size(model) -> int:
    device = getattr(getattr(model, "load_device", None), "type", "cpu")
    return 128 if device == "cuda" else 64   # FlexAttention's tile on GPUs


class CarnatorCache(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCache", display_name="Carnator Cache", category=CATEGORY,
            description="The store of earlier generations (survives restarts): a folder, or a redis:// URL for one "
                        "store shared by many ComfyUI workers. Leave cache_dir empty for ComfyUI's user directory.",
            inputs=[
                io.String.Input("cache_dir", default="", tooltip=(
                    "Folder of the cache (empty = <user dir>/carnator_cache; a relative path is taken inside ComfyUI's "
                    "user directory), or redis://[:password@]host:port/db (rediss:// with TLS; the password may also "
                    "come from CARNATOR_REDIS_PASSWORD).")),
                io.Float.Input("size_limit_gb", default=DEFAULT_SIZE_LIMIT_GB, min=0.001, max=100000.0, step=0.5,
                               tooltip="Least useful entries are evicted beyond this size (GiB)."),
                io.String.Input("blob_dir", default="", optional=True, tooltip=(
                    "Farm layout, with a redis:// cache_dir: the absolute path of a folder on shared storage that "
                    "every worker mounts; trajectories are kept there and Redis keeps only the index and metadata. "
                    "Empty = everything in Redis (small setups).")),
            ],
            outputs=[CacheType.Output("cache", display_name="cache", tooltip="The store: connect it to the Carnator "
                                      "Sampler, or to the Signature Cache Lookup and the Trajectory Resume.")],
        )

    @classmethod
    def validate_inputs(cls, cache_dir=None, size_limit_gb=None, blob_dir=None):
        """ComfyUI's check of a prompt before any of its nodes runs: a cache_dir this node would refuse is refused
        there, before a probe has spent model calls (read-only: nothing is created), and a blob_dir holding a control
        character. A linked cache_dir or blob_dir (None here) is checked when the node runs."""
        _floats_checked(cls, size_limit_gb=size_limit_gb)
        if isinstance(blob_dir, str):
            _check_blob_dir_text(blob_dir)
        if isinstance(cache_dir, str):
            try:
                check_cache_dir(cache_dir)
            except StoreError as error:
                raise fail("Carnator Cache", "cache_dir", str(error)) from None
        return True

    @classmethod
    def execute(cls, cache_dir: str, size_limit_gb: float, blob_dir: str = "") -> io.NodeOutput:
        node = "Carnator Cache"
        size = check_number(node, "size_limit_gb", size_limit_gb)
        limit = int(size * (1 << 30))
        if limit < MIN_SIZE_LIMIT:
            raise fail(node, "size_limit_gb", f"size_limit_gb={size} is below the minimum of "
                                              f"{MIN_SIZE_LIMIT / (1 << 30):.4f} GB (1 MiB): raise it")
        if not isinstance(cache_dir, str):
            raise fail(node, "cache_dir", "must be a folder path or a redis:// URL (text)")
        if not isinstance(blob_dir, str):
            raise fail(node, "blob_dir", "must be an absolute folder path (text), or empty")
        if blob_dir.strip() and not is_redis_url(cache_dir):
            raise fail(node, "blob_dir", "is for a farm: set cache_dir to its redis:// URL, or leave blob_dir empty")
        _check_blob_dir_text(blob_dir)
        try:
            store = open_store(cache_dir, limit, blob_dir)
        except (StoreError, OSError) as error:
            raise fail(node, _input_at_fault(error, blob_dir), str(error)) from None
        return io.NodeOutput(store)


def _check_blob_dir_text(blob_dir: str) -> None:
    refused = control_character(blob_dir)
    if refused:
        raise fail("Carnator Cache", "blob_dir", f"blob_dir {refused}")


def _input_at_fault(error: Exception, blob_dir: str) -> str:
    """The Carnator Cache input a store error is about: blob_dir when it is given and the error names that folder
    (with blob_dir, cache_dir is a redis:// URL, so no folder of cache_dir's is meant), else cache_dir, whatever
    the folder names contain ("blob" in a cache_dir path is no blob_dir)."""
    folder = blob_dir.strip()
    if not folder:
        return "cache_dir"
    message = str(error)
    named = {folder, os.path.abspath(os.path.expanduser(folder)), os.path.realpath(os.path.expanduser(folder))}
    return "blob_dir" if message.startswith("blob_dir ") or any(name in message for name in named) else "cache_dir"


def _expect(node: str, name: str, value, kind: type, source: str):
    """The output of another Carnator node, or an error saying which node to connect."""
    if not isinstance(value, kind):
        raise fail(node, name, f"is not what a {source} node gives: connect a {source} node")
    return value


def _check_store(node: str, cache) -> CarnatorStore:
    return _expect(node, "cache", cache, CarnatorStore, "Carnator Cache")


class CarnatorEarlyProbe(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorEarlyProbe", display_name="Carnator Early Probe", category=CATEGORY,
            description="Runs the first probe_steps of the request with hooks that record its Early Signature.",
            inputs=_request_inputs() + [
                io.Int.Input("block_size", default=0, min=0, max=1024, step=16,
                             tooltip="Tokens per attention block: 16, 32, 64 or a multiple of 128 (what the "
                                     "block-sparse attention tiles); 0 picks FlexAttention's 128 on GPUs and 64 on "
                                     "the CPU."),
                CacheType.Input("cache", optional=True, tooltip="Connect the Carnator Cache to answer an exact "
                                "repeat with its stored result before any probe step runs."),
                *_expert_inputs(),
            ],
            outputs=[ProbeType.Output("probe", display_name="probe", tooltip="The request after its probe steps, "
                                      "with its Early Signature: connect it to the Lookup, the Gate and the Resume.")],
            hidden=list(_HIDDEN),
        )

    @classmethod
    def validate_inputs(cls, cfg=None, boundary_sigma=None, block_size=None):
        if block_size is not None:
            check_block_size("Carnator Early Probe", block_size)
        return _floats_checked(cls, cfg=cfg, boundary_sigma=boundary_sigma)

    @classmethod
    def execute(cls, model, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
                probe_steps, block_size, cache=None, **experts) -> io.NodeOutput:
        node = "Carnator Early Probe"
        store = None if cache is None else _check_store(node, cache)
        config = make_config(node, steps, probe_steps, block_size=block_size or _default_block_size(model))
        runner, noise, latent = _prepare(node, model, positive, negative, latent_image, seed, steps, cfg,
                                         sampler_name, scheduler, config.probe_steps, experts)
        probed = pipeline.probe(runner, noise, runner.sigmas, config, store=store)
        graph, unique_id = _hidden(cls, "prompt"), _hidden(cls, "unique_id")
        return io.NodeOutput(ProbeBundle(runner, probed, config, int(seed), prompt_text(graph, unique_id),
                                         latent.extra, model_label(graph, unique_id),
                                         None if store is None else store.location))


def _check_probe(node: str, probe) -> ProbeBundle:
    return _expect(node, "probe", probe, ProbeBundle, "Carnator Early Probe")


class CarnatorSignatureCacheLookup(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorSignatureCacheLookup", display_name="Carnator Signature Cache Lookup", category=CATEGORY,
            description="Finds the cached generations nearest to the probe (same model, patches, shape and "
                        "schedule).",
            inputs=[_cache_input(), _probe_input(),
                    io.Int.Input("limit", default=3, min=1, max=64,
                                 tooltip="How many of the nearest cached generations the Gate may choose from.")],
            outputs=[MatchesType.Output("matches", display_name="matches", tooltip="The nearest cached generations "
                                        "with their distances to the probe: connect it to the Compatibility Gate.")],
        )

    @classmethod
    def execute(cls, cache, probe, limit) -> io.NodeOutput:
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
        reasons = [] if candidates or repeat is not None else pipeline.new_bucket_reasons(store, bundle.probed)
        return io.NodeOutput(MatchesBundle(bundle.token, store.location, candidates, reasons, config),
                             ui=ui.PreviewText("\n".join(lines + reasons)))


_OVERRIDES = ("max_hidden", "max_attention", "max_context", "cell_threshold", "max_target_fraction",
              "max_resume_fraction")
_LATER_OVERRIDES = ("max_context_share", "few_step_resume_fraction")   # after the switches: saved workflows keep
#                                                                       their widget order


_THRESHOLD_STEP = 0.001


def _threshold_input(name: str, balanced: float) -> io.Input:
    """A gate setting's input, bounded as the gate bounds it (gate.SETTING_RANGES), so that ComfyUI refuses a value
    outside before any node of the prompt runs; 0 keeps the risk level's preset."""
    low, high = SETTING_RANGES[name]
    below = name in BELOW_HIGH
    allowed = f"({low}, {high})" if below else f"({low}, {high}]"
    return io.Float.Input(name, default=0.0, min=0.0, max=high - _THRESHOLD_STEP if below else high,
                          step=_THRESHOLD_STEP, optional=True,
                          tooltip=f"0 = preset ({balanced} for balanced); otherwise a value in {allowed}")


class CarnatorCompatibilityGate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        balanced = RISK_POLICIES["balanced"]
        thresholds, later = ([_threshold_input(name, getattr(balanced, name)) for name in names]
                             for names in (_OVERRIDES, _LATER_OVERRIDES))
        return io.Schema(
            node_id="CarnatorCompatibilityGate", display_name="Carnator Compatibility Gate", category=CATEGORY,
            description="Decides, from the model's own early states, whether to reuse a cached trajectory and from "
                        "which step. Threshold inputs at 0 use the risk level's preset.",
            inputs=[_probe_input(),
                    MatchesType.Input("matches", tooltip="The probe's nearest cached generations: connect the "
                                                         "Signature Cache Lookup fed with the same probe."),
                    _risk_input(), *thresholds,
                    io.Int.Input("min_saved_steps", default=0, min=0, max=10000, optional=True,
                                 tooltip="0 = preset: a hit must save at least this many steps."),
                    io.Boolean.Input("refine_target", default=balanced.refine_target, optional=True, tooltip=(
                        "Spend one model call midway re-estimating the region that differs from the cached "
                        "generation, instead of extrapolating it from the probe (fewer wrong reuses; off saves that "
                        "call).")),
                    io.Boolean.Input("shrink_with_risk", default=balanced.shrink_with_risk, optional=True, tooltip=(
                        "Resume earlier the closer the match is to a limit. Off: every accepted match resumes at "
                        "the furthest step the risk level allows.")), *later],
            outputs=[DecisionType.Output("decision", display_name="decision", tooltip="The decision (reuse or not, "
                                         "the entry, the resume step k, the target region): connect it to the "
                                         "Trajectory Resume."),
                     io.String.Output("decision_json", display_name="decision_json",
                                      tooltip="The same decision as JSON, with the gate's numbers and reasons.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, max_hidden=None, max_attention=None, max_context=None, cell_threshold=None,
                        max_target_fraction=None, max_resume_fraction=None, max_context_share=None,
                        few_step_resume_fraction=None):
        return _floats_checked(cls, max_hidden=max_hidden, max_attention=max_attention, max_context=max_context,
                               cell_threshold=cell_threshold, max_target_fraction=max_target_fraction,
                               max_resume_fraction=max_resume_fraction, max_context_share=max_context_share,
                               few_step_resume_fraction=few_step_resume_fraction)

    @classmethod
    def execute(cls, probe, matches, risk, **thresholds) -> io.NodeOutput:
        node = "Carnator Compatibility Gate"
        bundle = _check_probe(node, probe)
        _expect(node, "matches", matches, MatchesBundle, "Carnator Signature Cache Lookup")
        if matches.probe_token != bundle.token:
            raise fail(node, "matches", "comes from another probe: feed the Signature Cache Lookup with this probe")
        # a switch left unset keeps the risk preset's value
        overrides = {name: bool(thresholds.pop(name)) for name in SWITCHES if name in thresholds}
        for name, value in thresholds.items():
            if name not in _OVERRIDES + _LATER_OVERRIDES and name != "min_saved_steps":
                continue
            value = check_number(node, name, value)
            if value < 0:
                raise fail(node, name, f"{name}={value} must be >= 0 (0 uses the risk preset)")
            if value > 0:
                overrides[name] = int(value) if name == "min_saved_steps" else value
        config = restaged(node, matches.config, bundle.probed.steps, risk=check_risk(node, risk),
                          gate_overrides=overrides)
        decision = pipeline.decide(bundle.probed, matches.candidates, config, matches.bucket_reasons)
        summary_json, text = _given_out(_hidden(cls, "unique_id"), decision.summary())
        return io.NodeOutput(DecisionBundle(bundle.token, matches.directory, decision, config), summary_json, ui=text)


def _latent_out(runner, bundle_extra: dict, latent) -> dict:
    return {**bundle_extra, "samples": runner.to_latent_format(latent).cpu()}


class CarnatorTrajectoryResume(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorTrajectoryResume", display_name="Carnator Trajectory Resume", category=CATEGORY,
            description="Finishes the request: from the cached trajectory on a hit, from the probe on a miss; then "
                        "stores it for later requests.",
            inputs=[_cache_input(), _probe_input(),
                    DecisionType.Input("decision", tooltip="The Compatibility Gate's decision for this probe."),
                    _sparse_attention_input(), _attention_density_input(), _region_only_input()],
            outputs=[_latent_output(), _summary_output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, attention_density=None):
        return _floats_checked(cls, attention_density=attention_density)

    @classmethod
    def execute(cls, cache, probe, decision, sparse_attention, attention_density=1.0,
                region_only=False) -> io.NodeOutput:
        node = "Carnator Trajectory Resume"
        store = _check_store(node, cache)
        bundle = _check_probe(node, probe)
        _expect(node, "decision", decision, DecisionBundle, "Carnator Compatibility Gate")
        if decision.probe_token != bundle.token:
            raise fail(node, "decision", "was made for another probe: feed the Gate and this node the same probe")
        if decision.decision.reuse and decision.directory != store.location:
            raise fail(node, "cache", f"is {store.location!r} but the decision reuses an entry of "
                                      f"{decision.directory!r}: connect the same Carnator Cache to Lookup and Resume")
        config = restaged(node, decision.config, bundle.probed.steps, sparse_attention=bool(sparse_attention),
                          max_density=check_attention_density(node, attention_density),
                          region_only=check_switch(node, "region_only", region_only))
        runner = bundle.runner.with_step_callback(progress_callback(bundle.runner.model, bundle.probed.steps))
        result = pipeline.resume(runner, bundle.probed, decision.decision, store, config, bundle.prompt, bundle.seed,
                                 bundle.model_name)
        summary_json, text = _given_out(_hidden(cls, "unique_id"), _noted(runner, result.summary()), result, store)
        return io.NodeOutput(_latent_out(runner, bundle.latent_extra, result.latent), summary_json, ui=text)


class CarnatorSampler(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        model, *request = _request_inputs()
        return io.Schema(
            node_id="CarnatorSampler", display_name="Carnator Sampler", category=CATEGORY,
            description="KSampler with cross-request reuse: probes the request, looks up earlier generations, and "
                        "resumes a compatible one's trajectory (or runs the rest and stores it).",
            inputs=[model, _cache_input(), *request, _risk_input(), _sparse_attention_input(),
                    _attention_density_input(), *_expert_inputs(), _region_only_input()],
            outputs=[_latent_output(), _summary_output()],
            hidden=list(_HIDDEN),
        )

    @classmethod
    def validate_inputs(cls, cfg=None, attention_density=None, boundary_sigma=None):
        return _floats_checked(cls, cfg=cfg, attention_density=attention_density, boundary_sigma=boundary_sigma)

    @classmethod
    def execute(cls, model, cache, positive, negative, latent_image, seed, steps, cfg, sampler_name, scheduler,
                probe_steps, risk, sparse_attention, attention_density=1.0, region_only=False,
                **experts) -> io.NodeOutput:
        node = "Carnator Sampler"
        store = _check_store(node, cache)
        nested = contract.nested_latent_refusal(latent_image)
        off = contract.refusal() or (nested and f"Carnator: latent_image {nested}, so reuse is off for it and the "
                                                "Carnator Sampler samples as a KSampler does")
        if off:
            return _sampled_plain(_hidden(cls, "unique_id"), off, model, positive, negative, latent_image, seed, steps,
                                  cfg, sampler_name, scheduler, check_risk(node, risk))
        config = make_config(node, steps, probe_steps, risk, _default_block_size(model), sparse_attention,
                             max_density=check_attention_density(node, attention_density),
                             region_only=check_switch(node, "region_only", region_only))
        runner, noise, latent = _prepare(node, model, positive, negative, latent_image, seed, steps, cfg,
                                         sampler_name, scheduler, config.probe_steps, experts)
        graph, unique_id = _hidden(cls, "prompt"), _hidden(cls, "unique_id")
        result = pipeline.generate(runner, noise, runner.sigmas, store, config, prompt=prompt_text(graph, unique_id),
                                   seed=int(seed), model_name=model_label(graph, unique_id))
        summary_json, text = _given_out(unique_id, _noted(runner, result.summary()), result, store)
        return io.NodeOutput(_latent_out(runner, latent.extra, result.latent), summary_json, ui=text)


NODES = [CarnatorCache, CarnatorEarlyProbe, CarnatorSignatureCacheLookup, CarnatorCompatibilityGate,
         CarnatorTrajectoryResume, CarnatorSampler]


class CarnatorExtension(ComfyExtension):
    async def get_node_list(self) -> list:
        """The nodes, always: a host without what Carnator needs gets them too, with one warning line saying what is
        missing and that reuse is off (the Carnator Sampler then samples as a KSampler does)."""
        from carnator_engine.hosts.comfyui import MODEL_CLASSES
        contract.check_at_load(MODEL_CLASSES)
        return list(NODES)
