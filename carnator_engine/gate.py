"""Compatibility Gate: a risk-aware decision, from the model's own early states, to reuse or not.

Text similarity never enters: two prompts that read alike ("driving left" / "driving right") are
judged by what the model has already started to generate. A candidate is reused only if
- the model reads both requests alike (pooled block states and attention structure agree), and
- outside the target cells their early denoised estimates agree, in noise units and well beyond the agreement of
  two unrelated estimates of the same model and shape, and
- the target cells (recomputed, not copied) are a small enough part of the clip.
The resume step k shrinks as risk grows, and snaps to a step the entry holds a checkpoint for.
Every decision carries its numbers and its reasons.

Few-step schedules (at most FEW_STEPS steps: step-distilled LoRAs at cfg 1) probed for one step, their default, are
not reused at the safe and balanced levels (few_step_gate.py says why). Otherwise they are judged by the same limits, but
each step there is a large part of the request: resuming one step earlier costs 12-25 % of the speed-up, so k is
the furthest step the risk level allows (few_step_resume_fraction), never shrunk and never preceded by a midway
refine call; where even that saves fewer than min_saved_steps calls, the gate refuses.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import NamedTuple, Optional

import torch

from . import few_step_gate
from .localize import target_cells
from .settings import RISK_LEVELS

FEW_STEPS = 8   # schedules this short are step-distilled ones: their first step's x0-hat already shows the layout


@dataclass(frozen=True)
class GatePolicy:
    max_hidden: float            # 1 - cosine of pooled block states
    max_attention: float         # total-variation distance of pooled attention rows
    max_context: float           # x0-hat difference outside the target cells (RMS, noise units)
    # The same difference as a share of what two unrelated estimates of this model and shape differ by
    # (signature.chance_distance). Noise units alone do not carry across sizes: a 480p Wan latent pools ~160
    # voxels into each signature cell, so there another seed on random weights differs by only 0.09 (under
    # max_context) although it shares nothing with the cached request; as a share of chance it reads ~0.8.
    max_context_share: float
    cell_threshold: float        # a cell whose x0-hat difference (noise units) exceeds this is a target cell
    max_target_fraction: float   # beyond this share of the clip, regenerating is the honest choice
    max_resume_fraction: float   # the furthest resume step, as a share of all steps
    # The same at FEW_STEPS steps or fewer. A distilled model's straight paths make the probe's x0-hat nearly its
    # final clip, so the target region's jump is accurate from further on; and at 4 steps only k = 3 pays.
    few_step_resume_fraction: float = 0.75
    min_saved_steps: int = 2     # a hit must save at least this many model calls
    # Whether to reuse at all at FEW_STEPS steps or fewer after a one-step probe (their default; an exact repeat is
    # answered either way). Off for safe and balanced: there the reuse made requests wrong that no limit told apart
    # (few_step_gate.py has the measurements).
    few_step_reuse: bool = False
    # One model call midway (on the cached latent with the target region jumped there) re-estimates the
    # target region before its jump to k, instead of one long jump from the probe's blurry estimate.
    # On by default: on the evaluation world's 8 pooled request sets (benchmarks/RESULTS.md) it made fewer requests
    # wrong than the plain jump in every comparison (balanced: 19 -> 14 and 24 -> 20 of 960 stream requests, 13 -> 9
    # wrong accepts of 384 adversarial pairs) and raised PSNR by 0.5-4.5 dB, for one model call per hit (about one
    # point of the calls saved); a small object, the typical hit there, is all target region and barely formed at
    # the probe, so one long jump from the probe's estimate loses its shape.
    refine_target: bool = True
    # The resume step shrinks linearly with the risk score by default. Off: every accepted candidate resumes at the
    # furthest step. In the evaluation world no gate input ranked the resumes that went wrong consistently
    # (benchmarks/quality.py ceiling), so the shrinking is caution, not a prediction; this switch measures it.
    shrink_with_risk: bool = True
    # Look-alike edits ("circle" for "triangle", "up" for "down") change the subject itself, yet with the same seed
    # they can pass every limit above (tests/test_gate_look_alike.py: the default reuses both). On: such a
    # candidate is refused (subject_change). It costs hits (on 24 same-seed direction/colour pairs it refused all 7
    # the default took, none of them wrong), so it stays off by default until the pooled evaluation-world check has
    # run with it (benchmarks/quality.py suite's subject_rule).
    refuse_subject_change: bool = False
    # Whether an entry that is itself a reuse (a hit's result) may be resumed from. Off for safe and balanced: only
    # full generations are, so a hit's result never starts another (the lookup brings each hit's full generation
    # along; an exact repeat of a hit still gets its stored result). A hit copies its source's early trajectory and
    # whatever the model got wrong there; resumed from again, the copy is copied. On the 1,000-request creator trace
    # with a fixed seed, off took the default from -1.4 points (outside 1) to -0.5 for 1.4 points of the calls saved
    # (docs/creator-trace.md).
    resume_from_hits: bool = True
    # ... the pooled block states this far apart with no target cell at all: the change is not decided yet
    undecided_hidden: float = 0.001
    # ... the least share of the cached subject (cells departing from their frame's background by more than
    # cell_threshold) that must lie outside the target region: all of it inside, only the background is shared
    min_shared_subject: float = 0.25

    def validate(self) -> "GatePolicy":
        for name, (low, high) in SETTING_RANGES.items():
            value = getattr(self, name)
            below_high = value < high if name in BELOW_HIGH else value <= high
            if not (low < value and below_high) or math.isnan(value):
                if name in BELOW_HIGH:
                    raise ValueError(f"gate setting {name}={value} is outside ({low}, {high}): at {high} or more a "
                                     "hit would resume at the last step, where no step of the request runs; use a "
                                     "value in that range or pick a risk level preset")
                raise ValueError(f"gate setting {name}={value} is outside ({low}, {high}]: "
                                 "use a value in that range or pick a risk level preset")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.min_saved_steps < 1:
            raise ValueError(f"min_saved_steps must be >= 1, got {self.min_saved_steps}")
        return self


# Each numeric setting's allowed range (low, high]: low excluded, high included except for BELOW_HIGH (a resume at
# the furthest share 1 would leave no step of the request to run). The Compatibility Gate node's inputs take these.
SETTING_RANGES = {"max_hidden": (0, 2), "max_attention": (0, 1), "max_context": (0, 10), "max_context_share": (0, 10),
                  "cell_threshold": (0, 10), "max_target_fraction": (0, 1), "max_resume_fraction": (0, 1),
                  "few_step_resume_fraction": (0, 1), "undecided_hidden": (0, 2), "min_shared_subject": (0, 1)}
BELOW_HIGH = ("max_resume_fraction", "few_step_resume_fraction")
SWITCHES = tuple(f.name for f in fields(GatePolicy) if f.type == "bool")   # on/off settings, the rest are numbers

# Thresholds are scale-free (cosines, distribution distances, shares of chance) or in units of the sampler's
# unit-variance noise. The noise-unit limits alone did not carry to real sizes (see max_context_share); the share of
# chance does: benchmarks/gate_transfer.py checks the defaults on every backbone at real size. The values were
# checked in the evaluation world, where the truth of every generated attribute is known: benchmarks/quality.py
# measures what each preset costs and saves, `benchmarks/quality.py ceiling` what any gate could save at best.
RISK_POLICIES = {
    "safe": GatePolicy(max_hidden=0.010, max_attention=0.08, max_context=0.20, max_context_share=0.40,
                       cell_threshold=0.30, max_target_fraction=0.35, max_resume_fraction=0.45,
                       few_step_resume_fraction=0.6, resume_from_hits=False),
    "balanced": GatePolicy(max_hidden=0.020, max_attention=0.12, max_context=0.30, max_context_share=0.50,
                           cell_threshold=0.35, max_target_fraction=0.50, max_resume_fraction=0.55,
                           few_step_resume_fraction=0.75, resume_from_hits=False),
    "aggressive": GatePolicy(max_hidden=0.040, max_attention=0.18, max_context=0.40, max_context_share=0.85,
                             cell_threshold=0.40, max_target_fraction=0.65, max_resume_fraction=0.65,
                             few_step_resume_fraction=0.8, few_step_reuse=True),
}


def few_step(steps: int) -> bool:
    return steps <= FEW_STEPS


def default_probe_steps(steps: int) -> int:
    """One probe step at few-step schedules (the distilled first step shows the layout; a second would cost a
    quarter of a 4-step request), three otherwise."""
    return 1 if few_step(steps) else 3


def refuses_few_step(policy: GatePolicy, steps: int, probe_steps: int) -> bool:
    """Whether this policy never reuses a request of this schedule and probe length (few_step_gate.py says why)."""
    return few_step(steps) and probe_steps == 1 and not policy.few_step_reuse


def furthest_resume(policy: GatePolicy, steps: int) -> int:
    """The latest step a hit may resume at under this policy: never the last, so the request's own steps finish it."""
    fraction = policy.few_step_resume_fraction if few_step(steps) else policy.max_resume_fraction
    return max(0, min(steps - 1, int(fraction * steps)))


