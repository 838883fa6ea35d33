"""Wan 2.2 A14B's two experts through the real host: a high-noise expert for the first steps, a low-noise expert
from the switch on, as ComfyUI's template runs them with two KSamplerAdvanced nodes.

Two tiny random Wan models (ComfyUI's WanModel, other seeds; loaded by UNETLoader, each given its own
ModelSamplingSD3 as the template does) stand in for the pair. Calls are counted per expert at the diffusion model.
"""
from __future__ import annotations

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import CFG, SEED, node, nudged, open_cache, sample, store_state

STEPS, PROBE, SWITCH = 10, 2, 5
HIGH, LOW, DEEPER = hostsetup.TINY_WAN22_HIGH, hostsetup.TINY_WAN22_LOW, "carnator_test_wan22_3_blocks.safetensors"


def load(comfy, name, shift=8.0):
    model = node(comfy, "UNETLoader").load_unet(name, "default")[0]
    return node(comfy, "ModelSamplingSD3").patch(model, shift)[0]


@pytest.fixture(scope="module")
def experts(comfy, host_dirs):
    hostsetup.build_tiny_wan(host_dirs["models"], seed=11, name=HIGH)
    hostsetup.build_tiny_wan(host_dirs["models"], seed=12, name=LOW)
    return load(comfy, HIGH), load(comfy, LOW)


@pytest.fixture
def counted(experts):
    return CallCounter(experts[0]), CallCounter(experts[1])


def template(comfy, high, low, positive, negative, latent, switch=SWITCH, steps=STEPS):
    """ComfyUI's Wan 2.2 A14B template: KSamplerAdvanced on each expert, split at `switch`."""
    first = node(comfy, "KSamplerAdvanced").sample(high, "enable", SEED, steps, CFG, "euler", "simple", positive,
                                                   negative, latent, 0, switch, "enable")[0]
    return node(comfy, "KSamplerAdvanced").sample(low, "disable", 0, steps, CFG, "euler", "simple", positive,
                                                  negative, first, switch, 10000, "disable")[0]


def two_expert_sample(comfy, pair, cache, positive, negative, latent, **kwargs):
    high, low = pair
    kwargs.setdefault("switch_step", SWITCH)
    return sample(comfy, high.model, cache, positive, negative, latent, low_noise_model=low.model, **kwargs)


def test_miss_equals_the_two_ksampler_template_and_each_expert_runs_its_steps(comfy, plugin, experts, counted,
                                                                              conds, latent, tmp_path):
    positive, negative = conds
    reference = template(comfy, *experts, positive, negative, latent)["samples"]
    cache = open_cache(comfy, tmp_path / "cache")
    out, miss = two_expert_sample(comfy, counted, cache, positive, negative, latent)
    high, low = counted
    assert not miss["reuse"] and (high.take(), low.take()) == (SWITCH, STEPS - SWITCH)
    difference = (out["samples"] - reference).abs().max().item()
    assert difference < 1e-5 * max(1.0, reference.abs().max().item()), difference
    single = template(comfy, experts[0], experts[0], positive, negative, latent)["samples"]
    assert (single - reference).abs().max() > 1e-2          # the second expert does change the result

    hit_out, hit = two_expert_sample(comfy, counted, cache, nudged(positive), negative, latent)
    k = hit["resume_step"]
    assert hit["reuse"] and k > PROBE, hit["reasons"]
    assert (high.take(), low.take()) == (PROBE + max(0, SWITCH - k), STEPS - max(k, SWITCH))
    relative = (hit_out["samples"] - out["samples"]).norm() / out["samples"].norm()
    assert relative < 0.05

    _, repeat = two_expert_sample(comfy, counted, cache, positive, negative, latent)
    assert repeat["exact_repeat"] and (high.take(), low.take()) == (0, 0)


@pytest.mark.parametrize("k", [3, SWITCH, 7])
def test_a_resume_at_any_step_runs_each_step_on_its_expert(comfy, plugin, experts, counted, conds, latent, k):
    """From step k on, the runner gives the steps before the switch to the high-noise expert and the rest to the
    low-noise one, and continues exactly where the template's trajectory is."""
    from comfy.sample import prepare_noise
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    positive, negative = conds
    high, low = counted
    runner = ComfyRunner(high.model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED,
                         low_noise_model=low.model, switch_step=SWITCH)
    noise = prepare_noise(latent["samples"], SEED)
    entering_k = runner.run(noise, runner.sigmas, 0, k, GenerationObserver())
    high.take(), low.take()
    rest = runner.run(entering_k, runner.sigmas, k, STEPS, GenerationObserver())
    assert (high.take(), low.take()) == (max(0, SWITCH - k), STEPS - max(k, SWITCH))
    reference = template(comfy, *experts, positive, negative, latent)["samples"]
    assert torch.allclose(runner.to_latent_format(rest), reference, atol=1e-4)


