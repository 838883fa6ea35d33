"""Four steps at cfg 1 through the real host, as step-distilled LoRAs run: a LoRA loaded by LoraLoaderModelOnly, the
Carnator Sampler with its automatic one-step probe, Wan 2.2 A14B's experts at 2+2 steps, and the bad inputs of such
schedules refused by the node with nothing stored."""
from __future__ import annotations

import json

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import node, nudged, open_cache, sample, sampler_output, store_state
from test_two_experts import experts, two_expert_sample  # noqa: F401  (experts: the pair's fixture)

STEPS, CFG, AUTO_PROBE, SEED = 4, 1.0, 0, 42


def with_lora(comfy, host_dirs, model, strength):
    name = hostsetup.build_tiny_lora(str(host_dirs["root"] / "loras"))
    return node(comfy, "LoraLoaderModelOnly").load_lora_model_only(model, name, strength)[0]


def four_steps(comfy, model, cache, positive, negative, latent, **kwargs):
    kwargs = {"steps": STEPS, "cfg": CFG, "probe_steps": AUTO_PROBE, "seed": SEED, **kwargs}
    return sample(comfy, model, cache, positive, negative, latent, **kwargs)


def shown(comfy, model, cache, positive, negative, latent, **kwargs) -> tuple:
    """(summary, the text the Carnator Sampler node shows on itself) of a 4-step request."""
    kwargs = {"steps": STEPS, "cfg": CFG, "probe_steps": AUTO_PROBE, "seed": SEED, **kwargs}
    out = sampler_output(comfy, model, cache, positive, negative, latent, **kwargs)
    return json.loads(out.result[1]), hostsetup.shown_text(out)


