"""Region-only resume on the tiny DiT: the target tokens alone through the blocks, the whole clip in their attention,
the same result as whole-clip resume when the target is the whole clip, and each fallback with its reason."""
import dataclasses

import pytest
import torch

from carnator_engine import resume as resume_stage
from carnator_engine.euler import TinyDiTRunner
from carnator_engine.localize import latent_mask
from carnator_engine.observer import GenerationObserver
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe, resume
from carnator_engine.region import RegionTokens, latent_mask_of_tokens, target_tokens
from carnator_engine.schedule import flow_sigmas

STEPS = 12
SIGMAS = flow_sigmas(STEPS)
# a gate loose enough that another seed of the same prompt is a hit
LOOSE = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, max_context_share=10.0, cell_threshold=0.05,
             max_target_fraction=1.0, max_resume_fraction=0.9, refine_target=True, shrink_with_risk=False)
PROMPT = "a red circle moving left"


def _noise(seed):
    return torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(seed))


def _config(**kwargs):
    return CarnatorConfig(probe_steps=2, block_size=64, gate_overrides=dict(LOOSE), **kwargs)


def _hit(model, store, seed=2, guidance=1.0, **kwargs):
    """A first request (seed 1) generated and stored, then `seed` through the staged path."""
    generate(TinyDiTRunner(model, PROMPT, guidance), _noise(1), SIGMAS, store, _config(), PROMPT, 1)
    runner, config = TinyDiTRunner(model, PROMPT, guidance), _config(**kwargs)
    probed = probe(runner, _noise(seed), SIGMAS, config)
    decision = decide(probed, lookup(store, probed, config), config)
    assert decision.reuse and decision.refine_step is not None
    cells = torch.zeros_like(decision.target_cells)   # the random-weight model marks every cell: a corner instead
    cells[:, : max(1, cells.shape[1] // 4), : max(1, cells.shape[2] // 4)] = True
    return runner, probed, dataclasses.replace(decision, target_cells=cells, cell_map=cells.float()), config


def _region_cells(decision, config, fhw=(8, 32, 32)):
    """The latent cells a region-only resume computes: the gate's target and the cells holding most of the
    difference."""
    from carnator_engine.localize import region_cells
    return latent_mask(decision.target_cells, fhw) | latent_mask(region_cells(decision.cell_map,
                                                                              config.region_target_mass), fhw)


def _early(decision, step=4):
    """The decision resumed at an earlier stored checkpoint: more resumed steps, room for refreshes."""
    return dataclasses.replace(decision, resume_step=step, refine_step=None)


def _block_rows(model):
    """Rows (tokens) the first block receives, per forward."""
    rows = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: rows.append(int(args[0].shape[1])))
    return rows, handle


def test_region_only_equals_whole_clip_resume_when_the_target_is_the_whole_clip(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store)
    decision = dataclasses.replace(decision, target_cells=torch.ones_like(decision.target_cells))
    payload = store.trajectory(store.record(decision.entry_id))
    whole = resume_stage.follow_entry(runner, probed, decision, payload, config, GenerationObserver())
    tokens = torch.ones(runner.layout.token_grid(probed.latent.shape), dtype=torch.bool).flatten()
    region = RegionTokens(tokens, frozenset({decision.resume_step}))
    regional = resume_stage.follow_entry(runner, probed, decision, payload, config, GenerationObserver(), region)
    assert torch.equal(regional, whole)
    assert region.tokens_through_blocks == tokens.numel() * (STEPS - decision.resume_step)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_only_the_target_tokens_go_through_the_blocks_and_attend_to_the_whole_clip(live_tiny_model, store, monkeypatch,
                                                                                   guidance):
    runner, probed, decision, config = _hit(live_tiny_model, store, guidance=guidance, region_only=True,
                                            region_max_share=1.0, region_refresh_steps=0)
    seen = []
    original = RegionTokens.attention_inputs

    def attention_inputs(self, block, q, k, v):
        k2, v2 = original(self, block, q, k, v)
        seen.append((self.active, int(q.shape[0]), int(q.shape[2]), int(k2.shape[2])))
        return k2, v2
    monkeypatch.setattr(RegionTokens, "attention_inputs", attention_inputs)
    rows, handle = _block_rows(live_tiny_model)
    try:
        result = resume(runner, probed, decision, GenerationStoreView(store), config, PROMPT, 2)
    finally:
        handle.remove()
    d = result.decision
    assert d.reuse and d.numbers["region_only"] and any("region-only resume, expected" in r for r in d.reasons)
    length = 8 * 8 * 8
    target = target_tokens(runner.layout, _region_cells(d, config), resume_stage.REGION_HALO)
    kept = int(target.sum())
    assert 0 < kept < length and d.numbers["region_share"] == pytest.approx(kept / length, abs=1e-4)
    k, m = d.resume_step, d.refine_step
    region_steps = STEPS - k - 1          # step k captures the other tokens' keys; every later step is the target's
    assert rows == [length] * (m is not None) + [length] + [kept] * region_steps
    batch = 2 if guidance != 1.0 else 1
    region_attention = [s for s in seen if s[0]]
    assert len(region_attention) == region_steps * len(live_tiny_model.blocks)
    assert all(s == (True, batch, kept, length) for s in region_attention)     # target queries, every key
    assert result.model_calls == probed.model_calls + (m is not None) + STEPS - k and not result.warnings
    assert torch.isfinite(result.latent).all()
    assert torch.equal(store.trajectory(store.record(result.entry_id)).final, result.latent.cpu())


@pytest.mark.parametrize("refresh", [0, 2])
def test_outside_the_region_a_hit_ends_as_the_cached_generation(live_tiny_model, store, refresh):
    """Every token a region-only hit does not compute is the cached generation's final latent, exactly; its region
    (halo included) is what the request computed, never the cached latent."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0,
                                            region_refresh_steps=refresh)
    payload = store.trajectory(store.record(decision.entry_id))
    planned, region, _ = resume_stage.plan_region(runner, probed, _early(decision), payload, config)
    assert region is not None and len(region.others)
    out = resume_stage.follow_entry(runner, probed, planned, payload, config, GenerationObserver(), region)
    inside = latent_mask_of_tokens(runner.layout, region.target, out.shape[-3:])
    final = payload.final.to(out.dtype)
    assert torch.equal(out[..., ~inside], final[..., ~inside])
    assert not torch.allclose(out[..., inside], final[..., inside])
    assert region.region_steps_run == STEPS - planned.resume_step - len(region.full_steps) > 0


def test_a_region_only_hits_refreshes_run_every_token_from_the_cached_trajectory(live_tiny_model, store,
                                                                                monkeypatch):
    """region_refresh_steps: full steps at the cached entry's checkpoints after the resume step, evenly spread, each
    entered with the cached checkpoint of that step outside the region: the other tokens' keys and values come from
    a state the cached generation passed through."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0,
                                            region_refresh_steps=2)
    payload = store.trajectory(store.record(decision.entry_id))
    planned, region, _ = resume_stage.plan_region(runner, probed, _early(decision), payload, config)
    k = planned.resume_step
    refreshes = sorted(region.full_steps - {k})
    assert len(refreshes) == 2 and all(k < s < STEPS - 1 and s in payload.checkpoints for s in refreshes)
    entered = {}
    original = TinyDiTRunner.run
    monkeypatch.setattr(TinyDiTRunner, "run", lambda self, x, sigmas, start, end, observer: (
        entered.setdefault(start, x.clone()), original(self, x, sigmas, start, end, observer))[1])
    resume_stage.follow_entry(runner, probed, planned, payload, config, GenerationObserver(), region)
    outside = ~latent_mask_of_tokens(runner.layout, region.target, probed.latent.shape[-3:])
    for step in refreshes:
        cached = payload.checkpoints[step].to(entered[step].dtype)
        assert torch.equal(entered[step][..., outside], cached[..., outside])


