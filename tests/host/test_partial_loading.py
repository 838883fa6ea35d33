"""Partial loading (what ComfyUI does with --lowvram, or whenever a model does not fit the free memory): the weights
of the modules past the budget stay where they are and are cast (with their LoRA applied on the fly) per forward.

On the CPU ComfyUI always loads a model whole, so the test forces the budget ComfyUI would compute on a small GPU
(1 MiB: nearly every module partially loaded) by wrapping its LoadedModel.model_load. Carnator's results, its
model key and its cache hits do not depend on how the model was loaded.
"""
from __future__ import annotations

import hostsetup
from conftest import CallCounter
from test_comfyui_host import nudged, open_cache, sample


def test_partial_loading_gives_the_same_results_and_the_same_key(comfy, plugin, tiny_model, conds, latent, tmp_path,
                                                                 host_dirs, monkeypatch):
    import comfy.model_management as management
    from carnator_engine.hosts.comfyui import ComfyRunner
    lora = hostsetup.build_tiny_lora(str(host_dirs["root"] / "loras"))
    model = node_lora(comfy, tiny_model, lora)
    positive, negative = conds
    key = ComfyRunner(model, positive, negative, 5.0, "euler", "simple", steps=10).model_fingerprint

    management.unload_all_models()
    full_cache = open_cache(comfy, tmp_path / "full")
    full, full_miss = sample(comfy, model, full_cache, positive, negative, latent)
    assert not model.model.model_lowvram

    whole_load = management.LoadedModel.model_load
    monkeypatch.setattr(management.LoadedModel, "model_load",
                        lambda self, lowvram_model_memory=0, force_patch_weights=False:
                        whole_load(self, 1 << 20, force_patch_weights=force_patch_weights))
    management.unload_all_models()
    counted = CallCounter(model)
    partial, _ = sample(comfy, counted.model, open_cache(comfy, tmp_path / "partial"), positive, negative,
                                   latent)
    assert model.model.model_lowvram and model.model.lowvram_patch_counter > 0      # LoRA applied per forward
    assert (partial["samples"] - full["samples"]).abs().max() <= 1e-5 * max(1.0, full["samples"].abs().max().item())
    assert ComfyRunner(model, positive, negative, 5.0, "euler", "simple", steps=10).model_fingerprint == key
    # the cache filled with the whole model serves the partially loaded one: an exact repeat and a hit
    _, repeat = sample(comfy, counted.model, full_cache, positive, negative, latent)
    assert repeat["exact_repeat"] and repeat["entry_id"] == full_miss["stored_as"]
    counted.take()
    _, hit = sample(comfy, counted.model, full_cache, nudged(positive), negative, latent)
    assert hit["reuse"] and hit["entry_id"] == full_miss["stored_as"] and counted.take() < 10, hit["reasons"]
    management.unload_all_models()


def test_a_region_step_on_a_partially_loaded_model_with_a_lora_gives_the_target_the_full_steps_result(
        comfy, plugin, tiny_model, conds, host_dirs, monkeypatch):
    """Region-only resume (on by default) cuts the tokens, not the weights: modules cast per forward with their
    LoRA applied on the fly give the target what a full step gives it."""
    import comfy.model_management as management
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens
    from test_region_host import REGION_STEP, _corner, _full_then_region, _same_target
    model = node_lora(comfy, tiny_model, hostsetup.build_tiny_lora(str(host_dirs["root"] / "loras")))
    whole_load = management.LoadedModel.model_load
    monkeypatch.setattr(management.LoadedModel, "model_load",
                        lambda self, lowvram_model_memory=0, force_patch_weights=False:
                        whole_load(self, 1 << 20, force_patch_weights=force_patch_weights))
    management.unload_all_models()
    shape = (1, 16, 5, 16, 16)
    runner = ComfyRunner(model, *conds, 5.0, "euler", "simple", steps=10, seed=1)
    target = _corner(runner, shape)
    full, part, _, _ = _full_then_region(runner, model, "blocks", shape, RegionTokens(target, frozenset({REGION_STEP})))
    assert model.model.model_lowvram and model.model.lowvram_patch_counter > 0
    _same_target(runner, target, shape, full, part)
    management.unload_all_models()


def node_lora(comfy, model, lora_name):
    return comfy.NODE_CLASS_MAPPINGS["LoraLoaderModelOnly"]().load_lora_model_only(model, lora_name, 1.0)[0]
