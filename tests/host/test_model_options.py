"""What is on the MODEL decides what may be reused: EasyCache, LazyCache, ModelSamplingSD3, a LoRA-style patch and
a third-party wrapper, alone and in pairs, through the real ComfyUI host. Never a repeat or a hit across different
options; the same options repeat. Options Carnator cannot read make a plain generation. ComfyUI's step caches run
inside Carnator's runs as they run inside a KSampler.

Calls are counted by a DIFFUSION_MODEL wrapper added after the step cache's, so it counts real forwards only.
"""
from __future__ import annotations

import itertools
import json
import re
import shutil

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import (CFG, PROBE, SEED, STEPS, node, nudged, open_cache, sample, sampler_output,
                               store_state)

LORA_KEY = "diffusion_model.blocks.0.self_attn.q.weight"


class ScaleOutputNode:
    """A third-party node (as a custom node would write it): wraps the diffusion model, scaling its output."""

    def patch(self, model, strength: float):
        from comfy.patcher_extension import WrappersMP
        model = model.clone()

        def scaled(executor, *args, **kwargs):
            return executor(*args, **kwargs) * strength
        model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "test_scale", scaled)
        return model


def easycache(comfy, model, threshold=0.2, start=0.15, end=0.95):
    return node(comfy, "EasyCache")(model, threshold, start, end, False)[0]


def lazycache(comfy, model, threshold=0.2, start=0.15, end=0.95):
    return node(comfy, "LazyCache")(model, threshold, start, end, False)[0]


def sd3_shift(comfy, model, shift=5.0):
    return node(comfy, "ModelSamplingSD3").patch(model, shift)[0]


def lora(model, strength=1.0):
    weight = model.model.state_dict()[LORA_KEY]
    delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * 0.01
    patched = model.clone()
    patched.add_patches({LORA_KEY: ("diff", (delta,))}, strength)
    return patched


OPTIONS = {     # the step caches as the issue found them: reuse_threshold 3 skips most steps of this model
    "easycache": lambda comfy, m: easycache(comfy, m, threshold=3.0),
    "lazycache": lambda comfy, m: lazycache(comfy, m, threshold=3.0),
    "sd3_shift": lambda comfy, m: sd3_shift(comfy, m),
    "lora": lambda comfy, m: lora(m),
    "wrapper": lambda comfy, m: ScaleOutputNode().patch(m, 0.9),
}


def fingerprint(model, conds):
    from carnator_engine.hosts.comfyui import ComfyRunner
    return ComfyRunner(model, *conds, CFG, "euler", "simple", steps=STEPS).model_fingerprint


def build(comfy, model, names):
    for name in names:
        model = OPTIONS[name](comfy, model)
    return model


def test_every_option_alone_and_in_pairs_has_its_own_key(comfy, plugin, tiny_model, conds):
    combos = [()] + [(n,) for n in OPTIONS] + list(itertools.combinations(OPTIONS, 2))
    keys = {combo: fingerprint(build(comfy, tiny_model, combo), conds) for combo in combos}
    assert len(set(keys.values())) == len(combos), keys
    for combo in combos:       # built again by the same nodes: the same key (a restart rebuilds it so too)
        assert fingerprint(build(comfy, tiny_model, combo), conds) == keys[combo]
    # each setting of an option is part of it, not only its presence
    variants = [easycache(comfy, tiny_model, threshold=2.9), easycache(comfy, tiny_model, 3.0, start=0.2),
                easycache(comfy, tiny_model, 3.0, end=0.9), lazycache(comfy, tiny_model, threshold=2.9),
                sd3_shift(comfy, tiny_model, 6.0), lora(tiny_model, 0.5), ScaleOutputNode().patch(tiny_model, 0.8)]
    assert len({fingerprint(m, conds) for m in variants} | set(keys.values())) == len(combos) + len(variants)


