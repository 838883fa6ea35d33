"""Input checks and small helpers shared by the Carnator nodes (no ComfyUI import at module level).

Every check raises ValueError naming the node, the bad input and what to do, before anything runs or is
written to the cache.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from carnator_engine.attention.sparse import tiled_block_size
from carnator_engine.gate import RISK_LEVELS, default_probe_steps
from carnator_engine.pipeline import CarnatorConfig

log = logging.getLogger("carnator.nodes")

DECISION_EVENT = "carnator.decision"


def fail(node: str, input_name: str, message: str) -> ValueError:
    return ValueError(f"{node}: input '{input_name}': {message}")


@dataclass
class PreparedLatent:
    samples: torch.Tensor     # latent format, [B, C, F, H, W]
    extra: dict               # other keys of the LATENT dict that travel with it (batch_index, noise_mask)
    noise_mask: Optional[torch.Tensor] = None   # the part of `samples` to keep (1 = generate), [B, 1, F, H, W]


# models whose start image comes in the LATENT, kept by its noise mask: Wan 2.2 TI2V 5B (Wan22ImageToVideoLatent),
# HunyuanVideo I2V (HunyuanImageToVideo's "v2 (replace)")
KEPT_LATENT_MODELS = ("WAN22", "HunyuanVideoI2V")


def check_model(node: str, model):
    """The backbone behind `model`, or a clear error for a model Carnator cannot hook."""
    from carnator_engine.hosts.comfyui import UnsupportedModelError, backbone_for
    try:
        return backbone_for(model)
    except UnsupportedModelError as error:
        raise fail(node, "model", str(error)) from None


def check_latent(node: str, model, latent_image, backbone) -> PreparedLatent:
    import comfy.sample
    if not isinstance(latent_image, dict) or not torch.is_tensor(latent_image.get("samples")):
        raise fail(node, "latent_image", "is not a LATENT (a dict with 'samples'): connect an empty video latent node")
    mask = latent_image.get("noise_mask")
    if mask is not None and backbone.model_class not in KEPT_LATENT_MODELS:
        raise fail(node, "latent_image", "carries a noise mask (inpainting or masked image-to-video): Carnator "
                                         "samples whole clips, and keeps a masked start image only for Wan 2.2 "
                                         "TI2V 5B (Wan22ImageToVideoLatent) and HunyuanVideo I2V (HunyuanImageToVideo "
                                         "v2); use a KSampler for masked sampling")
    samples = latent_image["samples"]
    layout = backbone.layout
    channels = layout.latent_channels
    if samples.dim() != 5:
        kind = "an image latent [batch, channels, height, width]" if samples.dim() == 4 else f"{samples.dim()}-D"
        raise fail(node, "latent_image",
                   f"has shape {list(samples.shape)}, {kind}; {backbone.model_class} ({layout.name}) needs a video "
                   f"latent [batch, {channels}, frames, height, width]: use EmptyHunyuanLatentVideo (Wan 2.1) or "
                   "the model's own empty video latent node")
    samples = comfy.sample.fix_empty_latent_channels(model, samples)  # an empty latent is resized, as KSampler does
    if samples.shape[1] != channels:
        raise fail(node, "latent_image",
                   f"has {samples.shape[1]} channels but {backbone.model_class} ({layout.name}) works with "
                   f"{channels}: is this latent from another model's VAE?")
    if min(samples.shape) < 1:
        raise fail(node, "latent_image", f"is empty (shape {list(samples.shape)})")
    if mask is not None and (not torch.is_tensor(mask) or mask.dim() != 5 or mask.shape[1] != 1
                             or tuple(mask.shape[2:]) != tuple(samples.shape[2:])):
        shape = list(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
        raise fail(node, "latent_image", f"has a noise mask of shape {shape} for a latent of {list(samples.shape)}: "
                                         "a start-image mask must be [batch, 1, frames, height, width] of the "
                                         "latent's size, as Wan22ImageToVideoLatent and HunyuanImageToVideo make it")
    extra = {k: v for k, v in latent_image.items() if k in ("batch_index", "noise_mask")}
    return PreparedLatent(samples.to(torch.float32), extra, None if mask is None else mask.to(torch.float32))


def check_steps(node: str, steps: int, probe_steps: int) -> int:
    """The probe's length, 0 (auto) resolved: 1 at few-step schedules, else 3."""
    if int(steps) < 2:
        raise fail(node, "steps", f"steps={steps}: Carnator needs at least 2 steps (a probe and a remainder)")
    if int(probe_steps) == 0:
        probe_steps = min(default_probe_steps(int(steps)), int(steps) - 1)
    if not 1 <= int(probe_steps) < int(steps):
        raise fail(node, "probe_steps", f"probe_steps={probe_steps} must be between 1 and steps-1 ({int(steps) - 1}): "
                                        "the probe runs the first steps of the request; lower probe_steps or raise steps")
    return int(probe_steps)


