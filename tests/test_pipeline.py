import hashlib

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, checkpoint_steps, decide, generate, lookup, probe, resume
from carnator_engine.schedule import flow_sigmas
from carnator_engine.store import CarnatorStore
from store_damage import edit_meta, get_raw, set_raw

SIGMAS = flow_sigmas(12)


def _noise(seed):
    return torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(seed))


def _config(**kwargs):
    return CarnatorConfig(**{"probe_steps": 2, "block_size": 64, **kwargs})


def _run(model, store, prompt, seed, **kwargs):
    return generate(TinyDiTRunner(model, prompt), _noise(seed), SIGMAS, store, _config(**kwargs), prompt, seed)


def _through_the_gate(model, store, prompt, seed, nudge=0.0, **kwargs):
    """probe -> lookup -> gate -> resume, as the staged nodes run it. `nudge` scales the noise by 1 + nudge: a
    request a hair off the one with that seed, so it goes through the gate rather than being an exact repeat."""
    runner, config = TinyDiTRunner(model, prompt), _config(**kwargs)
    probed = probe(runner, _noise(seed) * (1 + nudge), SIGMAS, config)
    decision = decide(probed, lookup(store, probed, config), config)
    return resume(runner, probed, decision, store, config, prompt, seed)


def test_exact_repeat_replays_the_stored_result_with_no_model_call(live_tiny_model, store, monkeypatch):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    monkeypatch.setattr(TinyDiTRunner, "run", lambda *args: pytest.fail("an exact repeat ran the model"))
    again = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert again.decision.exact_repeat and again.decision.entry_id == first.entry_id
    assert again.model_calls == 0 == again.decision.model_calls and again.decision.expected_speedup is None
    assert torch.equal(again.latent, first.latent)  # kept at full precision: the request's own result
    assert again.entry_id is None and len(store.records()) == 1  # nothing new to store
    assert store.record(first.entry_id).hits == 1 and store.record(first.entry_id).steps_saved == 12


def test_exact_repeat_needs_every_input_to_match(live_tiny_model, store):
    _run(live_tiny_model, store, "a red circle moving left", 1)
    others = [_run(live_tiny_model, store, "a red circle moving left", 2),    # other noise
              _run(live_tiny_model, store, "a red circle moving right", 1),   # other prompt
              generate(TinyDiTRunner(live_tiny_model, "a red circle moving left", guidance_scale=2.0), _noise(1),
                       SIGMAS, store, _config(), "a red circle moving left", 1)]  # other sampler
    assert all(not r.decision.exact_repeat and r.model_calls > 0 for r in others)


def test_a_repeated_hit_is_replayed_exactly_for_the_same_reuse_settings_only(live_tiny_model, store):
    _run(live_tiny_model, store, "a red circle moving left", 1)
    hit = _through_the_gate(live_tiny_model, store, "a red circle moving left", 1, nudge=1e-4)
    assert hit.decision.reuse and not hit.decision.exact_repeat and hit.entry_id
    again = _through_the_gate(live_tiny_model, store, "a red circle moving left", 1, nudge=1e-4)
    assert again.decision.exact_repeat and again.decision.entry_id == hit.entry_id
    assert again.model_calls == 2 and torch.equal(again.latent, hit.latent)   # the probe's calls, nothing more
    assert again.entry_id is None and len(store.records()) == 2              # no duplicate entry
    other = _through_the_gate(live_tiny_model, store, "a red circle moving left", 1, nudge=1e-4, risk="safe")
    assert not other.decision.exact_repeat   # other reuse settings: through the gate again


def test_a_hit_repeated_through_generate_makes_no_model_call(live_tiny_model, store, monkeypatch):
    _run(live_tiny_model, store, "a red circle moving left", 1)
    runner = TinyDiTRunner(live_tiny_model, "a red circle moving left")
    hit = generate(runner, _noise(1) * (1 + 1e-4), SIGMAS, store, _config(), "a red circle moving left", 1)
    assert hit.decision.reuse and not hit.decision.exact_repeat and hit.entry_id
    monkeypatch.setattr(TinyDiTRunner, "run", lambda *args: pytest.fail("a repeated hit ran the model"))
    again = generate(runner, _noise(1) * (1 + 1e-4), SIGMAS, store, _config(), "a red circle moving left", 1)
    assert again.decision.exact_repeat and again.decision.entry_id == hit.entry_id and again.model_calls == 0
    assert torch.equal(again.latent, hit.latent) and again.entry_id is None and len(store.records()) == 2