def test_a_region_only_hits_checkpoints_are_the_cached_ones_outside_its_region(live_tiny_model, store):
    """Outside the target, the sampler's latent in a region step is not the clip: the new entry's checkpoint of such
    a step is the cached entry's outside the region (a step the cached entry kept none of is not kept)."""
    from carnator_engine.observer import CheckpointRecorder
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    payload = store.trajectory(store.record(decision.entry_id))
    decision, region, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    assert region is not None
    observer = GenerationObserver(checkpoints=CheckpointRecorder(frozenset(range(decision.resume_step + 1, STEPS))))
    resume_stage.follow_entry(runner, probed, decision, payload, config, observer, region)
    kept = observer.checkpoints.latents
    later = {s for s in payload.checkpoints if s > decision.resume_step}
    assert set(kept) == later
    outside = ~latent_mask_of_tokens(runner.layout, region.target, probed.latent.shape[-3:])
    for step, latent in kept.items():
        assert torch.equal(latent[..., outside], payload.checkpoints[step].to(latent.dtype)[..., outside])


class GenerationStoreView:
    """The store, as the resume stage reads it (a thin pass-through so a test can swap one method)."""

    def __init__(self, store, trajectory=None):
        self._store, self._trajectory = store, trajectory

    def __getattr__(self, name):
        return getattr(self._store, name)

    def trajectory(self, record):
        payload = self._store.trajectory(record)
        return self._trajectory(payload) if self._trajectory else payload