def test_a_wrapper_packs_key_is_the_same_wherever_the_pack_is_installed(comfy, plugin, tiny_model, conds, tmp_path):
    """ComfyUI imports a custom node under the path of its folder: the model key takes what the wrapper does (its
    pack's name, its code, its settings), so workers whose custom_nodes sit at different paths share entries, while
    another setting, another wrapper or another pack with the same code gives another key."""
    source = hostsetup.WRAPPER_PACK
    worker_a = hostsetup.install_pack(comfy, source, str(tmp_path / "srv" / "ComfyUI" / "custom_nodes" / "pack"))
    worker_b = hostsetup.install_pack(comfy, source, str(tmp_path / "home.b" / "custom_nodes" / "ComfyUI-Pack"))
    assert worker_a.__name__ != worker_b.__name__     # the module names ComfyUI gives them: their install paths
    key = fingerprint(worker_a.ScaleOutput().patch(tiny_model, 0.9)[0], conds)
    assert fingerprint(worker_b.ScaleOutput().patch(tiny_model, 0.9)[0], conds) == key

    renamed = tmp_path / "other_pack"
    shutil.copytree(source, renamed, ignore=shutil.ignore_patterns("__pycache__"))
    (renamed / "pyproject.toml").write_text('[project]\nname = "another-pack"\n')
    another = hostsetup.install_pack(comfy, renamed, str(tmp_path / "c" / "custom_nodes" / "pack"))
    others = [worker_a.ScaleOutput().patch(tiny_model, 0.8)[0], worker_b.ShiftOutput().patch(tiny_model, 0.9)[0],
              another.ScaleOutput().patch(tiny_model, 0.9)[0], ScaleOutputNode().patch(tiny_model, 0.9)]
    assert len({key} | {fingerprint(model, conds) for model in others}) == 1 + len(others)


def test_never_a_repeat_or_hit_across_options_and_the_same_options_repeat(comfy, plugin, tiny_model, conds,
                                                                          latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    outputs, entries = {}, {}
    for combo in [(), ("easycache",), ("lazycache",), ("sd3_shift",), ("lora",), ("wrapper",),
                  ("easycache", "lora"), ("lazycache", "sd3_shift"), ("easycache", "wrapper")]:
        counter = CallCounter(build(comfy, tiny_model, combo))     # counts after the step cache decided
        out, first = sample(comfy, counter.model, cache, positive, negative, latent)
        assert not first["reuse"], (combo, first["reasons"])
        assert first["reasons"][0].startswith("no earlier generation of this model"), (combo, first["reasons"])
        assert first["model_calls"] == counter.take() and first["steps_run"] == STEPS
        again, repeat = sample(comfy, counter.model, cache, positive, negative, latent)
        assert repeat["exact_repeat"] and repeat["entry_id"] == first["stored_as"] and counter.take() == 0, combo
        assert torch.equal(again["samples"], out["samples"])
        outputs[combo], entries[combo] = out["samples"], first["stored_as"]
    # the case: the EasyCache result is not what the plain model gives, and was never served for it
    assert (outputs[("easycache",)] - outputs[()]).abs().max() > 1e-3
    for combo in [(), ("easycache",), ("lora",)]:     # a near request: a hit only on its own options' entry
        _, summary = sample(comfy, build(comfy, tiny_model, combo), cache, nudged(positive), negative, latent)
        assert summary["reuse"] and summary["entry_id"] == entries[combo], (combo, summary["reasons"])


def test_the_node_names_each_option_in_a_creators_words(comfy, plugin, tiny_model, conds, latent, tmp_path):
    """A request whose model carries another option than the cached generation's misses, and its node text says
    which option in words a creator knows (the node it came from, its setting), never a Python qualified name."""
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, tiny_model, cache, positive, negative, latent)
    for combo, words in ((("sd3_shift",), "model sampling patch (from ModelSamplingSD3, shift=5)"),
                         (("wrapper",), "another node's wrapper on the diffusion model (from ScaleOutputNode)"),
                         (("lora",), "differs in model/patches (weights, LoRAs or their strengths)")):
        out = sampler_output(comfy, build(comfy, tiny_model, combo), cache, positive, negative, latent)
        text, summary_json = hostsetup.shown_text(out), out.result[1]
        assert text.startswith("Carnator MISS") and words in text, text
        assert "<locals>" not in text + summary_json and ".patch." not in text + summary_json, text