def latest_resume_checkpoint(steps: int) -> int:
    """The latest step an entry keeps a checkpoint to resume at: the furthest any risk preset resumes. An entry's
    later checkpoints serve region-only refreshes (resume.region_only_steps), never a resume step, so a gate whose
    overrides reach further resumes where it did before they were kept."""
    return max(furthest_resume(p, steps) for p in RISK_POLICIES.values())


def policy_for(risk: str, **overrides) -> GatePolicy:
    if risk not in RISK_POLICIES:
        raise ValueError(f"unknown risk level {risk!r}: choose one of {', '.join(RISK_LEVELS)}")
    base = asdict(RISK_POLICIES[risk])
    base.update({k: v for k, v in overrides.items() if v is not None})
    return GatePolicy(**base).validate()


@dataclass
class Decision:
    reuse: bool
    risk: str
    steps: int
    probe_steps: int
    resume_step: int                      # where the trajectory continues; probe_steps on a miss
    entry_id: Optional[str] = None
    target_cells: Optional[torch.Tensor] = None  # [Tg, Hg, Wg] bool, recomputed from the request's own state
    numbers: dict = field(default_factory=dict)
    reasons: list = field(default_factory=list)
    refine_step: Optional[int] = None     # the midway step whose model call re-estimates the target region
    exact_repeat: bool = False            # the entry is this very request: its stored result, no model call
    cell_map: Optional[torch.Tensor] = None  # [Tg, Hg, Wg] the early estimates' difference per cell (a hit's)
    region: str = ""                      # a hit under region-only resume: how it resumed, in a creator's words

    @property
    def region_only(self) -> bool:
        return bool(self.numbers.get("region_only"))

    @property
    def model_calls(self) -> int:
        return self.probe_steps + self.steps - self.resume_step + (self.refine_step is not None)

    @property
    def expected_speedup(self) -> Optional[float]:
        """None for an exact repeat, which makes no model call at all; a region-only hit's steps cost their share."""
        if self.region_only and self.numbers.get("region_expected_speedup"):
            return self.numbers["region_expected_speedup"]
        return self.steps / self.model_calls if self.model_calls else None

    def summary(self) -> dict:
        speedup = self.expected_speedup
        return {"reuse": self.reuse, "risk": self.risk, "entry_id": self.entry_id, "steps": self.steps,
                "probe_steps": self.probe_steps, "resume_step": self.resume_step, "refine_step": self.refine_step,
                "model_calls": self.model_calls, "expected_speedup": None if speedup is None else round(speedup, 3),
                "exact_repeat": self.exact_repeat, "region": self.region, "numbers": self.numbers,
                "reasons": self.reasons}


