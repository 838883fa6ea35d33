import pytest
import torch

from carnator_engine.gate import RISK_POLICIES, decide, policy_for
from carnator_engine.store.index import Candidate
from carnator_engine.signature import EarlySignature, signature_distance
from carnator_engine.store import EntryRecord


def _sig(denoised, hidden=None):
    hidden = torch.ones(2, 3, 64) if hidden is None else hidden
    return EarlySignature(hidden=hidden, denoised=denoised, attention=torch.full((3, 4, 4), 0.25))


def _candidate(new, cached, prompt="whatever the prompt", steps=(4, 6, 8, 10, 12), entry="e1"):
    record = EntryRecord(entry_id=entry, bucket="b", prompt=prompt, seed=0, steps=20, probe_steps=3,
                         checkpoint_steps=list(steps), latent_shape=[1, 3, 8, 8, 8], created=0, last_used=0,
                         sig_sha256="", blob_sha256="", size_bytes=1)
    return Candidate(record, cached, signature_distance(new, cached))


BASE = torch.randn(3, 8, 8, 8, generator=torch.Generator().manual_seed(0))


def test_identical_signature_resumes_as_far_as_policy_and_checkpoints_allow():
    new = _sig(BASE)
    decision = decide([_candidate(new, _sig(BASE.clone()))], 20, 3, policy_for("balanced"), "balanced")
    assert decision.reuse and decision.entry_id == "e1"
    assert decision.resume_step == 10  # balanced allows up to 0.55 * 20 = 11; the entry holds 10
    assert decision.model_calls == 3 + 10 and decision.expected_speedup == pytest.approx(20 / 13)
    assert not decision.target_cells.any()


def test_local_difference_becomes_a_target_region():
    edited = BASE.clone()
    edited[:, 2:4, 2:4, 2:4] += 3.0
    decision = decide([_candidate(_sig(edited), _sig(BASE))], 20, 3, policy_for("balanced"), "balanced")
    assert decision.reuse
    cells = decision.target_cells
    assert cells[2:4, 2:4, 2:4].all()          # the edited cells are recomputed
    assert 0 < cells.float().mean() < 0.5 and not cells[7, 7, 7]


def test_a_clip_near_zero_is_localized_like_any_other():
    # A mid-gray scene in pixel space (or a latent near its channel means) has early estimates near
    # zero: small seed-to-seed wobble there is not a change, only the object's cells are.
    wobble = torch.Generator().manual_seed(1)
    cached = 0.03 * torch.randn(3, 8, 8, 8, generator=wobble)
    new = 0.03 * torch.randn(3, 8, 8, 8, generator=wobble)
    new[:, 2:4, 2:4, 2:4] += 1.5
    decision = decide([_candidate(_sig(new), _sig(cached))], 20, 3, policy_for("balanced"), "balanced")
    assert decision.reuse, decision.reasons
    assert decision.target_cells[2:4, 2:4, 2:4].all() and decision.numbers["target_fraction"] < 0.2


def test_target_region_is_re_estimated_midway_at_one_model_call():
    edited = BASE.clone()
    edited[:, 2:4, 2:4, 2:4] += 3.0
    candidate = _candidate(_sig(edited), _sig(BASE))
    decision = decide([candidate], 20, 3, policy_for("balanced"), "balanced")               # the default
    assert decision.reuse and decision.target_cells.any()
    k = decision.resume_step
    assert decision.refine_step == min((4, 6, 8, 10, 12), key=lambda s: (abs(s - (3 + k) / 2), s)) and 3 < decision.refine_step < k
    assert decision.model_calls == 3 + 20 - k + 1              # the refine call is counted
    assert f"re-estimated at step {decision.refine_step}" in decision.reasons[-1]
    plain = decide([candidate], 20, 3, policy_for("balanced", refine_target=False), "balanced")
    assert plain.refine_step is None and plain.model_calls == 3 + 20 - plain.resume_step
    with pytest.raises(ValueError, match="refine_target must be True or False"):
        policy_for("balanced", refine_target=0.5)


