"""Options of other nodes that Carnator refuses with an error naming the input (carnator_engine/hosts/refused.py).

KJNodes' WanVideo TeaCache (native), the step-skipping patch of the peer node pack.

It keeps its state on the diffusion model from one model call to the next and resets it at the schedule's first
step. Carnator's runs each see the request's whole schedule, so a miss (the probe, then the rest) matches KSampler +
TeaCache; a hit, though, resumes another request's latent at step k while TeaCache goes on from the state the
probe left at step p (measured here: the resumed steps differ from a fresh state's). Both the Carnator Sampler and
the Early Probe refuse it with an error naming the input, before anything runs or is stored; KSampler keeps it.
ComfyUI's own EasyCache is what composes (tests/host/test_model_options.py). Compiled models: tests/host/test_compiled.py.
"""
from __future__ import annotations

import pytest

import hostsetup
from test_comfyui_host import CFG, SEED, STEPS, PROBE, node, open_cache, sample, store_state
from test_peer_attention import kjnodes  # noqa: F401  (the fixture)


def test_kjnodes_teacache_is_refused_naming_the_input(comfy, plugin, kjnodes, tiny_model, conds, latent,  # noqa: F811
                                                      tmp_path):
    positive, negative = conds
    tea = kjnodes.WanVideoTeaCacheKJ().patch_teacache(tiny_model, 3.0, 0.1, 1.0, "offload_device", "disabled")[0]
    plain = node(comfy, "KSampler").sample(tiny_model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                           latent)[0]["samples"]
    skipped = node(comfy, "KSampler").sample(tea, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                             latent)[0]["samples"]
    assert (skipped - plain).abs().max() > 1e-2             # TeaCache does skip steps on this model

    # Carnator's split runs: each sees the request's whole schedule, so TeaCache places every step as in one KSampler
    # run and a miss (the probe, then the rest) would match it; but a hit resumes another request's latent at step
    # k while TeaCache goes on from the state the probe left on the diffusion model at step p
    from comfy.sample import prepare_noise
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    runner = ComfyRunner(tiny_model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    noise = prepare_noise(latent["samples"], SEED)
    cached_k = runner.run(noise, runner.sigmas, 0, 5, GenerationObserver())     # an earlier request at step k = 5
    runner.model = tea
    entering = runner.run(noise, runner.sigmas, 0, PROBE, GenerationObserver())
    split = runner.to_latent_format(runner.run(entering, runner.sigmas, PROBE, STEPS, GenerationObserver()))
    assert (split - skipped).abs().max() < 1e-3
    runner.run(noise * 1.01, runner.sigmas, 0, PROBE, GenerationObserver())          # a new request's probe
    after_probe = runner.run(cached_k, runner.sigmas, 5, STEPS, GenerationObserver())
    delattr(tea.get_model_object("diffusion_model"), "teacache_state")
    fresh = runner.run(cached_k, runner.sigmas, 5, STEPS, GenerationObserver())
    assert (after_probe - fresh).abs().max() > 1e-3

    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, tiny_model, cache, positive, negative, latent)
    before = store_state(cache)
    message = r"input 'model': Carnator: the model carries KJNodes' WanVideo TeaCache \(native\).*EasyCache"
    with pytest.raises(ValueError, match=message):
        sample(comfy, tea, cache, positive, negative, latent)
    with pytest.raises(ValueError, match=message):
        hostsetup.run_node(comfy.NODE_CLASS_MAPPINGS["CarnatorEarlyProbe"], tea, positive, negative, latent, SEED,
                           STEPS, CFG, "euler", "simple", PROBE, 64)
    with pytest.raises(ValueError, match=r"input 'low_noise_model': Carnator: the model carries KJNodes' WanVideo"):
        sample(comfy, tiny_model, cache, positive, negative, latent, low_noise_model=tea, switch_step=5)
    assert store_state(cache) == before