def exact_repeat(entry_id: str, steps: int, risk: str, probe_steps: int = 0) -> Decision:
    """The decision for a request whose every input matches a full generation's: its stored result, with no
    model call beyond the probe steps already run (none when the repeat is found before probing)."""
    return Decision(reuse=True, risk=risk, steps=steps, probe_steps=probe_steps, resume_step=steps, entry_id=entry_id,
                    exact_repeat=True,
                    reasons=[f"exact repeat of entry {entry_id}: same model, sampler, schedule, conditioning and "
                             "noise, so its stored result is this request's result"])


def _refine_step(checkpoints, probe_steps: int, resume: int) -> Optional[int]:
    """The entry's checkpoint nearest the middle of (probe_steps, resume), if there is one."""
    inside = [s for s in checkpoints if probe_steps < s < resume]
    middle = (probe_steps + resume) / 2
    return min(inside, key=lambda s: (abs(s - middle), s)) if inside else None


def measure(candidate, policy: GatePolicy):
    """(target cells, numbers) of one candidate: its signature distances, the share of the clip its target
    cells cover, and how far the early denoised estimates differ outside them."""
    distance = candidate.distance
    cells = target_cells(distance.cell_map, policy.cell_threshold)
    outside = distance.cell_map[~cells]
    context = outside.pow(2).mean().sqrt().item() if outside.numel() else 0.0
    # No spread at all (a constant estimate) says nothing about agreement: infinitely far, never a hit.
    share = context / distance.chance if distance.chance > 0 else math.inf
    return cells, {**distance.as_dict(), "context": context, "context_share": share,
                   "target_fraction": cells.float().mean().item()}