@pytest.mark.parametrize("damage, why", [
    (lambda p: dataclasses.replace(p, final=None), "holds no final latent"),
    (lambda p: dataclasses.replace(p, final=p.final[:, :, :4]), "holds a final latent of shape"),
])
def test_an_entry_without_a_usable_final_latent_resumes_whole_clip_with_a_warning(live_tiny_model, store, damage, why):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    result = resume(runner, probed, decision, GenerationStoreView(store, damage), config, PROMPT, 2)
    assert result.decision.reuse and not result.decision.numbers.get("region_only")
    assert any(why in r and "whole-clip resume" in r for r in result.decision.reasons)
    assert any(why in w for w in result.warnings)
    assert result.model_calls == probed.model_calls + (result.decision.refine_step is not None) + \
        STEPS - result.decision.resume_step


def test_a_target_over_the_limit_resumes_whole_clip_with_the_reason(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=0.01)
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert result.decision.reuse and result.decision.numbers["region_only"] is False
    assert any("over the region-only limit of 1%: whole-clip resume" in r for r in result.decision.reasons)
    assert not result.warnings


def test_region_only_that_would_save_too_little_resumes_whole_clip(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0,
                                            region_refresh_steps=16)
    decision = dataclasses.replace(decision, target_cells=torch.ones_like(decision.target_cells))
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert result.decision.reuse and result.decision.numbers["region_only"] is False
    assert any("region-only saves under 10 % here, whole-clip resume" in r for r in result.decision.reasons)


def test_a_region_only_hit_whose_entry_is_gone_is_a_full_generation(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    store.delete(decision.entry_id)
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert not result.decision.reuse and result.model_calls == STEPS
    assert any("could not be read" in r for r in result.decision.reasons)


def test_region_settings_are_validated_with_the_fix():
    with pytest.raises(ValueError, match=r"region_max_share=0 must be in \(0, 1\]"):
        CarnatorConfig(region_max_share=0).validate(10)
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match=f"region_refresh_steps={bad!r} must be a whole number from 0 to 16"):
            CarnatorConfig(region_refresh_steps=bad).validate(10)
    with pytest.raises(ValueError, match="region_only must be True or False"):
        CarnatorConfig(region_only="yes").validate(10)
    with pytest.raises(ValueError, match="region_fa4 must be True or False"):
        CarnatorConfig(region_fa4=1).validate(10)