def test_the_staged_path_answers_an_exact_repeat_after_its_probe(live_tiny_model, store):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    again = _through_the_gate(live_tiny_model, store, "a red circle moving left", 1)
    assert again.decision.exact_repeat and again.decision.entry_id == first.entry_id
    assert again.model_calls == 2 == again.decision.model_calls  # the probe's steps, nothing more
    assert torch.equal(again.latent, first.latent) and len(store.records()) == 1
    assert store.record(first.entry_id).steps_saved == 12 - 2


def test_a_staged_exact_repeat_whose_entry_is_gone_is_generated_in_full(live_tiny_model, store):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    runner, config = TinyDiTRunner(live_tiny_model, "a red circle moving left"), _config()
    probed = probe(runner, _noise(1), SIGMAS, config)
    decision = decide(probed, lookup(store, probed, config), config)
    assert decision.exact_repeat
    set_raw(store, first.entry_id, "blob", b"torn")  # between the gate and the resume
    result = resume(runner, probed, decision, store, config)
    assert not result.decision.reuse and result.model_calls == 12 and result.entry_id
    assert any("could not be replayed" in w for w in result.warnings)
    assert any(first.entry_id in w and "checksum" in w for w in result.warnings)
    torch.testing.assert_close(result.latent, first.latent, atol=1e-5, rtol=0)

    probed = probe(runner, _noise(1), SIGMAS, config)           # the same, its twin deleted meanwhile
    decision = decide(probed, lookup(store, probed, config), config)
    assert decision.exact_repeat and decision.entry_id == result.entry_id
    store.delete(result.entry_id)
    again = resume(runner, probed, decision, store, config)
    assert not again.decision.reuse and again.model_calls == 12


def test_a_corrupt_final_latent_is_reported_and_the_request_generated(live_tiny_model, store):
    from safetensors.torch import load, save
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    record = store.record(first.entry_id)
    tensors = load(get_raw(store, first.entry_id, "blob"))
    tensors["final"] = tensors["final"][..., :-1].contiguous()  # a wrong shape under a valid checksum
    blob = save(tensors)
    set_raw(store, first.entry_id, "blob", blob)
    edit_meta(store, first.entry_id, lambda meta: meta.update(blob_sha256=hashlib.sha256(blob).hexdigest()))
    result = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert not result.decision.reuse and result.model_calls == 12
    assert any(record.entry_id in w and "final latent has shape" in w for w in result.warnings)
    torch.testing.assert_close(result.latent, first.latent, atol=1e-5, rtol=0)


def test_miss_then_hit_saves_model_calls(live_tiny_model, store):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert not first.decision.reuse and first.model_calls == 12 and first.entry_id
    second = _through_the_gate(live_tiny_model, store, "a red circle moving left", 1, nudge=1e-4)
    assert second.decision.reuse and second.decision.entry_id == first.entry_id
    assert second.decision.resume_step > 2
    assert second.model_calls == 2 + 12 - second.decision.resume_step < 12
    # Identical request: resuming from its own trajectory reproduces it.
    torch.testing.assert_close(second.latent, first.latent, atol=2e-2, rtol=0)
    assert store.record(first.entry_id).hits == 1
    assert second.entry_id and len(store.records()) == 2  # the hit is written back too (entry_id waits for it)


def test_hit_with_a_target_region_spends_one_call_re_estimating_it(live_tiny_model, store, monkeypatch):
    loose = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, cell_threshold=0.05, max_target_fraction=1.0,
                 max_resume_fraction=0.9, refine_target=True)
    _run(live_tiny_model, store, "a red circle moving left", 1, gate_overrides=loose)
    runs = []
    original = TinyDiTRunner.run

    def counting_run(self, x, sigmas, start, end, observer):
        runs.append((start, end))
        return original(self, x, sigmas, start, end, observer)

    monkeypatch.setattr(TinyDiTRunner, "run", counting_run)
    hit = _run(live_tiny_model, store, "a red circle moving left", 2, gate_overrides=loose)  # other noise
    decision = hit.decision
    assert decision.reuse and decision.target_cells.any() and decision.refine_step is not None
    m, k = decision.refine_step, decision.resume_step
    assert 2 < m < k
    assert runs == [(0, 2), (m, m + 1), (k, 12)]            # probe, the refine call, the rest
    assert hit.model_calls == 2 + 1 + 12 - k == decision.model_calls


