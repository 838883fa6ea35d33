"""Requests through the engine API that earlier versions got wrong: a hit repeated, a candidate that cannot
continue the request, inputs of the wrong kind."""
import dataclasses

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe, resume
from carnator_engine.schedule import flow_sigmas
from carnator_engine.signature import EarlySignature
from carnator_engine.store import StoreError, TrajectoryPayload

SIGMAS = flow_sigmas(12)
PROMPT = "a red circle moving left"


def _noise(seed, nudge=0.0):
    return torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(seed)) * (1 + nudge)


def _config(**kwargs):
    return CarnatorConfig(probe_steps=2, block_size=64, **kwargs)


def test_a_candidate_whose_latent_shape_differs_is_a_full_generation_with_a_warning(live_tiny_model, store):
    first = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), SIGMAS, store, _config(), PROMPT, 1)
    record = store.record(first.entry_id)
    payload = store.trajectory(record)
    halved = {step: latent[..., ::2, ::2].contiguous() for step, latent in payload.checkpoints.items()}
    odd = store.put(bucket=record.bucket, prompt=PROMPT, seed=1, steps=12, probe_steps=2,
                    signature=store.signature(record), payload=TrajectoryPayload(halved, {}),
                    latent_shape=next(iter(halved.values())).shape)
    store.delete(first.entry_id)
    result = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1, nudge=1e-4), SIGMAS, store, _config(), PROMPT,
                      1)
    assert not result.decision.reuse and result.model_calls == 12
    assert any(odd in w and "shape" in w and "generated in full" in w for w in result.warnings)
    assert result.latent.shape == _noise(1).shape


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_noise_that_is_not_floating_point_is_refused_before_anything_runs(live_tiny_model, store, dtype):
    noise = _noise(1).to(dtype)
    with pytest.raises(ValueError, match=f"noise are a dtype {dtype}, not a floating-point tensor"):
        generate(TinyDiTRunner(live_tiny_model, PROMPT), noise, SIGMAS, store, _config())
    with pytest.raises(ValueError, match="not a floating-point tensor"):
        probe(TinyDiTRunner(live_tiny_model, PROMPT), noise, SIGMAS, _config())
    assert store.stats()["entries"] == 0