def run_ksampler(model, conds, latent, steps=STEPS):
    import comfy.sample
    positive, negative = conds
    samples = latent["samples"]
    noise = comfy.sample.prepare_noise(samples, SEED)
    return comfy.sample.sample(model, noise, steps, CFG, "euler", "simple", positive, negative, samples,
                               disable_pbar=True, seed=SEED)


@pytest.mark.parametrize("cache_node", [easycache, lazycache])
def test_a_miss_with_a_step_cache_equals_ksampler_with_it_and_counts_real_calls(comfy, plugin, tiny_model, conds,
                                                                                  latent, tmp_path, cache_node):
    model = cache_node(comfy, tiny_model, threshold=3.0, start=0.0, end=1.0)    # skips most steps it may
    counter = CallCounter(model)
    reference = run_ksampler(counter.model, conds, latent)
    reference_calls = counter.take()
    assert reference_calls < STEPS                  # the step cache did skip
    out, miss = sample(comfy, counter.model, open_cache(comfy, tmp_path / "cache"), *conds, latent)
    assert not miss["reuse"] and counter.take() == reference_calls == miss["model_calls"]
    assert miss["steps_run"] == STEPS and miss["step_cache_skipped"] == STEPS - reference_calls
    assert miss["step_cache"].startswith(model.model_options["transformer_options"]["easycache"].name)
    relative = float((out["samples"] - reference).norm() / reference.norm())
    assert relative < 1e-5, relative          # float32 noise of the split run
    out = node(comfy, "CarnatorSampler")(counter.model, open_cache(comfy, tmp_path / "other"), *conds, latent,
                                         SEED, STEPS, CFG, "euler", "simple", PROBE, "balanced", True)
    assert (f"{STEPS} of {STEPS} steps run, {reference_calls} model calls ({miss['step_cache']} inside: skipped "
            f"{STEPS - reference_calls} steps)") in hostsetup.shown_text(out)
    assert "reuse_threshold=3, start_percent=0, end_percent=1" in miss["step_cache"]


def test_the_probe_never_skips_so_its_signature_is_the_models_own(comfy, plugin, tiny_model, conds, latent):
    """With 4 probe steps, EasyCache (threshold 3, from the start) would skip steps 2 and 3; in the probe it
    computes them, so the Early Signature is the one the model gives without any step cache."""
    from comfy.sample import prepare_noise
    from carnator_engine import pipeline
    from carnator_engine.hosts.comfyui import ComfyRunner
    positive, negative = conds
    noise = prepare_noise(latent["samples"], SEED)
    config = pipeline.CarnatorConfig(probe_steps=4, block_size=64)
    signatures = []
    for model in (tiny_model, easycache(comfy, tiny_model, threshold=3.0, start=0.0, end=1.0)):
        counter = CallCounter(model)
        runner = ComfyRunner(counter.model, positive, negative, CFG, "euler", "simple", steps=STEPS, seed=SEED)
        probed = pipeline.probe(runner, noise, runner.sigmas, config)
        assert counter.take() == 4 == probed.model_calls
        signatures.append(probed.signature)
    for name in ("hidden", "denoised", "attention"):
        assert torch.allclose(getattr(signatures[0], name), getattr(signatures[1], name), atol=1e-6), name


def test_a_hit_resumes_under_the_step_cache(comfy, plugin, tiny_model, conds, latent, tmp_path):
    positive, negative = conds
    counter = CallCounter(easycache(comfy, tiny_model, threshold=3.0, start=0.0, end=1.0))
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, counter.model, cache, positive, negative, latent)
    counter.take()
    out, hit = sample(comfy, counter.model, cache, nudged(positive), negative, latent)
    calls = counter.take()
    assert hit["reuse"] and not hit["exact_repeat"], hit["reasons"]
    resumed = STEPS - hit["resume_step"]
    assert hit["steps_run"] == PROBE + resumed + (hit["refine_step"] is not None)
    assert calls == hit["model_calls"] == hit["steps_run"] - hit["step_cache_skipped"]
    assert hit["step_cache_skipped"] > 0 and hit["step_cache"].startswith("EasyCache")
    assert torch.isfinite(out["samples"]).all()


