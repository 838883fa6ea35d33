"""Carnator on the host as it changes: the host contract (hosts/contract.py) against the real ComfyUI and against
stand-ins missing a piece, the plain sampling that follows, nested latents, and an attention override shaped after
newer ComfyUI's Model Sparse Attention node, which re-installs itself on top of the chain at every step."""
from __future__ import annotations

import json
import logging

import pytest
import torch

import hostsetup
from test_comfyui_host import CFG, SEED, STEPS, node, open_cache, sample, sampler_output


def test_the_real_host_has_everything_carnator_needs(comfy, plugin):
    from carnator_engine.hosts import contract
    from carnator_engine.hosts.comfyui import MODEL_CLASSES
    assert contract.missing() == [] and contract.refusal() == ""
    assert contract.missing_models(MODEL_CLASSES) == []


def _without_predict_noise(monkeypatch):
    import comfy.patcher_extension as extension
    monkeypatch.delattr(extension.WrappersMP, "PREDICT_NOISE")


def _with_predict_noise_of_another_shape(monkeypatch):
    """The guider's predict_noise taking other arguments first (the host's own sampler still runs: it passes them
    by position)."""
    import comfy.samplers as samplers
    original = samplers.CFGGuider.predict_noise

    def predict_noise(self, latent, sigma, options={}, seed=None):
        return original(self, latent, sigma, options, seed)
    monkeypatch.setattr(samplers.CFGGuider, "predict_noise", predict_noise)


def _with_older_add_wrapper(monkeypatch):
    import comfy.patcher_extension as extension

    def add_wrapper_with_key(wrapper_type, wrapper, transformer_options):   # a stand-in of another shape
        raise AssertionError("not to be called")
    monkeypatch.setattr(extension, "add_wrapper_with_key", add_wrapper_with_key)


def _without_attention_override(monkeypatch):
    import comfy.ldm.modules.attention as attention
    monkeypatch.setattr(attention, "wrap_attn", lambda func: func)        # attention that no longer asks the override


@pytest.mark.parametrize("remove, named", [
    (_with_predict_noise_of_another_shape, "CFGGuider.predict_noise(x, timestep, model_options)"),
    (_with_older_add_wrapper, "add_wrapper_with_key(wrapper_type, key, wrapper"),
    (_without_attention_override, "optimized_attention_override"),
])
def test_a_host_missing_a_piece_samples_plain_with_one_line(comfy, plugin, tiny_model, conds, latent, tmp_path,
                                                            monkeypatch, remove, named):
    from carnator_engine.hosts import contract
    positive, negative = conds
    expected = node(comfy, "KSampler").sample(tiny_model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                              latent)[0]
    remove(monkeypatch)
    why = contract.refusal()
    assert named in why and "reuse is off" in why and "\n" not in why
    cache = open_cache(comfy, tmp_path / "cache")
    out = sampler_output(comfy, tiny_model, cache, positive, negative, latent)
    latent_out, summary_json = out.result
    summary = json.loads(summary_json)
    assert summary["plain"] and not summary["reuse"] and summary["why"] == why
    assert hostsetup.shown_text(out).startswith(f"Carnator OFF: {why}")
    assert torch.equal(latent_out["samples"], expected["samples"])
    assert list(cache.records()) == []
    with pytest.raises(ValueError, match="reuse is off"):       # the staged nodes say it where they need a runner
        node(comfy, "CarnatorEarlyProbe")(tiny_model, positive, negative, latent, SEED, STEPS, CFG, "euler",
                                          "simple", 2, 0)


def test_the_warning_at_load_names_what_is_missing(comfy, plugin, monkeypatch, caplog):
    import asyncio
    module = plugin[0]
    _without_predict_noise(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="carnator.host"):
        nodes = asyncio.run(module.comfy_entrypoint().get_node_list())
    assert len(nodes) == 6
    lines = [r.getMessage() for r in caplog.records if r.name == "carnator.host"]
    assert len(lines) == 1 and "WrappersMP.PREDICT_NOISE" in lines[0] and "reuse is off" in lines[0]


class NestedTensor:
    """A stand-in for newer ComfyUI's comfy.nested_tensor.NestedTensor (a video latent and an audio latent)."""

    def __init__(self, tensors):
        self.tensors = tensors


def test_a_nested_latent_is_refused_in_one_line_and_sampled_plain(comfy, plugin, tiny_model, conds, latent,
                                                                   tmp_path, monkeypatch):
    import nodes as host_nodes
    positive, negative = conds
    nested = {"samples": NestedTensor([latent["samples"], torch.zeros(1, 8, 5, 4)])}
    sampled = []

    def common_ksampler(model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, **kwargs):
        sampled.append(latent)           # the host's KSampler takes nested latents itself (newer ComfyUI)
        return ({"samples": latent["samples"]},)
    monkeypatch.setattr(host_nodes, "common_ksampler", common_ksampler)
    cache = open_cache(comfy, tmp_path / "cache")
    out = sampler_output(comfy, tiny_model, cache, positive, negative, nested)
    summary = json.loads(out.result[1])
    assert sampled == [nested] and summary["plain"] and "nested latent" in summary["why"]
    assert hostsetup.shown_text(out).count("\n") == 0 and list(cache.records()) == []
    with pytest.raises(ValueError, match="input 'latent_image': is a nested latent"):
        node(comfy, "CarnatorEarlyProbe")(tiny_model, positive, negative, nested, SEED, STEPS, CFG, "euler",
                                          "simple", 2, 0)