def subject_cells(denoised: torch.Tensor, threshold: float) -> torch.Tensor:
    """[C, Tg, Hg, Wg] coarse x0-hat -> [Tg, Hg, Wg] bool: the cells departing from their frame's background (its
    per-channel median) by more than `threshold` (RMS over channels, noise units): what the clip shows on it."""
    flat = denoised.flatten(2)
    background = flat.median(-1).values[..., None, None]
    return (denoised - background).pow(2).mean(0).sqrt() > threshold


def subject_change(candidate, cells: torch.Tensor, policy: GatePolicy) -> Optional[str]:
    """Why reusing this candidate would copy a subject the request changes (None when it would not): the model reads
    the requests apart while their early estimates do not differ yet (the change is still undecided, so the cached
    trajectory would decide it the old way), or the target region holds nearly all of the cached subject (only the
    background would be reused and the whole subject would come from a jump off the probe's blurred estimate)."""
    hidden = candidate.distance.hidden
    if not bool(cells.any()) and hidden > policy.undecided_hidden:
        return (f"subject change: pooled block states differ by {hidden:.4f} (over {policy.undecided_hidden:.4f}) "
                "but no region differs yet: the change is undecided at the probe and the cached trajectory would "
                "decide it the old way")
    subject = subject_cells(candidate.signature.denoised, policy.cell_threshold)
    if bool(subject.any()) and bool(cells.any()):
        shared = (subject & ~cells).float().sum().item() / subject.float().sum().item()
        if shared < policy.min_shared_subject:
            return (f"subject change: {shared:.2f} of the cached subject lies outside the target region (under "
                    f"{policy.min_shared_subject:.2f}): only the background would be reused")
    return None


def _assess(candidate, policy: GatePolicy, steps: int, probe_steps: int):
    """Returns (resume_step or None, refine step or None, target cells, numbers, reasons) for one candidate."""
    cells, numbers = measure(candidate, policy)
    distance = candidate.distance
    # Each check in a creator's words first, the measure's own name in brackets (docs/gate.md explains it).
    limits = [("how differently the model reads the two requests (pooled block states)", distance.hidden,
               policy.max_hidden),
              ("how differently it lays out the clip (attention structure)", distance.attention, policy.max_attention),
              ("how much the rest of the clip differs early on (denoised estimate outside the target region)",
               numbers["context"], policy.max_context),
              ("the same, as a share of two unrelated estimates' difference", numbers["context_share"],
               policy.max_context_share),
              ("how much of the clip changes (target region share)", numbers["target_fraction"],
               policy.max_target_fraction)]
    numbers.update(context=round(numbers["context"], 5), context_share=round(numbers["context_share"], 4),
                   target_fraction=round(numbers["target_fraction"], 4))
    reasons = []
    # `not value <= limit`: a NaN distance (a broken signature) is over every limit, never a hit.
    for label, value, limit in limits:
        verdict = "over" if not value <= limit else "within"
        reasons.append(f"{label}: {value:.4f} {verdict} limit {limit:.4f}")
    if any(not value <= limit for _, value, limit in limits):
        return None, None, cells, numbers, reasons
    changed = subject_change(candidate, cells, policy) if policy.refuse_subject_change else None
    if changed:
        return None, None, cells, numbers, reasons + [changed]
    risk = max(value / limit for _, value, limit in limits[:-1])
    furthest = furthest_resume(policy, steps)
    shrink, refine_target = (False, False) if few_step(steps) else (policy.shrink_with_risk, policy.refine_target)
    wanted = probe_steps + int((furthest - probe_steps) * (1.0 - risk)) if shrink else furthest
    checkpoints = candidate.record.checkpoint_steps
    available = [s for s in checkpoints if probe_steps < s <= min(wanted, latest_resume_checkpoint(steps))]
    resume = max(available, default=probe_steps)
    refine = _refine_step(checkpoints, probe_steps, resume) if refine_target and bool(cells.any()) else None
    if resume - probe_steps - (refine is not None) < policy.min_saved_steps:
        if wanted < probe_steps + policy.min_saved_steps:
            reasons.append(f"resuming at step {wanted} of {steps}, the furthest this risk level allows, would save "
                           f"fewer than {policy.min_saved_steps} model calls after a {probe_steps}-step probe: "
                           "reuse cannot pay here")
        else:
            reasons.append(f"no checkpoint between step {probe_steps + policy.min_saved_steps} and step {wanted} "
                           "in this entry: too little to save")
        return None, None, cells, numbers, reasons
    numbers["risk_score"] = round(risk, 4)
    reasons.append(f"risk {risk:.2f} of the limit: resume at step {resume} of {steps}"
                   + (f", target region re-estimated at step {refine}" if refine is not None else ""))
    return resume, refine, cells, numbers, reasons