# ---- options Carnator cannot read, and bad runs ---------------------------------------------------

class Opaque:
    """An object of a class Carnator does not know (a third-party step cache's state, say)."""
    strength = 0.9


def test_an_option_carnator_cannot_read_makes_a_plain_generation(comfy, plugin, tiny_model, conds, latent,
                                                                 tmp_path):
    from comfy.patcher_extension import WrappersMP
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    opaque = Opaque()

    def wrapper(executor, *args, **kwargs):
        return executor(*args, **kwargs) * opaque.strength
    model = tiny_model.clone()
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "third_party", wrapper)
    unreadable = easycache(comfy, tiny_model)
    unreadable.model_options["transformer_options"]["easycache"].reuse_threshold = torch.tensor(3.0)  # runs in it
    for bad, named in ((model, "the settings of another node's wrapper on the diffusion model ('third_party'), so"),
                       (unreadable, "EasyCache reuse_threshold=tensor(3.) is not a number Carnator can read")):
        counter = CallCounter(bad)
        for _ in range(2):    # the same request twice: no repeat either
            _, summary = sample(comfy, counter.model, cache, positive, negative, latent)
            assert not summary["reuse"] and summary["stored_as"] is None and summary["steps_run"] == STEPS
            assert counter.take() == summary["model_calls"] > 0      # generated again (EasyCache skips some)
            assert summary["reasons"][0].startswith("Carnator cannot compare") and named in summary["reasons"][0]
            # in a creator's words: no class or variable of the node's code, no attribute for its author
            assert not re.search(r"object of type|closure|its value|carnator_fingerprint", summary["reasons"][0])
    assert list(cache.records()) == []


def test_a_wrapper_that_raises_stores_nothing(comfy, plugin, tiny_model, conds, latent, tmp_path):
    from comfy.patcher_extension import WrappersMP
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    sample(comfy, tiny_model, cache, positive, negative, latent)
    before = store_state(cache)
    calls = []

    def failing(executor, *args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("boom at the fifth forward")
        return executor(*args, **kwargs)
    failing.carnator_fingerprint = "test failing wrapper"
    model = tiny_model.clone()
    model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "failing", failing)
    with pytest.raises(RuntimeError, match=r"Carnator: sampling steps \[2, 10\) failed .*boom at the fifth forward"
                                           r".*test failing wrapper.*Nothing was stored"):
        sample(comfy, model, cache, positive, negative, latent)
    assert store_state(cache) == before


def test_options_changed_between_probe_and_resume_make_a_plain_generation(comfy, plugin, tiny_model, conds, latent, tmp_path):
    positive, negative = conds
    cache = open_cache(comfy, tmp_path / "cache")
    model = easycache(comfy, tiny_model, threshold=0.2)
    sample(comfy, model, cache, positive, negative, latent)
    before = store_state(cache)
    probe = node(comfy, "CarnatorEarlyProbe")(model, nudged(positive), negative, latent, SEED, STEPS, CFG,
                                              "euler", "simple", PROBE, 64)[0]
    matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
    decision = node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced").result[0]
    assert decision.decision.reuse            # a hit, decided for the model as it was
    model.model_options["transformer_options"]["easycache"].reuse_threshold = 0.5   # edited in place
    out = node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, True)
    summary = json.loads(out.result[1])
    assert not summary["reuse"] and summary["stored_as"] is None and summary["steps_run"] == STEPS
    assert re.search(r"the MODEL changed between the probe and the resume \(now: .*EasyCache reuse_threshold=0\.5.*"
                     r"at the probe: .*EasyCache reuse_threshold=0\.2", summary["reasons"][0]), summary["reasons"]
    assert store_state(cache) == before
