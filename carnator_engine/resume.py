"""Trajectory Resume: finishes a request, from the cached trajectory on a hit, from its probe state on a miss.

A hit's latent entering resume step k is the cached trajectory's, except in the target region, where it is the
request's own: its probe state jumped along its own flow path to sigma_k (after one model call midway, the refine
step, when the gate asks for it). From there either
- whole-clip resume: every token goes through the network for steps k..N, or
- region-only resume (CarnatorConfig.region_only, region.py): the target tokens and a halo go through it; every other
  token is the cached generation's, never run through a step it was not on: its final latent is the cached final
  latent, and its keys and values come from full steps whose input outside the region is the cached trajectory's own
  latent at that step (the first resumed step, the first of a new expert, and `region_refresh_steps` refreshes at
  stored checkpoints); with region_sparse_keys only the keys the target reaches in the cached sparse attention.
A hit that cannot follow its entry (a checkpoint missing, another latent shape) is generated in full; one that
cannot go region-only (no stored final latent, too large a target, too little GPU memory for the kept keys and values,
or a region step out of memory) resumes whole-clip; each with its reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import gate as gate_module
from .attention.connectivity import ConnectivityRecorder, plan_from_tensors, reached_key_rows
from .localize import latent_mask, region_cells
from .observer import CheckpointRecorder, GenerationObserver
from .region import RegionTokens, latent_mask_of_tokens, target_tokens
from .schedule import jump

REGION_HALO = (0, 1, 1)   # tokens (frames, rows, cols) around the target computed with it: the seam's ring


@dataclass
class Finished:
    decision: gate_module.Decision      # the decision followed (a fallback replaces the gate's)
    latent: torch.Tensor
    observer: GenerationObserver
    connectivity: dict                  # the attention connectivity to store with the generation
    warnings: list = field(default_factory=list)


def resume_latent(probe_latent: torch.Tensor, probe_denoised: torch.Tensor, sigma_probe: float,
                  sigma_resume: float, cached_latent: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """target: [F, H, W] bool over the latent; cached_latent: the entry's latent entering step k."""
    cached = cached_latent.to(probe_latent.device, probe_latent.dtype)
    if cached.shape != probe_latent.shape:
        raise ValueError(f"cached latent {tuple(cached.shape)} does not match this request's latent "
                         f"{tuple(probe_latent.shape)}: the entry belongs to another latent size")
    # a host's sampler may leave the denoised estimate on the GPU while the latent comes back on the CPU
    denoised = probe_denoised.to(probe_latent.device, probe_latent.dtype)
    own = jump(probe_latent, denoised, sigma_probe, sigma_resume)
    return torch.where(target.to(own.device)[None, None], own, cached)


def finish(runner, probed, decision: gate_module.Decision, payload, config, checkpoint_steps: list) -> Finished:
    """The rest of the request. `payload` is the chosen entry's trajectory (None on a miss, or when it could not be
    read: then `decision` already says so); `checkpoint_steps` the steps whose latents the new entry may keep."""
    warnings = []
    if decision.reuse and (unfit := unfit_entry(payload, decision, probed)):
        warnings.append(f"entry {decision.entry_id} {unfit}: this request is generated in full")
        decision = full_generation(decision, probed, f"entry {decision.entry_id} does not fit this request")
    observer = GenerationObserver(checkpoints=CheckpointRecorder(
        frozenset(s for s in checkpoint_steps if s > decision.resume_step)))
    if not decision.reuse:
        # The connectivity serves later hits' sparse attention. Where this policy never reuses (few-step schedules
        # at safe and balanced) it is not recorded: a miss there costs what plain sampling does, and a hit another
        # level takes from this entry attends densely.
        if not gate_module.refuses_few_step(config.policy(), probed.steps, probed.probe_steps):
            record_step = max(probed.probe_steps, int(0.3 * probed.steps))
            observer.connectivity = ConnectivityRecorder(record_step, config.block_size, config.attention_mass,
                                                         config.max_density)
        latent = runner.run(probed.latent, probed.sigmas, probed.probe_steps, probed.steps, observer)
        recorded = observer.connectivity.tensors() if observer.connectivity is not None else {}
        return Finished(decision, latent, observer, recorded, warnings)
    region = None
    if config.region_only:
        decision, region, problem = plan_region(runner, probed, decision, payload, config)
        warnings += [problem] if problem else []
    latent = follow_entry(runner, probed, decision, payload, config, observer, region)
    if region is not None and region.missing:
        warnings.append(f"region-only resume: {region.missing}")
    if region is not None and region.failed:
        warnings.append(region.failed)
    if region is not None and region.fallback:
        decision = _with_reason(decision, region.fallback.reason, {"region_only": False,
                                                                   "region_steps": region.region_steps_run})
        decision = dataclasses.replace(decision, region="whole clip: " + region.fallback.note)
    elif region is not None:     # where the kept keys and values were: bytes resident on the device and streamed
        placed = region.keys_values.placed
        decision = dataclasses.replace(decision, numbers={**decision.numbers, "region_resident_bytes": placed["resident"],
                                                          "region_streamed_bytes": placed["streamed"]})
    return Finished(decision, latent, observer, payload.connectivity, warnings)