def test_nothing_to_refine_without_a_target_region_or_a_checkpoint_before_k():
    refine = policy_for("balanced")
    identical = decide([_candidate(_sig(BASE), _sig(BASE.clone()))], 20, 3, refine, "balanced")
    assert identical.refine_step is None                    # a pure copy: no target region
    edited = BASE.clone()
    edited[:, 2:4, 2:4, 2:4] += 3.0
    only_k = decide([_candidate(_sig(edited), _sig(BASE), steps=(10,))], 20, 3, refine, "balanced")
    assert only_k.reuse and only_k.resume_step == 10 and only_k.refine_step is None


def test_global_difference_is_rejected_with_reasons():
    other = torch.randn(3, 8, 8, 8, generator=torch.Generator().manual_seed(1))
    decision = decide([_candidate(_sig(other), _sig(BASE))], 20, 3, policy_for("aggressive"), "aggressive")
    assert not decision.reuse and decision.resume_step == 3 and decision.model_calls == 20
    assert any(reason.startswith("how much of the clip changes (target region share): ") and " over limit " in reason
               for reason in decision.reasons), decision.reasons          # a creator's words, then the measure


def test_model_states_disagreeing_rejects_even_when_layout_matches():
    hidden = torch.ones(2, 3, 64)
    hidden[:, :, :32] = -1
    decision = decide([_candidate(_sig(BASE, hidden), _sig(BASE))], 20, 3, policy_for("aggressive"))
    assert not decision.reuse
    assert any("pooled block states" in reason and "over" in reason for reason in decision.reasons)


def test_prompt_text_plays_no_part():
    """Same prompt but the model disagrees -> rejected; different prompt but the model agrees -> accepted."""
    other = torch.randn(3, 8, 8, 8, generator=torch.Generator().manual_seed(2))
    same_text = _candidate(_sig(other), _sig(BASE), prompt="a red car driving left")
    assert not decide([same_text], 20, 3, policy_for("safe")).reuse
    different_text = _candidate(_sig(BASE), _sig(BASE.clone()), prompt="a red car driving right")
    assert decide([different_text], 20, 3, policy_for("safe")).reuse


def test_riskier_levels_resume_later():
    slightly = BASE + 0.05 * torch.randn(3, 8, 8, 8, generator=torch.Generator().manual_seed(3))
    steps = list(range(4, 14))
    resume = {risk: decide([_candidate(_sig(slightly), _sig(BASE), steps=steps)], 20, 3, policy_for(risk)).resume_step
              for risk in RISK_POLICIES}
    assert 3 < resume["safe"] <= resume["balanced"] <= resume["aggressive"]


def test_without_shrinking_an_accepted_candidate_resumes_at_the_furthest_step():
    edited = BASE.clone()
    edited[:, 2:4, 2:4, 2:4] += 3.0
    edited += 0.15 * torch.randn(edited.shape, generator=torch.Generator().manual_seed(2))  # context risk ~ 0.5
    candidate = _candidate(_sig(edited), _sig(BASE), steps=range(4, 12))
    shrunk = decide([candidate], 20, 3, policy_for("balanced"), "balanced")
    assert shrunk.reuse and shrunk.numbers["risk_score"] > 0.2 and shrunk.resume_step < 11
    furthest = decide([candidate], 20, 3, policy_for("balanced", shrink_with_risk=False), "balanced")
    assert furthest.reuse and furthest.resume_step == 11 and furthest.target_cells.equal(shrunk.target_cells)
    with pytest.raises(ValueError, match="shrink_with_risk must be True or False"):
        policy_for("balanced", shrink_with_risk="no")


def test_no_usable_checkpoint_means_no_reuse():
    decision = decide([_candidate(_sig(BASE), _sig(BASE.clone()), steps=[4])], 20, 3, policy_for("balanced"))
    assert not decision.reuse and "too little to save" in decision.reasons[-1]