def check_risk(node: str, risk: str) -> str:
    if risk not in RISK_LEVELS:
        raise fail(node, "risk", f"unknown risk level {risk!r}: choose one of {', '.join(RISK_LEVELS)}")
    return risk


def make_config(node: str, steps: int, probe_steps: int, risk: str = "balanced", block_size: int = 64,
                sparse_attention: bool = True, gate_overrides: Optional[dict] = None,
                max_density: float = 1.0, region_only: bool = False) -> CarnatorConfig:
    probe_steps = check_steps(node, steps, probe_steps)
    check_risk(node, risk)
    check_block_size(node, block_size)
    return restaged(node, CarnatorConfig(), steps, probe_steps=int(probe_steps), risk=risk,
                    block_size=int(block_size), sparse_attention=bool(sparse_attention),
                    gate_overrides=dict(gate_overrides or {}), max_density=max_density, region_only=region_only)


def check_block_size(node: str, block_size) -> int:
    """The Early Probe's block_size: 0 (the device's default, resolved by the node) or a size the block-sparse
    attention tiles, refused before the probe's model calls: the Resume runs a hit at its entry's block size."""
    if int(block_size) == 0:
        return 0
    try:
        return tiled_block_size(int(block_size))
    except ValueError as error:
        raise fail(node, "block_size", f"{error}, or 0 for the default (128 on GPUs, 64 on the CPU)") from None


def restaged(node: str, config: CarnatorConfig, steps: int, **settings) -> CarnatorConfig:
    """`config` as the stages before this node made it, with this node's settings, checked: every setting set
    upstream travels on to the Resume, whose config keys a hit's result (pipeline.hit_replay_key)."""
    config = dataclasses.replace(config, **settings)
    try:
        config.validate(int(steps))
    except ValueError as error:
        raise ValueError(f"{node}: {error}") from None
    return config


def check_attention_density(node: str, value) -> float:
    density = check_number(node, "attention_density", value)
    if not 0.0 < density <= 1.0:
        raise fail(node, "attention_density", f"attention_density={density} must be in (0, 1]: the share of key "
                                              "blocks each query block keeps (1 = no budget)")
    return density


def check_switch(node: str, name: str, value) -> bool:
    if not isinstance(value, bool):
        raise fail(node, name, f"{name}={value!r} must be true or false")
    return value


def check_in_range(node: str, name: str, value, low: float, high: float, hint: str = "") -> float:
    """A float input within its widget's range [low, high]; `hint` ends the fix (what a special value means)."""
    allowed = f"set a value in [{low:g}, {high:g}]{hint}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise fail(node, name, f"{name}={value!r} is not a number: {allowed}") from None
    if not math.isfinite(number):
        raise fail(node, name, f"{name}={number} is not a finite number: {allowed}")
    if not low <= number <= high:
        raise fail(node, name, f"{name}={number:g} is outside its range: {allowed}")
    return number


def check_number(node: str, name: str, value) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise fail(node, name, f"{name}={value} is not a finite number")
    return value


def prompt_text(prompt, unique_id, input_name: str = "positive", depth: int = 8) -> str:
    """Best effort: the text of the CLIPTextEncode feeding `input_name` (the cache browser's label)."""
    try:
        link = prompt[str(unique_id)]["inputs"].get(input_name)
        for _ in range(depth):
            if not (isinstance(link, list) and len(link) == 2):
                return ""
            inputs = prompt[str(link[0])].get("inputs", {})
            text = inputs.get("text")
            if isinstance(text, str):
                return text
            link = next((v for k, v in inputs.items()
                         if "cond" in k.lower() and isinstance(v, list) and len(v) == 2), None)
    except (KeyError, TypeError, AttributeError):
        pass
    return ""


_MODEL_FILES = ("unet_name", "ckpt_name")   # inputs of the loaders a MODEL comes from (UNETLoader, checkpoints)


def model_label(prompt, unique_id, depth: int = 8) -> str:
    """Best effort: the model's file name as the loader feeding `model` names it, with the LoRAs met on the way
    ("wan2.1_t2v.safetensors + style.safetensors"); "" when the graph does not say (the cache browser's label)."""
    loras = []
    try:
        link = prompt[str(unique_id)]["inputs"].get("model")
        for _ in range(depth):
            if not (isinstance(link, list) and len(link) == 2):
                return ""
            inputs = prompt[str(link[0])].get("inputs", {})
            if isinstance(inputs.get("lora_name"), str):
                loras.append(inputs["lora_name"])
            base = next((inputs[k] for k in _MODEL_FILES if isinstance(inputs.get(k), str)), None)
            if base is not None:
                return " + ".join([base] + loras[::-1])
            link = inputs.get("model")
    except (KeyError, TypeError, AttributeError):
        pass
    return ""