def plan_region(runner, probed, decision: gate_module.Decision, payload, config) -> tuple:
    """(decision with the region verdict in its reasons, RegionTokens or None, warning or ""). Region-only needs the
    entry's final latent (what every token outside the region ends as) in this request's shape; without it the hit resumes
    whole-clip with a warning."""
    fhw = tuple(probed.latent.shape[-3:])
    final = payload.final
    if final is None or tuple(final.shape) != tuple(probed.latent.shape):
        why = ("holds no final latent" if final is None else
               f"holds a final latent of shape {list(final.shape)}, not this request's {list(probed.latent.shape)}")
        reason = f"region-only resume not possible: entry {decision.entry_id} {why}; whole-clip resume"
        decision = dataclasses.replace(_with_reason(decision, reason, {}),
                                       region="whole clip: the cached generation has no usable final latent")
        return decision, None, reason
    unfit = getattr(runner, "region_only_unfit", None)     # the runner's model cannot run it (a static-shape compile)
    if unfit:
        reason = f"region-only resume not possible: {unfit.reason}; whole-clip resume"
        decision = dataclasses.replace(_with_reason(decision, reason, {"region_only": False}),
                                       region="whole clip: " + unfit.note)
        return decision, None, reason
    tokens = target_tokens(runner.layout, region_latent_cells(decision, fhw, config.region_target_mass), REGION_HALO)
    share = float(tokens.float().mean())
    full = _full_steps(runner, decision, config, payload)
    ok, reason, note, expected = gate_module.region_only_verdict(share, config.region_max_share, decision, len(full))
    region_steps = max(0, decision.steps - decision.resume_step - len(full)) if ok else 0
    decision = _with_reason(decision, reason, {"region_share": round(share, 4), "region_only": ok,
                                               "region_steps": region_steps, "region_expected_speedup": expected,
                                               "region_full_steps": sorted(full) if ok else []})
    decision = dataclasses.replace(decision, region=note)
    if not ok:
        return decision, None, ""
    # The region starts where a whole-clip hit would: the request's own state in the gate's target cells, the cached
    # checkpoint elsewhere. Starting all of it from the probe's own state (its estimate jumped to step k) measured
    # further from plain sampling of the edit: on the tiny Wan at cfg 1, 53.4 against 60.2 dB (docs/region-resume.md).
    reach = None
    if config.region_sparse_keys and config.sparse_attention and payload.connectivity:
        reach = reached_key_rows(payload.connectivity, tokens)
        decision = dataclasses.replace(decision, numbers={**decision.numbers,
                                                          "region_key_share": round(key_share(reach, tokens), 4)})
    region = RegionTokens(tokens, full, getattr(runner, "memory", None), config.region_memory_margin, reach,
                          config.region_kv_8bit, config.region_kv_triton, config.region_fa4)
    return decision, region, ""


def region_latent_cells(decision: gate_module.Decision, fhw, target_mass: float) -> torch.Tensor:
    """[F, H, W] bool: the latent cells a region-only resume of this hit computes (before its halo): the gate's target
    cells and the cells holding `target_mass` of the difference, joined over the latent (the two may come on
    different grids: a benchmark forces a target over the latent itself)."""
    cells = latent_mask(decision.target_cells, fhw)
    if decision.cell_map is not None:
        cells = cells | latent_mask(region_cells(decision.cell_map, target_mass), fhw)
    return cells