def test_empty_store_is_a_miss():
    decision = decide([], 20, 3, policy_for("safe"), "safe")
    assert not decision.reuse and "no earlier generation" in decision.reasons[0]


@pytest.mark.parametrize("override", [{"max_hidden": -1.0}, {"cell_threshold": 0.0}, {"max_target_fraction": 1.5},
                                      {"max_resume_fraction": float("nan")}, {"min_saved_steps": 0},
                                      {"max_context_share": 0.0}, {"max_context_share": 11.0}])
def test_absurd_thresholds_are_refused(override):
    with pytest.raises(ValueError):
        policy_for("balanced", **override)


def test_unknown_risk_level():
    with pytest.raises(ValueError, match="choose one of safe, balanced, aggressive"):
        policy_for("yolo")


def test_a_nan_distance_is_incompatible_not_a_crash():
    broken = BASE.clone()
    broken[0, 0, 0, 0] = float("nan")
    decision = decide([_candidate(_sig(broken), _sig(BASE))], 20, 3, policy_for("balanced"), "balanced")
    assert not decision.reuse and any("nan over limit" in r for r in decision.reasons)


def test_estimates_that_agree_no_better_than_chance_are_refused_however_small():
    # At 480p a signature cell pools ~160 latent voxels, so two unrelated early estimates (another seed on a model
    # whose estimate is still noise-like) differ by only ~0.1 noise units: inside max_context, a wrong hit unless
    # the difference is read against what unrelated estimates of this model and shape differ by.
    draw = torch.Generator().manual_seed(3)
    cached, other_seed = (0.08 * torch.randn(16, 8, 8, 8, generator=draw) for _ in range(2))
    policy = policy_for("balanced")
    decision = decide([_candidate(_sig(other_seed), _sig(cached))], 20, 3, policy, "balanced")
    assert not decision.reuse
    assert decision.numbers["context"] < policy.max_context           # noise units alone would have reused it
    assert decision.numbers["context_share"] == pytest.approx(1.0, abs=0.1)
    assert any("share of two unrelated estimates" in r and "over" in r for r in decision.reasons)
    nudged = cached + 1e-3 * torch.randn(cached.shape, generator=draw)
    decision = decide([_candidate(_sig(nudged), _sig(cached))], 20, 3, policy, "balanced")
    assert decision.reuse and decision.numbers["context_share"] < 0.05


def test_a_constant_estimate_has_no_chance_scale_and_is_never_a_hit():
    flat = torch.zeros(3, 8, 8, 8)
    decision = decide([_candidate(_sig(flat), _sig(flat.clone()))], 20, 3, policy_for("balanced"), "balanced")
    assert not decision.reuse and decision.numbers["context_share"] == float("inf")


def test_resume_from_hits_off_resumes_only_from_full_generations():
    new = _sig(BASE)
    hit = _candidate(new, _sig(BASE.clone()), entry="hit")
    hit.record.reused_from = "root"
    root = _candidate(new, _sig(BASE + 0.01), entry="root", steps=(4, 6, 8))
    assert decide([hit, root], 20, 3, policy_for("aggressive"), "aggressive").entry_id == "hit"   # either source
    decision = decide([hit, root], 20, 3, policy_for("balanced"), "balanced")       # the default: full generations
    assert decision.reuse and decision.entry_id == "root"
    alone = decide([hit], 20, 3, policy_for("safe"), "safe")
    assert not alone.reuse and "is itself a reuse of entry root" in " ".join(alone.reasons)
    assert decide([hit], 20, 3, policy_for("balanced", resume_from_hits=True), "balanced").entry_id == "hit"
    far = _candidate(new, _sig(BASE + 5.0), entry="far root")      # judged and refused: its numbers explain the miss
    refused = decide([hit, far], 20, 3, policy_for("balanced"), "balanced")
    assert not refused.reuse and refused.reasons[0] == "nearest entry far root rejected" and refused.numbers
