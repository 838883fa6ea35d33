"""The gate at few-step schedules (8 steps or fewer: step-distilled models at cfg 1) after their default one-step
probe: where it refuses to reuse.

Measured in the evaluation world with the demo model's 4-step student (benchmarks/RESULTS.md, "Few-step schedules";
CPU, fresh seeds, 80 stream requests and 40 look-alike pairs each): at 4 steps the balanced limits accepted half the
stream and made 9 of its 80 requests wrong (and 4 of 40 pairs), all but one by losing the shape of a small object;
at 8 steps the one-stage reflow student lost as much. After one distilled step the probe's estimate shows where the
object is, not yet its exact shape, and a hit resumes so late that the region it regenerates jumps most of the
way from that estimate. None of the gate's inputs told those hits from the good ones; the look-alike rule
(refuse_subject_change) left 1 of 80 wrong while saving 6 % of the calls. Resuming at half the schedule instead
still made 4-7 of 80 wrong (the blur of the subject is in the probe's estimate, whatever the resume step), and the
look-alike rule with the same seed kept 2 hits beyond exact repeats in 80, one of them wrong at 4 steps
(docs/few-step.md, "What else was tried"). So the safe and balanced risk levels do not
reuse at these schedules after a one-step probe: every request runs in full and is stored, and an exact repeat
still returns its stored result with no model call. The aggressive level reuses (GatePolicy.few_step_reuse) and can
make requests wrong; a longer probe (probe_steps 2 and more) is judged by the limits alone and is not measured here.
"""
from __future__ import annotations

REFUSAL_START = "no reuse at"


def refusal(steps: int) -> str:
    """The gate's reason for a request it does not reuse at a few-step schedule."""
    return (f"{REFUSAL_START} {steps} steps at this risk level: after one step a step-distilled model shows where the "
            "subject is but not its exact shape, and a hit resuming this late made requests wrong that the gate's "
            "numbers could not tell apart; the request runs in full (an exact repeat still costs no model call; "
            "risk 'aggressive' reuses here)")


def refused(decision) -> bool:
    """Whether the gate refused this decision for its few-step schedule alone."""
    return not decision.reuse and bool(decision.reasons) and decision.reasons[0].startswith(REFUSAL_START)


PLAIN_WORDS = ("at 8 steps or fewer this risk level generates every new request in full: after one step the model "
               "has not settled the subject's exact shape, and reuse made some requests wrong there")