def key_share(reach: dict, tokens: torch.Tensor) -> float:
    """The mean share of the clip's video keys a region step's target attends to over the blocks with a table."""
    if not reach:
        return 1.0
    return sum(1.0 if rows is None else len(rows) / tokens.numel() for rows in reach.values()) / len(reach)


def _full_steps(runner, decision: gate_module.Decision, config, payload) -> frozenset:
    """Resumed steps that run every token and capture the others' keys and values: the first, the first of the
    low-noise expert (its keys differ from the high-noise expert's), and `region_refresh_steps` more, spread evenly
    over the stored checkpoints after the first (there the others' latent is the cached trajectory's own), each with a
    region step before it and after it (a refresh next to a full step would capture what that step just did)."""
    k, steps = decision.resume_step, decision.steps
    full = {k}
    switch = getattr(runner, "switch_step", None)
    if switch is not None and k < switch < steps:
        full.add(int(switch))
    stored = [s for s in (payload.checkpoints if payload is not None else ()) if k + 1 < s < steps - 1]
    for i in range(int(config.region_refresh_steps)):
        aim = k + (steps - k) * (i + 1) / (int(config.region_refresh_steps) + 1)
        apart = [s for s in stored if all(abs(s - f) > 1 for f in full)]
        if apart:
            full.add(min(apart, key=lambda s: (abs(s - aim), s)))
    return frozenset(full)


def _with_reason(decision: gate_module.Decision, reason: str, numbers: dict) -> gate_module.Decision:
    return dataclasses.replace(decision, reasons=decision.reasons + [reason], numbers={**decision.numbers, **numbers})


def follow_entry(runner, probed, decision: gate_module.Decision, payload, config, observer: GenerationObserver,
                 region: Optional[RegionTokens] = None) -> torch.Tensor:
    """A hit's steps: the cached trajectory from the resume step on, the target region the request's own; with
    `region`, the resumed steps run the target tokens only between its full steps (region_only_steps)."""
    k = decision.resume_step
    fhw = probed.latent.shape[-3:]
    if config.localize:
        target = latent_mask(decision.target_cells, fhw)
    else:
        target = torch.zeros(tuple(fhw), dtype=torch.bool)
    if config.sparse_attention and payload.connectivity:
        observer.sparse = plan_from_tensors(payload.connectivity, runner.layout.tokens_from_latent_mask(target))
    sigmas = probed.sigmas
    own, denoised, at = probed.latent, probed.denoised, probed.probe_steps
    if decision.refine_step is not None:
        m = decision.refine_step
        x = resume_latent(own, denoised, float(sigmas[at]), float(sigmas[m]), payload.checkpoints[m], target)
        own, denoised, at = runner.run(x, sigmas, m, m + 1, observer), observer.last_denoised, m + 1
    x = resume_latent(own, denoised, float(sigmas[at]), float(sigmas[k]), payload.checkpoints[k], target)
    if region is not None:
        finished = region_only_steps(runner, x, sigmas, k, payload, region, observer)
        if finished is not None:
            return finished
    return runner.run(x, sigmas, k, probed.steps, observer)


def cached_state(payload, step: int, sigmas: torch.Tensor) -> torch.Tensor:
    """The cached generation's latent entering `step`: its checkpoint there, or where none was kept, its latest
    checkpoint before it jumped towards its final latent (used only as the other tokens' context at a full step
    without a checkpoint, the first of a new expert: their result is the cached final latent either way)."""
    if step in payload.checkpoints:
        return payload.checkpoints[step]
    before = max(s for s in payload.checkpoints if s < step)
    return jump(payload.checkpoints[before].float(), payload.final.float(), float(sigmas[before]), float(sigmas[step]))