def progress_callback(model, steps: int):
    """ComfyUI's progress bar (with latent previews when enabled) over all `steps` of the request."""
    try:
        import latent_preview  # ComfyUI's root module: previews + comfy.utils.ProgressBar
        return latent_preview.prepare_callback(model, steps)
    except ImportError:
        import comfy.utils
        bar = comfy.utils.ProgressBar(steps)
        return lambda step, x0, x, total: bar.update_absolute(step + 1, total)


def to_json(summary: dict) -> str:
    return json.dumps(summary, default=str, sort_keys=True)


def cost_text(summary: dict) -> str:
    """Steps run and model calls counted at the diffusion model, with the step cache that ran inside."""
    steps = summary.get("steps")
    if "steps_run" not in summary:      # a decision, not yet run (the Compatibility Gate node)
        return f"plans {summary.get('model_calls')} model steps of {steps}"
    text = f"{summary['steps_run']} of {steps} steps run, {summary.get('model_calls')} model calls"
    if summary.get("step_cache"):
        text += f" ({summary['step_cache']} inside: skipped {summary.get('step_cache_skipped', 0)} steps)"
    return text


def deciding_reasons(summary: dict) -> list:
    """Why a request was not reused, as the node's text and its web widget show it: the first reason (what happened)
    and every later one that is not a check the request passed ("... within limit ..."), so that the node names
    what refused it: the input or the node that differs, a limit exceeded, a reuse that cannot pay."""
    reasons = summary.get("reasons") or ["no decision"]
    return [reasons[0]] + [reason for reason in reasons[1:] if " within limit " not in reason]


def explained(summary: dict) -> dict:
    """The summary as the nodes give it out (node text, summary_json, the web widget): with `why`, the deciding
    reasons of a miss in one line (None for a hit or a repeat, whose verdict says it)."""
    why = None if summary.get("reuse") else "; ".join(deciding_reasons(summary))
    return {**summary, "why": why}


def summary_text(summary: dict) -> str:
    """The node's one-line verdict, then any note (dynamic VRAM kept a region's keys and values off the GPU) and any
    warning (a store fault that made the request a full generation)."""
    warnings = "".join(f"\nwarning: {w}" for w in summary.get("warnings") or [])
    notes = "".join(f"\nnote: {n}" for n in summary.get("notes") or [])    # how the host shaped this run
    return _verdict(summary) + notes + warnings


def _verdict(summary: dict) -> str:
    steps, k = summary.get("steps"), summary.get("resume_step")
    risk = summary.get("risk")
    written = "being stored" if summary.get("store_pending") else "stored"   # the write may still be under way
    stored = f"; {written} as {summary['stored_as']}" if summary.get("stored_as") else ""
    cost = cost_text(summary)
    if summary.get("plain"):    # reuse off for this host or latent (hosts/contract.py): sampled as a KSampler does
        return f"Carnator OFF: {summary.get('why')}; {cost}, nothing stored"
    if summary.get("exact_repeat"):
        return (f"Carnator REPEAT: every input matches entry {summary.get('entry_id')}, an earlier generation; "
                f"its stored result, {cost}")
    if summary.get("reuse"):
        region = f"; {summary['region']}" if summary.get("region") else ""   # region-only, or why the whole clip
        return (f"Carnator HIT ({risk}): resume at step {k}/{steps} from entry {summary.get('entry_id')}{region}; "
                f"{cost}, {_expected(summary)}{stored}")
    why = summary.get("why") or "; ".join(deciding_reasons(summary))
    return f"Carnator MISS ({risk}): {why}; {cost}{stored}"


def _expected(summary: dict) -> str:
    """A hit's expected speed-up, told the same way by the Gate (before region-only is decided, at the Trajectory
    Resume) and by the node that resumed it: the whole-clip figure always, the region-only one where it ran."""
    calls = summary.get("model_calls")
    whole = round(summary["steps"] / calls, 3) if calls else None
    if (summary.get("numbers") or {}).get("region_only"):
        return f"expected {summary.get('expected_speedup')}x region-only (whole-clip: {whole}x)"
    if "steps_run" not in summary:
        return f"expected {whole}x whole-clip (the Trajectory Resume decides whether region-only applies)"
    return f"expected {whole}x"


def send_decision(unique_id, summary: dict) -> bool:
    """Pushes the decision to the frontend; whether it was sent (silent when no ComfyUI server runs: scripts,
    tests)."""
    server = sys.modules.get("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is None:
        return False
    try:
        instance.send_sync(DECISION_EVENT, {"node": None if unique_id is None else str(unique_id),
                                            **json.loads(to_json(summary))})
        return True
    except Exception as error:  # the UI message is a courtesy: never fail a generation over it
        log.warning("carnator: could not send the decision to the UI: %s", error)
        return False