def test_bucket_holds_both_experts_and_the_switch(comfy, plugin, experts, conds):
    from carnator_engine.hosts.comfyui import ComfyRunner
    positive, negative = conds
    high, low = experts

    def fingerprint(model, **kwargs):
        return ComfyRunner(model, positive, negative, CFG, "euler", "simple", steps=STEPS, **kwargs).model_fingerprint
    prints = {fingerprint(high), fingerprint(high, low_noise_model=low, switch_step=SWITCH),
              fingerprint(high, low_noise_model=low, switch_step=SWITCH + 1),
              fingerprint(low, low_noise_model=high, switch_step=SWITCH)}
    assert len(prints) == 4
    # the boundary rule picks the first step whose sigma is below it
    runner = ComfyRunner(high, positive, negative, CFG, "euler", "simple", steps=STEPS, low_noise_model=low,
                         boundary_sigma=0.875)
    s = runner.switch_step
    assert float(runner.sigmas[s - 1]) >= 0.875 > float(runner.sigmas[s])
    assert runner.model_fingerprint == fingerprint(high, low_noise_model=low, switch_step=s)  # the step, not the rule


def test_bad_expert_inputs_name_the_input_and_store_nothing(comfy, plugin, experts, conds, latent, tmp_path,
                                                            host_dirs):
    positive, negative = conds
    high, low = experts
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, high, cache, positive, negative, latent)
    before = store_state(cache)
    deeper = load(comfy, hostsetup.build_tiny_wan(host_dirs["models"], seed=13, name=DEEPER, layers=3))
    ltxv = node(comfy, "UNETLoader").load_unet(hostsetup.build_tiny_ltxv(host_dirs["models"]), "default")[0]
    other_shift = node(comfy, "ModelSamplingSD3").patch(low, 5.0)[0]

    def bad(message, **kwargs):
        with pytest.raises(ValueError, match=message):
            sample(comfy, high, cache, positive, negative, latent, **kwargs)
        with pytest.raises(ValueError, match=message):
            node(comfy, "CarnatorEarlyProbe")(high, positive, negative, latent, SEED, STEPS, CFG, "euler",
                                                    "simple", kwargs.pop("probe_steps", PROBE), 64, **kwargs)

    bad(r"input 'low_noise_model': the low-noise expert \(WAN21, wan2.1, 3 blocks.*not the same "
        r"architecture and size", low_noise_model=deeper, switch_step=SWITCH)
    bad(r"input 'low_noise_model': Carnator: unsupported model LTXV|input 'low_noise_model': the low-noise expert "
        r"\(LTXV", low_noise_model=ltxv, switch_step=SWITCH)
    bad(r"input 'low_noise_model': the low-noise expert samples another sigma schedule", low_noise_model=other_shift,
        switch_step=SWITCH)
    bad(r"input 'switch_step': switch_step=10 is outside the schedule", low_noise_model=low, switch_step=STEPS)
    bad(r"input 'boundary_sigma': boundary_sigma=0.001 is outside the schedule", low_noise_model=low,
        boundary_sigma=0.001)
    bad(r"input 'probe_steps': probe_steps=6 is beyond the switch to the low-noise expert \(step 5\)",
        low_noise_model=low, switch_step=SWITCH, probe_steps=6)
    assert store_state(cache) == before


def test_staged_nodes_take_the_two_experts(comfy, plugin, experts, counted, conds, latent, tmp_path):
    positive, negative = conds
    high, low = counted
    cache = open_cache(comfy, tmp_path / "cache")
    _, miss = two_expert_sample(comfy, counted, cache, positive, negative, latent)
    high.take(), low.take()
    probe = node(comfy, "CarnatorEarlyProbe")(high.model, nudged(positive), negative, latent, SEED, STEPS, CFG,
                                                    "euler", "simple", PROBE, 64, low_noise_model=low.model,
                                                    switch_step=SWITCH)[0]
    assert (high.take(), low.take()) == (PROBE, 0)            # the probe runs on the high-noise expert
    matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
    decision = node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced").result[0]
    assert decision.decision.reuse and decision.decision.entry_id == miss["stored_as"], decision.decision.reasons
    node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, True)
    k = decision.decision.resume_step
    assert (high.take(), low.take()) == (max(0, SWITCH - k), STEPS - max(k, SWITCH))
