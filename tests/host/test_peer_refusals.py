"""Options of other nodes that Carnator refuses with an error naming the input (carnator_engine/hosts/refused.py).

KJNodes' WanVideo TeaCache (native), the step-skipping patch of the peer node pack.

It keeps its state on the diffusion model, resets it at the first step of every sampler run and places its start
and end within that run, so a request that Carnator runs as a probe and then the rest would skip other steps than
one KSampler run (measured here: the split run differs from KSampler + TeaCache). Both the Carnator Sampler and the
Early Probe refuse it with an error naming the input, before anything runs or is stored; KSampler keeps it.
ComfyUI's own EasyCache is what composes (tests/host/test_model_options.py).

torch.compile (ComfyUI's TorchCompileModel, KJNodes' TorchCompileModelWanVideoV2): Carnator's per-run hooks sit inside
the compiled model, so dynamo recompiled on every sampler run and hit its recompile limit (8) within the first request
on the tiny Wan (backend "eager", CPU), then ran uncompiled. Refused the same way; compiling takes minutes on the CPU,
so the test checks the refusal, not the recompiles.
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

    # what Carnator's split runs would give: the steps after the probe as a second sampler run
    from comfy.sample import prepare_noise
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    runner = ComfyRunner(tiny_model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    runner.model = tea
    noise = prepare_noise(latent["samples"], SEED)
    entering = runner.run(noise, runner.sigmas, 0, PROBE, GenerationObserver())
    split = runner.to_latent_format(runner.run(entering, runner.sigmas, PROBE, STEPS, GenerationObserver()))
    assert (split - skipped).abs().max() > 1e-2

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


def test_a_compiled_model_is_refused_naming_the_input(comfy, plugin, kjnodes, tiny_model, conds, latent,  # noqa: F811
                                                      tmp_path):
    positive, negative = conds
    compiled = {
        "TorchCompileModel": hostsetup.run_node(comfy.NODE_CLASS_MAPPINGS["TorchCompileModel"], tiny_model,
                                                "inductor").result[0],
        "TorchCompileModelWanVideoV2": kjnodes.TorchCompileModelWanVideoV2().patch(
            tiny_model, "inductor", False, "default", False, 64, True)[0],
    }
    cache = open_cache(comfy, tmp_path / "cache")
    before = store_state(cache)
    for name, model in compiled.items():
        with pytest.raises(ValueError, match=r"input 'model': Carnator: the model is compiled with torch.compile"):
            sample(comfy, model, cache, positive, negative, latent)
        with pytest.raises(ValueError, match=r"input 'low_noise_model': Carnator: the model is compiled"):
            sample(comfy, tiny_model, cache, positive, negative, latent, low_noise_model=model, switch_step=5)
    assert store_state(cache) == before