def test_region_fa4_reaches_the_region_steps_on_by_default(live_tiny_model, store):
    """CarnatorConfig.region_fa4 (on since measured faster on a GPU; off asks for the host's kernel) is handed to
    the region's attention."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_max_share=1.0)
    payload = store.trajectory(store.record(decision.entry_id))
    for setting, expected in (({}, True), ({"region_fa4": False}, False)):
        _, region, _ = resume_stage.plan_region(runner, probed, decision, payload,
                                                dataclasses.replace(config, **setting))
        assert region is not None and region.fa4 is expected


def test_block_arguments_are_cut_along_their_token_axis_and_put_back():
    target = torch.zeros(12, dtype=torch.bool)
    target[[1, 5, 7]] = True
    region = RegionTokens(target, frozenset({0}))
    region.begin_step(0)
    region.forward()
    captured = torch.arange(12.0).reshape(1, 1, 12, 1).expand(1, 2, 12, 4)
    region.attention_inputs(0, captured, captured, captured)     # the full step keeps the other 9 tokens' rows
    region.begin_step(1)
    assert region.active and region.video_tokens() == 3
    region.forward()
    hidden = torch.arange(12.0).reshape(1, 12, 1).repeat(1, 1, 2)
    cut = region.gather(hidden, text_tokens=4)
    assert cut[0, :, 0].tolist() == [1, 5, 7]
    rope = torch.arange(12.0).reshape(1, 12, 1, 1)                 # token axis 1 (Wan's freqs)
    joint_mask = torch.arange(16.0).reshape(1, 1, 16)              # video then text on axis 2 (HunyuanVideo)
    per_batch = torch.ones(1, 1, 6, 8)                             # no token axis: unchanged
    assert region.gather_like(rope).flatten().tolist() == [1, 5, 7]
    assert region.gather_like(joint_mask).flatten().tolist() == [1, 5, 7, 12, 13, 14, 15]
    assert region.gather_like(per_batch) is per_batch
    joint = torch.cat([cut, torch.full((1, 4, 2), -1.0)], dim=1)
    back = region.scatter(joint)
    assert back.shape == (1, 16, 2) and back[0, [1, 5, 7], 0].tolist() == [1, 5, 7]
    assert back[0, 0].abs().sum() == 0 and back[0, 12:, 0].tolist() == [-1.0] * 4
    for step in (1, 2):                                            # the target's rows rewritten in place each step
        q = torch.full((1, 2, 3, 4), -float(step))
        k, v = region.attention_inputs(0, q, q, q)
        assert k.shape[2] == 12 and k[0, 0, :, 0].tolist() == [0, -step, 2, 3, 4, -step, 6, -step, 8, 9, 10, 11]
    k, _ = region.attention_inputs(1, q, q, q)                     # a block nothing was captured for
    assert k.shape[2] == 3 and "no keys and values" in region.missing


def test_the_low_noise_experts_first_step_is_a_full_step():
    class TwoExperts:
        switch_step = 9
    decision = type("D", (), {"resume_step": 6, "steps": 12})()
    config = CarnatorConfig(region_refresh_steps=0)
    assert resume_stage._full_steps(TwoExperts(), decision, config, None) == {6, 9}
    assert resume_stage._full_steps(object(), decision, config, None) == {6}
    stored = type("P", (), {"checkpoints": {s: None for s in (3, 6, 8, 10, 11)}})()
    assert resume_stage._full_steps(object(), decision, CarnatorConfig(region_refresh_steps=1), stored) == {6, 8}
    assert resume_stage._full_steps(object(), decision, CarnatorConfig(region_refresh_steps=3), stored) == {6, 8, 10}


def test_token_masks_map_back_to_the_latent_cells_they_carry(live_tiny_model):
    layout = live_tiny_model.layout
    mask = torch.zeros(8, 32, 32, dtype=torch.bool)
    mask[3, 9, 9] = True
    tokens = target_tokens(layout, mask, (0, 0, 0))
    assert tokens.sum() == 1
    back = latent_mask_of_tokens(layout, tokens, (8, 32, 32))
    assert back.sum() == 16 and back[3, 8:12, 8:12].all()
    assert target_tokens(layout, mask, (1, 1, 1)).sum() == 27


def test_a_hit_on_a_local_change_resumes_whole_clip_by_default(live_tiny_model, store):
    """Region-only is off until its result is shown within 3 dB of a whole-clip hit's (docs/region-resume.md)."""
    runner, probed, decision, _ = _hit(live_tiny_model, store)                   # a corner of the clip changed
    result = resume(runner, probed, decision, store, _config(), PROMPT, 2)  # every reuse setting at its default
    assert result.decision.reuse and "region_only" not in result.decision.numbers and not result.decision.region