def sparse_attention_node(model, log):
    """A stand-in shaped after newer ComfyUI's Model Sparse Attention node: its override chains to the override it
    finds, and it puts itself back on top of the chain at every step (there from ON_PREPARE_STATE; here from an
    APPLY_MODEL wrapper, on the options the step runs with). Self-attention it computes itself, as its kernel does;
    cross-attention it declines to the chain."""
    import comfy.patcher_extension as extension
    installed = set()

    def install(options):
        current = options.get("optimized_attention_override")
        if current in installed:
            return

        def override(func, q, k, v, heads, mask=None, **kwargs):
            log.append("sparse")
            if q.shape == k.shape:
                return func(q, k, v, heads, mask=mask, **kwargs)
            if current is None:
                return func(q, k, v, heads, mask=mask, **kwargs)
            return current(func, q, k, v, heads, mask=mask, **kwargs)
        installed.add(override)
        options["optimized_attention_override"] = override

    def each_step(executor, *args, **kwargs):
        install(args[5] if len(args) > 5 else kwargs["transformer_options"])
        return executor(*args, **kwargs)
    patched = model.clone()
    install(patched.model_options["transformer_options"])
    patched.add_wrapper_with_key(extension.WrappersMP.APPLY_MODEL, "sparse_standin", each_step)
    return patched


def test_under_a_sparse_attention_node_that_reinstalls_itself_every_step(comfy, plugin, tiny_model, conds, latent,
                                                                         tmp_path, monkeypatch):
    """Carnator's override goes on top at each block call, whatever the sparse node did since: it sees every
    self-attention call (the signature, the kept connectivity), the sparse one runs once per call below it, and the
    results are the plain ones (the stand-in's kernel is exact)."""
    from carnator_engine.observer import GenerationObserver
    positive, negative = conds
    log = []
    seen = []
    original = GenerationObserver.self_attention

    def counted(self, block, *args, **kwargs):
        seen.append(block)
        return original(self, block, *args, **kwargs)
    monkeypatch.setattr(GenerationObserver, "self_attention", counted)
    plain, _ = sample(comfy, tiny_model, open_cache(comfy, tmp_path / "plain"), positive, negative, latent)
    plain_seen = len(seen)
    seen.clear()
    model = sparse_attention_node(tiny_model, log)
    cache = open_cache(comfy, tmp_path / "sparse")
    layered, miss = sample(comfy, model, cache, positive, negative, latent)
    assert not miss["reuse"] and len(seen) == plain_seen > 0
    assert len(log) == STEPS * 4                                              # self + cross, once each
    assert torch.allclose(plain["samples"], layered["samples"], atol=1e-5)


def test_under_dynamic_vram_a_region_only_hit_keeps_its_keys_and_values_off_the_gpu_and_says_so(comfy, plugin,
                                                                                              host_dirs, tmp_path,
                                                                                              monkeypatch):
    """0.3.64 has no dynamic VRAM: a stand-in of newer ComfyUI's comfy.memory_management with comfy-aimdo on, and a
    GPU's memory reading with room for every kept block (streaming runs on the CPU too)."""
    import importlib
    import sys
    import types
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.kept_kv import GIB, MemoryReading, TorchMemory
    from test_region_host import SEED as REGION_SEED, STEPS as REGION_STEPS, _backbone, corner_requests
    model, (positive, negative), shape, _ = _backbone(comfy, "wan2.1", host_dirs["models"])
    assert ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=REGION_STEPS).memory.paged == ""
    monkeypatch.setitem(sys.modules, "comfy.memory_management", types.SimpleNamespace(aimdo_enabled=True))
    monkeypatch.setattr(TorchMemory, "read", lambda self, device: MemoryReading(0, GIB, 64 * GIB))
    runner = ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=REGION_STEPS, seed=REGION_SEED)
    assert runner.memory.paged.startswith("dynamic VRAM is on (comfy-aimdo)")
    hit = corner_requests(runner, shape, tmp_path / "cache")[1].summary()
    numbers = hit["numbers"]
    assert hit["reuse"] and numbers["region_only"], hit["reasons"]
    assert numbers["region_resident_bytes"] == 0 and numbers["region_streamed_bytes"] > 0
    # the node's text and summary carry the reason
    nodes_module = importlib.import_module(plugin[0].__name__ + ".nodes.carnator_nodes")
    noted = nodes_module._noted(runner, hit)
    assert noted["notes"] == [runner.memory.paged]
    assert nodes_module._noted(types.SimpleNamespace(memory=TorchMemory()), hit) == hit