def test_hit_survives_reopening_the_store(live_tiny_model, tmp_path):
    directory = str(tmp_path / "cache")
    first_store = CarnatorStore(directory, 64 << 20)
    _run(live_tiny_model, first_store, "a red circle moving left", 1)
    first_store.close()
    reopened = CarnatorStore(directory, 64 << 20)
    assert _run(live_tiny_model, reopened, "a red circle moving left", 1).decision.reuse


def test_another_model_never_matches(live_tiny_model, store):
    from carnator_engine.backbones.tiny_dit import TinyVideoDiT
    _run(live_tiny_model, store, "a red circle moving left", 1)
    other = TinyVideoDiT(live_tiny_model.config)
    other.load_state_dict(live_tiny_model.state_dict())
    with torch.no_grad():
        other.head.bias.add_(0.01)  # a fine-tune, a LoRA merge: other weights
    result = _run(other, store, "a red circle moving left", 1)
    assert not result.decision.reuse
    assert "no earlier generation" in result.decision.reasons[0]
    assert result.decision.reasons[1].endswith("differs in model/patches (weights, LoRAs or their strengths)")


def test_a_miss_for_want_of_a_bucket_says_which_part_differs(live_tiny_model, store):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert first.decision.reasons[1:] == ["the cache holds no generation yet"]
    assert store.record(first.entry_id).extra["model"] == TinyDiTRunner(live_tiny_model, "").model_fingerprint[:12]
    nearest = f"the nearest cached generation, entry {first.entry_id}, differs in "
    fewer = generate(TinyDiTRunner(live_tiny_model, "a red circle moving left"), _noise(1), flow_sigmas(10), store,
                     _config(), "a red circle moving left", 1)
    assert fewer.decision.reasons[1] == nearest + "steps (10 here, 12 there)"
    guided = generate(TinyDiTRunner(live_tiny_model, "a red circle moving left", guidance_scale=3.0), _noise(1), SIGMAS,
                      store, _config(), "a red circle moving left", 1)
    assert guided.decision.reasons[1].endswith("differs in cfg/guidance (cfg=3 here, cfg=1 there)")


def test_a_miss_among_entries_probed_for_another_number_of_steps_names_the_probe_length(live_tiny_model, store):
    """Entries of the request's model, shape and schedule probed 2 steps, a request probed 3: the miss says so, not
    that no earlier generation of this model is in the cache."""
    _run(live_tiny_model, store, "a red circle moving left", 1)
    longer = _run(live_tiny_model, store, "a red circle moving right", 1, probe_steps=3)
    assert not longer.decision.reuse
    assert longer.decision.reasons == [
        "the cache holds generations of this model, shape and schedule probed for 2 steps, this request for 3: "
        "probes of different lengths cannot be compared (set probe steps to 2 to reuse them)"]


def test_full_connectivity_resume_equals_dense_resume(live_tiny_model, tmp_path):
    runs = {}
    for sparse in (True, False):
        s = CarnatorStore(str(tmp_path / f"c{sparse}"), 64 << 20)
        _run(live_tiny_model, s, "a blue square moving up", 3, attention_mass=1.0)
        runs[sparse] = _through_the_gate(live_tiny_model, s, "a blue square moving up", 3, nudge=1e-4,
                                         attention_mass=1.0, sparse_attention=sparse)
        assert runs[sparse].decision.reuse and not runs[sparse].decision.exact_repeat
    torch.testing.assert_close(runs[True].latent, runs[False].latent, atol=1e-5, rtol=1e-5)


def test_corrupt_entry_falls_back_to_a_full_generation(live_tiny_model, store):
    first = _run(live_tiny_model, store, "a red circle moving left", 1)
    set_raw(store, first.entry_id, "sig", b"garbage")
    result = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert not result.decision.reuse and result.model_calls == 12
    assert any(first.entry_id in warning and "corrupt" in warning for warning in result.warnings)
    torch.testing.assert_close(result.latent, first.latent, atol=1e-5, rtol=0)


def test_wrong_latent_shapes_are_refused(live_tiny_model):
    runner = TinyDiTRunner(live_tiny_model, "a red circle")
    with pytest.raises(ValueError, match="video latent"):
        probe(runner, torch.randn(1, 3, 32, 32), SIGMAS, _config())
    with pytest.raises(ValueError, match="latent channels"):
        probe(runner, torch.randn(1, 16, 8, 32, 32), SIGMAS, _config())


def test_probe_longer_than_the_generation_is_refused(live_tiny_model):
    with pytest.raises(ValueError, match="probe_steps"):
        probe(TinyDiTRunner(live_tiny_model, "a"), _noise(0), SIGMAS, CarnatorConfig(probe_steps=12))