def test_the_region_setting_is_part_of_a_hits_replay_key():
    from carnator_engine.pipeline import hit_replay_key
    assert hit_replay_key("k", CarnatorConfig()) != hit_replay_key("k", CarnatorConfig(region_only=True))
    assert hit_replay_key("k", CarnatorConfig(region_only=True)) != \
        hit_replay_key("k", CarnatorConfig(region_only=True, region_refresh_steps=0))


def test_a_hit_with_no_target_tokens_resumes_whole_clip(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    decision = dataclasses.replace(decision, target_cells=torch.zeros_like(decision.target_cells), refine_step=None,
                                   cell_map=torch.zeros_like(decision.cell_map))
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert result.decision.reuse and result.decision.numbers["region_only"] is False
    assert any("no target tokens" in r and "whole-clip resume" in r for r in result.decision.reasons)


def test_a_step_cache_starts_afresh_after_the_region_steps(live_tiny_model, store, monkeypatch):
    """EasyCache's state after region steps holds changes of the target tokens alone: the full steps after them must
    not skip with it (ComfyRunner.fresh_step_cache drops the state carried from run to run)."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    events = []
    original = TinyDiTRunner.run
    monkeypatch.setattr(TinyDiTRunner, "run", lambda self, x, sigmas, start, end, observer: (
        events.append(("run", start, observer.region is not None)), original(self, x, sigmas, start, end, observer))[1])
    runner.fresh_step_cache = lambda: events.append(("fresh",))
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert result.decision.numbers["region_only"]
    runs = [event for event in events if event[0] == "run"]
    assert runs[-1][2] and events[-1] == ("fresh",)      # after the region steps, before anything else runs


def test_the_region_target_holds_most_of_the_difference_whatever_the_models_scale():
    from carnator_engine.localize import region_cells
    spot = torch.full((4, 8, 8), 0.1)
    spot[1:3, 5:7, 5:7] = 1.0                                    # one region differs, the rest a little
    cells = region_cells(spot, mass=0.7)
    assert cells[1:3, 5:7, 5:7].all() and 0 < cells.float().mean() < 0.5     # that region and its one-cell ring
    assert torch.equal(region_cells(spot * 0.01, 0.7), cells)             # a model of another scale: the same
    even = torch.full((4, 8, 8), 0.115)                           # spread evenly: most of the clip, not all of it
    assert 0.5 < region_cells(even, 0.7, dilation=0).float().mean() < 0.75
    assert not region_cells(spot, 0.0).any() and not region_cells(torch.zeros(4, 8, 8), 0.7).any()
    with pytest.raises(ValueError, match=r"region_target_mass=1.5 must be in \[0, 1\]"):
        CarnatorConfig(region_target_mass=1.5).validate(10)


def test_the_region_joins_the_gates_cells_and_the_difference_on_any_grid(live_tiny_model, store):
    """The gate's target may come over the latent itself (a benchmark forces one) while the difference is on the
    signature's coarse grid: the region joins them over the latent."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    payload = store.trajectory(store.record(decision.entry_id))
    fhw = tuple(probed.latent.shape[-3:])
    corner = torch.zeros(fhw, dtype=torch.bool)                   # over the latent: (8, 32, 32)
    corner[:, :4, :4] = True
    spot = torch.zeros(decision.cell_map.shape)                    # on the coarse grid: the other corner
    spot[:, -1, -1] = 1.0
    assert corner.shape != spot.shape
    planned, region, _ = resume_stage.plan_region(
        runner, probed, dataclasses.replace(decision, target_cells=corner, cell_map=spot), payload, config)
    assert region is not None and torch.equal(planned.target_cells, corner)    # the start state: the gate's cells
    computed = latent_mask_of_tokens(runner.layout, region.target, fhw)
    assert computed[:, :4, :4].all() and computed[:, -1, -1].all()
    assert not computed[:, 12:20, 12:20].any()


def test_the_node_says_how_a_hit_resumed_and_what_it_expects(live_tiny_model, store):
    """'HIT ..., region-only on X% of the clip, ... expected Y x' with the region-only estimate, or why the whole clip
    was resumed; the whole-clip estimate only when the whole clip ran."""
    from nodes.inputs import summary_text
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    summary = result.decision.summary()
    share, expected = result.decision.numbers["region_share"], result.decision.numbers["region_expected_speedup"]
    assert summary["region"] == f"region-only on {share:.0%} of the clip"
    assert summary["expected_speedup"] == expected > STEPS / result.decision.model_calls
    text = summary_text(summary)
    whole = round(STEPS / result.decision.model_calls, 3)
    assert f"; region-only on {share:.0%} of the clip; " in text
    assert text.endswith(f"expected {expected}x region-only (whole-clip: {whole}x)")
    over = resume(runner, probed, decision, store, dataclasses.replace(config, region_max_share=0.01), PROMPT, 2)
    summary = over.decision.summary()
    assert summary["region"] == f"whole clip: the change covers {share:.0%} of it, over the region-only limit of 1%"
    assert summary["expected_speedup"] == round(STEPS / over.decision.model_calls, 3)
    assert "; whole clip: the change covers" in summary_text(summary)
    assert resume(runner, probed, decision, store, _config(region_only=False), PROMPT, 2
                  ).decision.summary()["region"] == ""           # off: no region line at all


def test_a_gate_that_may_resume_further_never_resumes_at_a_refresh_checkpoint(live_tiny_model, store):
    """An entry keeps checkpoints after the furthest step any preset resumes at, for region-only refreshes; a gate
    whose overrides reach further (LOOSE: 90 % of the schedule) still resumes at a checkpoint a preset could."""
    from carnator_engine.gate import latest_resume_checkpoint
    from carnator_engine.pipeline import checkpoint_steps
    runner, probed, decision, _ = _hit(live_tiny_model, store)
    kept = store.record(decision.entry_id).checkpoint_steps
    assert kept == checkpoint_steps(STEPS, 2, CarnatorConfig().max_checkpoints)
    assert any(s > latest_resume_checkpoint(STEPS) for s in kept)
    assert decision.resume_step == latest_resume_checkpoint(STEPS) < int(0.9 * STEPS)


def test_after_a_fallback_in_a_later_segment_the_checkpoints_before_it_are_the_cached_ones_outside(
        live_tiny_model, store, monkeypatch):
    """The kept keys' plan fails at a refresh's segment: the region steps before it left the sampler's latent
    outside the region uncomputed, so the checkpoints they lead into are the cached ones there; from the fallback on
    every token is computed and kept as recorded."""
    from carnator_engine.gate import RegionFallback
    from carnator_engine.kept_kv import KeptKeysValues
    from carnator_engine.observer import CheckpointRecorder
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0,
                                            region_refresh_steps=1)
    payload = store.trajectory(store.record(decision.entry_id))
    planned, region, _ = resume_stage.plan_region(runner, probed, _early(decision), payload, config)
    k, refresh = planned.resume_step, max(region.full_steps)
    assert refresh > k + 1
    original, plans = KeptKeysValues.plan, []

    def plan(self, share):
        plans.append(share)
        return RegionFallback("no room", "no room: whole-clip resume") if len(plans) == 2 else original(self, share)
    monkeypatch.setattr(KeptKeysValues, "plan", plan)
    observer = GenerationObserver(checkpoints=CheckpointRecorder(frozenset(range(k + 1, STEPS))))
    resume_stage.follow_entry(runner, probed, planned, payload, config, observer, region)
    assert region.fallback and max(region.cut_steps) == refresh - 1
    kept = observer.checkpoints.latents
    outside = ~latent_mask_of_tokens(runner.layout, region.target, probed.latent.shape[-3:])
    for step in range(k + 2, refresh + 1):          # entered after a region step
        if step in kept:
            assert torch.equal(kept[step][..., outside], payload.checkpoints[step].to(kept[step].dtype)[..., outside])
    assert sorted(s for s in kept if s > refresh) == list(range(refresh + 1, STEPS))   # kept as recorded