def decide(candidates: list, steps: int, probe_steps: int, policy: GatePolicy, risk: str = "custom",
           model_text: str = "") -> Decision:
    """Pick the candidate that saves the most model calls among those the policy accepts. `model_text` names the
    model's options (patches, step caches...): all part of the bucket, so the reason for a new bucket says them."""
    if not candidates:
        options = f" (this model: {model_text})" if model_text else ""
        return Decision(False, risk, steps, probe_steps, probe_steps,
                        reasons=[f"no earlier generation of this model, shape and schedule is in the cache{options}"])
    if refuses_few_step(policy, steps, probe_steps):
        return Decision(False, risk, steps, probe_steps, probe_steps, reasons=[few_step_gate.refusal(steps)])
    best, rejected, skipped = None, [], []
    for candidate in candidates:
        source = candidate.record.reused_from
        if source is not None and not policy.resume_from_hits:
            skipped.append((candidate.record.entry_id, {}, [
                f"entry {candidate.record.entry_id} is itself a reuse of entry {source}: only full generations are "
                "resumed from (resume_from_hits off)"]))
            continue
        resume, refine, cells, numbers, reasons = _assess(candidate, policy, steps, probe_steps)
        if resume is None:
            rejected.append((candidate.record.entry_id, numbers, reasons))
            continue
        decision = Decision(True, risk, steps, probe_steps, resume, candidate.record.entry_id, cells, numbers,
                            [f"reuse entry {candidate.record.entry_id} ('{candidate.record.prompt}')"] + reasons,
                            refine, cell_map=candidate.distance.cell_map)
        if best is None or decision.model_calls < best.model_calls:
            best = decision
    if best is not None:
        return best
    # the nearest candidate the limits judged says why, more than a hit's result skipped unjudged (resume_from_hits)
    entry_id, numbers, reasons = (rejected or skipped)[0]
    return Decision(False, risk, steps, probe_steps, probe_steps, numbers=numbers,
                    reasons=[f"nearest entry {entry_id} rejected"] + reasons)


class RegionFallback(NamedTuple):
    """Why a hit resumes the whole clip instead of region-only: `note` in a creator's words (the node's "whole clip:
    ..." line), `reason` with its figures (the decision's reasons)."""
    note: str
    reason: str


def region_only_verdict(share: float, max_share: float, decision: Decision, full_steps: int) -> tuple:
    """(region-only?, reason, what the node says, expected speedup or None) for a hit whose target tokens (halo
    included) are `share` of the clip.

    Region-only pays where the steps that run the target alone outweigh its full steps: a step costs about its share
    of the tokens (the linear layers and attention's queries both scale with it), and `full_steps` of the resumed
    steps (the keys and values of the other tokens) run every token. Beyond
    `max_share`, the cached rest is too small a part of the clip to hold it: whole-clip resume, which recomputes it."""
    calls_before = decision.probe_steps + (decision.refine_step is not None)
    resumed = decision.steps - decision.resume_step
    region_steps = resumed - full_steps
    whole = calls_before + resumed
    region = calls_before + full_steps + max(0, region_steps) * share
    text = (f"target tokens with their halo: {share:.1%} of the clip; region-only resume costs about {region:.1f} "
            f"full model calls against {whole} for whole-clip resume")
    if share == 0:
        return False, ("no target tokens: the cached request covers the whole clip, and whole-clip resume "
                       "recomputes it under this request's conditioning"), "whole clip: no region differs", None
    if not share <= max_share:
        return False, (f"{text}, but the target is over the region-only limit of {max_share:.0%}: whole-clip "
                       "resume"), (f"whole clip: the change covers {share:.0%} of it, over the region-only limit "
                                   f"of {max_share:.0%}"), None
    if region_steps < 1 or region > 0.9 * whole:
        return False, f"{text}: region-only saves under 10 % here, whole-clip resume", \
            "whole clip: too few steps left for region-only to pay", None
    expected = decision.steps / region
    return True, f"{text}: region-only resume, expected {expected:.2f}x", \
        f"region-only on {share:.0%} of the clip", round(expected, 3)