def test_a_4_step_lora_run_misses_hits_at_aggressive_repeats_and_a_strength_change_is_a_new_bucket(
        comfy, plugin, tiny_model, host_dirs, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    full = CallCounter(with_lora(comfy, host_dirs, tiny_model, 1.0))
    plain = node(comfy, "KSampler").sample(full.model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                           latent)[0]
    full.take()

    first, miss = four_steps(comfy, full.model, cache, positive, negative, latent)
    assert not miss["reuse"] and miss["probe_steps"] == 1 and full.take() == STEPS == miss["model_calls"]
    assert (first["samples"] - plain["samples"]).abs().max() < 1e-4          # a miss is plain sampling

    _, hit = four_steps(comfy, full.model, cache, nudged(positive), negative, latent, risk="aggressive")
    assert hit["reuse"] and hit["entry_id"] == miss["stored_as"], hit["reasons"]
    assert hit["resume_step"] == 3 and full.take() == hit["model_calls"] == 2

    refused, text = shown(comfy, full.model, cache, nudged(positive, 1.002), negative, latent)   # balanced, the default
    assert not refused["reuse"] and full.take() == STEPS
    assert refused["why"].startswith("no reuse at 4 steps at this risk level"), refused["reasons"]
    assert text.startswith("Carnator MISS (balanced)") and "no reuse at 4 steps" in text, text   # on the node too

    _, repeat = four_steps(comfy, full.model, cache, positive, negative, latent)
    assert repeat["exact_repeat"] and full.take() == 0



def test_a_turbo_lora_and_its_strength_are_the_model_a_reload_shares_entries_another_strength_or_none_never(
        comfy, plugin, tiny_model, host_dirs, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    full = CallCounter(with_lora(comfy, host_dirs, tiny_model, 1.0))
    _, miss = four_steps(comfy, full.model, cache, positive, negative, latent)
    assert not miss["reuse"] and full.take() == STEPS

    reloaded = CallCounter(with_lora(comfy, host_dirs, tiny_model, 1.0))       # the same LoRA at the same strength,
    _, repeat = four_steps(comfy, reloaded.model, cache, positive, negative, latent)   # loaded again: one model
    assert repeat["exact_repeat"] and repeat["entry_id"] == miss["stored_as"] and reloaded.take() == 0
    _, hit = four_steps(comfy, reloaded.model, cache, nudged(positive), negative, latent, risk="aggressive")
    assert hit["reuse"] and hit["entry_id"] == miss["stored_as"], hit["reasons"]
    reloaded.take()

    buckets = {cache.record(miss["stored_as"]).bucket}
    for label, other in (("strength 0.5", CallCounter(with_lora(comfy, host_dirs, tiny_model, 0.5))),
                         ("no LoRA", CallCounter(tiny_model))):
        same_prompt, text = shown(comfy, other.model, cache, positive, negative, latent)   # a repeat if one model
        assert not same_prompt["reuse"] and not same_prompt["exact_repeat"] and other.take() == STEPS, label
        assert "differs in model/patches (weights, LoRAs or their strengths)" in same_prompt["why"], label
        assert text.startswith("Carnator MISS") and "LoRAs or their strengths" in text, (label, text)   # on the node
        _, near = four_steps(comfy, other.model, cache, nudged(positive), negative, latent, risk="aggressive")
        assert near.get("entry_id") != miss["stored_as"], (label, near["reasons"])   # its own entry at most
        other.take()
        buckets.add(cache.record(same_prompt["stored_as"]).bucket)
    assert len(buckets) == 3                                                   # each its own bucket


@pytest.mark.parametrize("sampler_name, scheduler", [("euler", "beta"), ("euler", "sgm_uniform"), ("lcm", "simple"),
                                                     ("euler_ancestral", "beta")])
def test_the_samplers_and_schedules_of_distilled_loras_miss_as_ksampler_and_repeat(comfy, plugin, counted, conds,
                                                                                   latent, tmp_path, sampler_name,
                                                                                   scheduler):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    plain = node(comfy, "KSampler").sample(counted.model, SEED, STEPS, CFG, sampler_name, scheduler, positive,
                                           negative, latent)[0]
    counted.take()
    run = node(comfy, "CarnatorSampler")
    outputs = []
    for _ in range(2):
        out = run(counted.model, cache, positive, negative, latent, SEED, STEPS, CFG, sampler_name, scheduler,
                  AUTO_PROBE, "balanced", True, 1.0, unique_id="7", prompt=None)
        cache.writer.settle()
        outputs.append((out.result[0], json.loads(out.result[1]), counted.take()))
    (first, miss, miss_calls), (again, repeat, repeat_calls) = outputs
    assert not miss["reuse"] and miss["probe_steps"] == 1 and miss_calls == STEPS
    if sampler_name == "euler":
        assert (first["samples"] - plain["samples"]).abs().max() < 1e-4
    else:   # known difference: a stochastic sampler split at the probe draws each segment's step noise from the seed
        assert bool(torch.isfinite(first["samples"]).all())
    assert repeat["exact_repeat"] and repeat_calls == 0 and torch.equal(again["samples"], first["samples"])


def test_wan22_experts_at_2_plus_2_steps_hit_on_the_low_noise_expert(comfy, plugin, experts, conds, latent,  # noqa: F811
                                                                     tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    high, low = CallCounter(experts[0]), CallCounter(experts[1])
    _, miss = two_expert_sample(comfy, (high, low), cache, positive, negative, latent, steps=STEPS, cfg=CFG,
                                    probe_steps=AUTO_PROBE, switch_step=2)
    assert not miss["reuse"] and (high.take(), low.take()) == (2, 2)
    _, hit = two_expert_sample(comfy, (high, low), cache, nudged(positive), negative, latent, steps=STEPS, cfg=CFG,
                               probe_steps=AUTO_PROBE, switch_step=2, risk="aggressive")
    assert hit["reuse"] and hit["resume_step"] == 3, hit["reasons"]
    assert (high.take(), low.take()) == (1, 1)          # the probe on the high-noise expert, step 3 on the low one


def test_bad_few_step_inputs_are_refused_by_the_node_and_nothing_is_stored(comfy, plugin, counted, conds, latent,
                                                                           tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    before = store_state(cache)
    for message, kwargs in (
            (r"input 'probe_steps': probe_steps=4 must be between 1 and steps-1 \(3\)", {"probe_steps": 4}),
            (r"input 'steps': steps=1: Carnator needs at least 2 steps", {"steps": 1}),
            (r"input 'cfg': cfg=0 must be > 0", {"cfg": 0.0}),
            (r"input 'cfg': cfg=-1 must be > 0", {"cfg": -1.0})):
        with pytest.raises(ValueError, match=message):
            four_steps(comfy, counted.model, cache, positive, negative, latent, **kwargs)
    probe = node(comfy, "CarnatorEarlyProbe")(counted.model, positive, negative, latent, SEED, STEPS, CFG, "euler",
                                              "simple", AUTO_PROBE, 0)[0]
    matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
    with pytest.raises(ValueError, match=r"few_step_resume_fraction=1.0 is outside \(0, 1\): at 1 or more"):
        node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced", few_step_resume_fraction=1.0)
    assert counted.take() == 1 and store_state(cache) == before               # the probe ran; nothing was stored