def region_only_steps(runner, x: torch.Tensor, sigmas: torch.Tensor, k: int, payload, region: RegionTokens,
                      observer: GenerationObserver) -> Optional[torch.Tensor]:
    """Steps k..N, the target tokens alone through the blocks except at the region's full steps; returns the final
    latent: the target region (halo included) as this request computed it, every other token the cached final latent.
    A full step's input outside the region is the cached trajectory's own latent at that step, so the others' keys and
    values are those of a state the cached generation passed through. None when the region steps failed: the caller
    resumes the whole clip from step k."""
    steps = len(sigmas) - 1
    full = sorted(s for s in region.full_steps if s < steps)
    inside = latent_mask_of_tokens(runner.layout, region.target, x.shape[-3:])
    own, observer.region = x, region
    try:
        for start, stop in zip(full, full[1:] + [steps]):
            if start > k and not region.fallback:
                own = torch.where(inside.to(own.device)[None, None], own,
                                  cached_state(payload, start, sigmas).to(own.device, own.dtype))
            own = runner.run(own, sigmas, start, stop, observer)
    except RuntimeError as error:     # never a failed request: the whole clip from step k instead (a cancel is no
        first = (str(error).splitlines() or [""])[0][:160]    # RuntimeError: it goes through)
        if isinstance(error, torch.OutOfMemoryError):
            region.stop(gate_module.RegionFallback("region-only resume ran out of GPU memory",
                                                   f"region-only resume ran out of GPU memory ({first}); "
                                                   f"whole-clip resume from step {k}"))
        else:                         # a fault of the region path: said as a warning too, never hidden
            region.failed = f"region-only resume failed ({type(error).__name__}: {first}); whole-clip resume from " \
                            f"step {k}"
            region.stop(gate_module.RegionFallback("region-only resume failed", region.failed))
        own = None
    finally:
        observer.region = None
        region.keys_values.release()
    fresh = getattr(runner, "fresh_step_cache", None)
    if fresh is not None:     # a step cache's state from region steps would answer later full steps with it
        fresh()
    if own is None:
        if observer.checkpoints is not None:     # what the failed run recorded is redone by the whole-clip resume
            observer.checkpoints.latents.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None
    if not len(region.others):      # every token was the target's: nothing to join
        return own
    if observer.checkpoints is not None and region.cut_steps:   # also before a fallback, once region steps ran
        _join_checkpoints(observer.checkpoints.latents, payload.checkpoints, inside, max(region.cut_steps) + 1)
    if region.fallback:             # every token was computed from the fallback on: the result is the sampler's
        return own
    return torch.where(inside.to(own.device)[None, None], own, payload.final.to(own.device, own.dtype))


def _join_checkpoints(recorded: dict, cached: dict, inside: torch.Tensor, until: int) -> None:
    """The new entry's checkpoints up to step `until` (the one after the last region step): the region as this request
    computed it, every other token the cached checkpoint of the same step (the sampler's latent there was not
    computed); a step the cached entry kept no checkpoint of is dropped. Later ones (every token computed after a
    fallback) stay as recorded."""
    for step in [s for s in recorded if s <= until]:
        if step not in cached:
            del recorded[step]
            continue
        latent = recorded[step]
        recorded[step] = torch.where(inside.to(latent.device)[None, None], latent,
                                     cached[step].to(latent.device, latent.dtype))


def unfit_entry(payload, decision: gate_module.Decision, probed) -> str:
    """Why a chosen entry's trajectory cannot continue this request ("" when it can): a checkpoint the decision
    resumes from is missing, or its latent shape is not the request's (an entry a bucket should never have held)."""
    needed = [decision.resume_step] + ([decision.refine_step] if decision.refine_step is not None else [])
    missing = [step for step in needed if step not in payload.checkpoints]
    if missing:
        return f"has no checkpoint at step {missing[0]}"
    shape = tuple(probed.latent.shape)
    wrong = [step for step in needed if tuple(payload.checkpoints[step].shape) != shape]
    if wrong:
        return (f"holds a latent of shape {list(payload.checkpoints[wrong[0]].shape)} at step {wrong[0]}, but this "
                f"request's latent has shape {list(shape)}")
    return ""


def full_generation(decision: gate_module.Decision, probed, why: str) -> gate_module.Decision:
    return dataclasses.replace(decision, reuse=False, exact_repeat=False, entry_id=None, target_cells=None,
                               refine_step=None, resume_step=probed.probe_steps, reasons=[why])