@pytest.mark.parametrize("parts, expected", [
    ((torch.ones(2, 3, 64), torch.ones(3, 4, 4), torch.ones(3, 4, 4)), "denoised has shape"),
    ((torch.ones(2, 3, 10), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "64 features"),
    ((torch.ones(2, 3, 64, dtype=torch.int64), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "hidden is a dtype"),
    (([1.0], torch.ones(3, 4, 4, 4), torch.ones(3, 4, 4)), "hidden is a list"),
    ((torch.ones(2, 3, 64), torch.ones(3, 4, 4, 4), torch.ones(3, 4, 5)), "not square"),
])
def test_a_malformed_signature_is_a_clear_error(parts, expected):
    with pytest.raises(ValueError, match=expected):
        EarlySignature(*parts)


def test_storing_something_that_is_not_a_signature_is_a_store_error(store):
    latent = torch.zeros(1, 1, 1, 1, 8).half()
    with pytest.raises(StoreError, match="not an Early Signature"):
        store.put(bucket="b", prompt="p", seed=0, steps=10, probe_steps=2, signature="not a signature",
                  payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape)


def _staged(model, store, nudge, limit=3, gate=None, resume_with=None):
    """One request through the staged nodes' engine calls, each stage's config the previous one's with its own
    settings (the Early Probe's with the store connected, the Lookup's limit, the Gate's, then the Resume's)."""
    runner, config = TinyDiTRunner(model, PROMPT), _config()
    probed = probe(runner, _noise(1, nudge), SIGMAS, config, store=store)
    config = dataclasses.replace(config, lookup_limit=limit)
    candidates = lookup(store, probed, config)
    config = dataclasses.replace(config, **(gate or {}))
    decision = decide(probed, candidates, config)
    config = dataclasses.replace(config, **(resume_with or {}))
    return resume(runner, probed, decision, store, config, PROMPT, 1)


OTHER_SETTINGS = {"gate risk": dict(gate=dict(risk="safe")),
                  "gate limit": dict(gate=dict(gate_overrides=dict(max_resume_fraction=0.2))),
                  "the same limits through overrides, and one more": dict(gate=dict(gate_overrides=dict(
                      refine_target=True, shrink_with_risk=True, max_hidden=0.03))),
                  "lookup limit": dict(limit=1),
                  "dense resume": dict(resume_with=dict(sparse_attention=False)),
                  "attention density": dict(resume_with=dict(max_density=0.5)),
                  "region-only": dict(resume_with=dict(region_only=True)),
                  "region share": dict(resume_with=dict(region_only=True, region_max_share=0.9))}


@pytest.mark.parametrize("settings", OTHER_SETTINGS.values(), ids=OTHER_SETTINGS.keys())
def test_a_staged_request_is_never_served_a_hit_made_with_other_reuse_settings(live_tiny_model, store, settings):
    """A hit stored by generate (default settings) is replayed for the same request through the staged chain only
    when every stage's settings are the same: the Early Probe knows none of the later stages' settings."""
    generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), SIGMAS, store, _config(), PROMPT, 1)
    hit = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1, 1e-4), SIGMAS, store, _config(), PROMPT, 1)
    assert hit.decision.reuse and not hit.decision.exact_repeat and hit.entry_id
    other = _staged(live_tiny_model, store, 1e-4, **settings)
    assert not other.decision.exact_repeat and other.model_calls > 2 and other.entry_id
    # the same settings in the other graph shape replay it: the key is the same in both
    config = dataclasses.replace(_config(lookup_limit=settings.get("limit", 3)), **settings.get("gate", {}),
                                 **settings.get("resume_with", {}))
    again = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1, 1e-4), SIGMAS, store, config, PROMPT, 1)
    assert again.decision.exact_repeat and again.decision.entry_id == other.entry_id and again.model_calls == 0
    assert torch.equal(again.latent, other.latent)


def test_a_hit_is_replayed_through_the_staged_chain_with_the_same_settings_at_its_resume(live_tiny_model, store):
    generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1), SIGMAS, store, _config(), PROMPT, 1)
    hit = generate(TinyDiTRunner(live_tiny_model, PROMPT), _noise(1, 1e-4), SIGMAS, store, _config(), PROMPT, 1)
    again = _staged(live_tiny_model, store, 1e-4, gate=dict(gate_overrides=dict(refine_target=True)))  # the preset's
    assert again.decision.exact_repeat and again.decision.entry_id == hit.entry_id
    assert again.model_calls == 2 and torch.equal(again.latent, hit.latent)   # the probe's calls, nothing more
    assert again.entry_id is None and len(store.records()) == 2


def _other(value):
    """A different valid value of a setting."""
    return (not value) if isinstance(value, bool) else "safe" if value == "balanced" else \
        value + 1 if isinstance(value, int) else value * 0.9


def test_every_setting_and_every_gate_limit_is_part_of_a_hits_replay_key():
    from carnator_engine.gate import GatePolicy
    from carnator_engine.pipeline import hit_replay_key
    base = CarnatorConfig()
    configs = [dataclasses.replace(base, **{f.name: _other(getattr(base, f.name))})
               for f in dataclasses.fields(CarnatorConfig) if f.name != "gate_overrides"]
    policy = base.policy()
    configs += [dataclasses.replace(base, gate_overrides={f.name: _other(getattr(policy, f.name))})
                for f in dataclasses.fields(GatePolicy)]
    keys = {hit_replay_key("k", config) for config in [base] + configs}
    assert len(keys) == 1 + len(configs)
    # the same limits, set through overrides equal to the preset's: the same key
    assert hit_replay_key("k", dataclasses.replace(base, gate_overrides=dataclasses.asdict(policy))) == \
        hit_replay_key("k", base)