def test_checkpoints_cover_every_reachable_resume_step():
    assert checkpoint_steps(20, 3, 20) == list(range(4, 14))
    thinned = checkpoint_steps(50, 5, 8)
    assert len(thinned) == 8 and thinned[-1] == 32 and thinned[0] > 5


# ---- store faults degrade to a full generation (issue 16) ----------------------------------------

def _gate_hit(model, store):
    """A request a hair off an earlier one, probed and gated to a hit (not an exact repeat) on that entry."""
    first = _run(model, store, "a red circle moving left", 1)
    runner, config = TinyDiTRunner(model, "a red circle moving left"), _config()
    probed = probe(runner, _noise(1) * 1.0001, SIGMAS, config)
    decision = decide(probed, lookup(store, probed, config), config)
    assert decision.reuse and not decision.exact_repeat and decision.entry_id == first.entry_id
    full = generate(runner, _noise(1) * 1.0001, SIGMAS, CarnatorStore(store.location + "-empty", 64 << 20), config)
    return first, runner, probed, decision, config, full


@pytest.mark.parametrize("fault", ["corrupt blob", "missing blob", "evicted"])
def test_a_hit_whose_entry_fails_between_gate_and_resume_is_generated_in_full(live_tiny_model, store, fault):
    first, runner, probed, decision, config, full = _gate_hit(live_tiny_model, store)
    if fault == "corrupt blob":
        set_raw(store, first.entry_id, "blob", b"torn")
    elif fault == "missing blob":
        from store_damage import drop_raw
        drop_raw(store, first.entry_id, "blob")
    else:
        CarnatorStore(store.location, 64 << 20).delete(first.entry_id)   # another worker evicts it
    result = resume(runner, probed, decision, store, config)
    assert not result.decision.reuse and result.model_calls == 12 and result.entry_id
    assert any(first.entry_id in w and "generated in full" in w for w in result.warnings)
    torch.testing.assert_close(result.latent, full.latent, atol=1e-5, rtol=0)


def test_a_full_disk_returns_the_result_and_warns_on_the_next_request(live_tiny_model, store, monkeypatch):
    """The write runs after the result is out (write_back): its failure is the next request's warning."""
    import errno

    from carnator_engine.store.backends.disk import DiskBackend

    def full_disk(self, entry_id, blob):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DiskBackend, "_write_blob", full_disk)
    result = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert result.model_calls == 12 and torch.isfinite(result.latent).all() and result.storing.entry_id
    assert result.entry_id is None       # waits for the write: it failed
    assert result.summary()["stored_as"] is None      # so no summary made now claims it was stored
    assert store.stats()["entries"] == 0 and store.records(include_corrupt=True) == []
    monkeypatch.undo()
    following = _run(live_tiny_model, store, "a blue square moving up", 2)
    assert any("not stored" in w and result.storing.entry_id in w and store.location in w
               and "disk is full" in w for w in following.warnings)
    assert following.entry_id and store.record(following.entry_id).prompt == "a blue square moving up"


def test_a_store_that_fails_every_read_costs_the_reuse_not_the_result(live_tiny_model, store, monkeypatch):
    from carnator_engine.store import StoreError
    first = _run(live_tiny_model, store, "a red circle moving left", 1)

    def unreachable(*args, **kwargs):
        raise StoreError("Carnator cache 'x' could not read an entry: the server cannot be reached")
    for name in ("meta", "part", "changes"):
        monkeypatch.setattr(store._backend, name, unreachable)
    result = _run(live_tiny_model, store, "a red circle moving left", 1)
    assert not result.decision.reuse and result.model_calls == 12
    assert any("generated in full" in w and "cannot be reached" in w for w in result.warnings)
    torch.testing.assert_close(result.latent, first.latent, atol=1e-5, rtol=0)


def test_non_finite_sigmas_or_noise_are_refused_before_anything_runs(live_tiny_model, store):
    broken = SIGMAS.clone()
    broken[3] = float("nan")
    with pytest.raises(ValueError, match="sigmas hold non-finite"):
        _ = generate(TinyDiTRunner(live_tiny_model, "a red circle"), _noise(1), broken, store, _config())
    noise = _noise(1)
    noise[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="noise hold non-finite"):
        probe(TinyDiTRunner(live_tiny_model, "a red circle"), noise, SIGMAS, _config())
    assert store.stats()["entries"] == 0
