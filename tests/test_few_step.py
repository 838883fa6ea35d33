"""Carnator at 4-8 steps, cfg 1 (step-distilled LoRAs): plain misses, repeats with no call, hits that pay, and the
bad inputs of such schedules refused before anything runs or is stored."""
import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.gate import default_probe_steps, furthest_resume, policy_for
from carnator_engine.observer import GenerationObserver
from carnator_engine.pipeline import CarnatorConfig, checkpoint_steps, decide, generate, lookup, probe, resume
from carnator_engine.schedule import flow_sigmas

PROMPT = "a red circle moving left"


def _noise(seed):
    return torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(seed))


def _config(steps, **kwargs):
    return CarnatorConfig(probe_steps=default_probe_steps(steps), block_size=64, **kwargs)


def _near_repeat(model, store, steps, **kwargs):
    """A request a hair off the stored one (seed 1): through probe -> lookup -> gate -> resume."""
    runner, config, sigmas = TinyDiTRunner(model, PROMPT), _config(steps, **kwargs), flow_sigmas(steps)
    probed = probe(runner, _noise(1) * 1.0001, sigmas, config)
    decision = decide(probed, lookup(store, probed, config), config)
    return resume(runner, probed, decision, store, config, PROMPT, 1)


def test_few_step_schedules_probe_one_step_and_keep_the_steps_a_hit_resumes_at():
    assert [default_probe_steps(n) for n in (4, 6, 8, 10, 30)] == [1, 1, 1, 3, 3]
    assert checkpoint_steps(4, 1, 12) == [2, 3]
    assert checkpoint_steps(8, 1, 12) == [2, 3, 4, 5, 6]
    assert [furthest_resume(policy_for("balanced"), n) for n in (4, 6, 8)] == [3, 4, 6]


def test_a_miss_at_4_steps_is_plain_sampling(live_tiny_model, store):
    sigmas = flow_sigmas(4)
    plain = TinyDiTRunner(live_tiny_model, PROMPT).run(_noise(1) * float(sigmas[0]), sigmas, 0, 4, GenerationObserver())
    miss = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), sigmas, store, _config(4), PROMPT, 1)
    assert not miss.decision.reuse and miss.model_calls == 4 and miss.entry_id
    torch.testing.assert_close(miss.latent, plain, atol=0, rtol=0)
    repeat = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), sigmas, store, _config(4), PROMPT, 1)
    assert repeat.decision.exact_repeat and repeat.model_calls == 0
    torch.testing.assert_close(repeat.latent, miss.latent)


@pytest.mark.parametrize("steps", [4, 6, 8])
@pytest.mark.parametrize("risk", ["safe", "balanced"])
def test_safe_and_balanced_do_not_reuse_at_few_steps_and_say_why(live_tiny_model, store, steps, risk):
    first = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(steps), store,
                     _config(steps, risk=risk), PROMPT, 1)
    refused = _near_repeat(live_tiny_model, store, steps, risk=risk)
    assert not refused.decision.reuse and refused.model_calls == steps
    assert refused.decision.reasons[0].startswith(f"no reuse at {steps} steps at this risk level")
    assert "risk 'aggressive' reuses here" in refused.decision.reasons[0]
    repeat = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(steps), store,
                      _config(steps, risk=risk), PROMPT, 1)
    assert repeat.decision.exact_repeat and repeat.model_calls == 0      # an exact repeat is still answered
    torch.testing.assert_close(repeat.latent, first.latent)


@pytest.mark.parametrize("risk, records", [("balanced", False), ("aggressive", True)])
def test_a_few_step_miss_records_attention_connectivity_only_where_its_level_reuses(live_tiny_model, store, risk,
                                                                                   records):
    miss = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(4), store, _config(4, risk=risk),
                    PROMPT, 1)
    payload = store.trajectory(store.record(miss.entry_id))
    assert bool(payload.connectivity) == records and sorted(payload.checkpoints) == [2, 3]
    assert payload.final is not None                                     # an exact repeat is answered either way


def test_the_few_step_refusal_is_for_few_steps_only(live_tiny_model, store):
    generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(20), store, _config(20), PROMPT, 1)
    near = _near_repeat(live_tiny_model, store, 20)
    assert near.decision.reuse, near.decision.reasons


@pytest.mark.parametrize("steps, resume_step, calls", [(4, 3, 2), (6, 4, 3), (8, 6, 3)])
def test_a_near_repeat_at_few_steps_is_a_hit_that_pays_at_risk_aggressive(live_tiny_model, store, steps, resume_step,
                                                                          calls):
    first = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(steps), store,
                     _config(steps, risk="aggressive"), PROMPT, 1)
    hit = _near_repeat(live_tiny_model, store, steps, risk="aggressive")
    assert hit.decision.reuse and hit.decision.entry_id == first.entry_id, hit.decision.reasons
    assert hit.decision.resume_step == resume_step and hit.decision.refine_step is None
    assert hit.model_calls == calls == 1 + steps - resume_step
    torch.testing.assert_close(hit.latent, first.latent, atol=2e-2, rtol=0)


def test_where_reuse_cannot_pay_at_4_steps_the_gate_says_so(live_tiny_model, store):
    generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(4), store, _config(4), PROMPT, 1)
    refused = _near_repeat(live_tiny_model, store, 4, risk="aggressive",     # resumes at most at step 2 of 4
                           gate_overrides={"few_step_resume_fraction": 0.6})
    assert not refused.decision.reuse and refused.model_calls == 4
    assert any("reuse cannot pay here" in reason for reason in refused.decision.reasons), refused.decision.reasons


@pytest.mark.parametrize("steps, config, message", [
    (4, CarnatorConfig(probe_steps=4), "probe_steps=4 must be between 1 and steps-1 \\(3\\)"),
    (1, CarnatorConfig(probe_steps=1), "the schedule has 1 step\\(s\\): Carnator needs at least 2"),
    (4, CarnatorConfig(probe_steps=1, gate_overrides={"few_step_resume_fraction": 1.0}),
     "few_step_resume_fraction=1.0 is outside \\(0, 1\\): at 1 or more a hit would resume at the last step"),
    (30, CarnatorConfig(probe_steps=3, gate_overrides={"max_resume_fraction": 1.0}),
     "max_resume_fraction=1.0 is outside \\(0, 1\\): at 1 or more"),
])
def test_bad_few_step_inputs_are_refused_and_nothing_is_stored(live_tiny_model, store, steps, config, message):
    with pytest.raises(ValueError, match=message):
        generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), flow_sigmas(steps), store, config, PROMPT, 1)
    assert store.records() == []


@pytest.mark.parametrize("guidance", [0.0, -1.0])
def test_guidance_below_one_is_refused(live_tiny_model, guidance):
    with pytest.raises(ValueError, match="guidance_scale must be >= 1"):
        TinyDiTRunner(live_tiny_model, PROMPT, guidance_scale=guidance)
