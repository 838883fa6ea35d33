"""GGUF-quantized Wan through ComfyUI-GGUF's "Unet Loader (GGUF)" (the peer node pack, unmodified, loaded next to
Carnator by ComfyUI's own loader): the tiny Wan 2.1 written with the `gguf` package as Q8_0 and as the K-quant Q6_K.

A miss equals plain sampling (KSampler) of the same GGUF model, an exact repeat makes no model call, a prompt edit
hits, a region-only step (on by default) gives its target what a full step gives it through the quantized weights,
and the quantization type is part of the model key: a Q8_0 request never reuses a Q6_K or a float generation.
"""
from __future__ import annotations

import pytest

import hostsetup
from conftest import CallCounter
from test_comfyui_host import CFG, SEED, STEPS, node, nudged, open_cache, sample

QTYPES = ("Q8_0", "Q6_K")


@pytest.fixture(scope="module")
def gguf_loader(comfy, host_dirs):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -r requirements-dev.txt)")
    missing = hostsetup.peer_missing("ComfyUI-GGUF")
    if missing:
        pytest.skip(missing)
    hostsetup.install_peer(comfy, host_dirs["custom_nodes"], "ComfyUI-GGUF")
    return comfy.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]()


@pytest.fixture(scope="module")
def gguf_models(gguf_loader, host_dirs):
    return {qtype: gguf_loader.load_unet(hostsetup.build_tiny_wan_gguf(host_dirs["models"], qtype))[0]
            for qtype in QTYPES}


def test_the_tiny_gguf_models_load_quantized(plugin, gguf_models):
    from carnator_engine.hosts.comfyui import backbone_for
    for qtype, model in gguf_models.items():
        kinds = {getattr(getattr(t, "tensor_type", None), "name", None)
                 for t in model.model.diffusion_model.parameters()}
        assert {qtype, "F32"} <= kinds, kinds
        assert type(model).__name__ == "GGUFModelPatcher" and backbone_for(model).model_class == "WAN21"


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_miss_equals_plain_sampling_repeat_is_free_and_an_edit_hits(comfy, plugin, gguf_models, conds, latent,
                                                                          tmp_path, qtype):
    model = gguf_models[qtype]
    counted = CallCounter(model)
    positive, negative = conds
    reference = node(comfy, "KSampler").sample(model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                               latent)[0]["samples"]
    cache = open_cache(comfy, tmp_path / "cache")
    out, miss = sample(comfy, counted.model, cache, positive, negative, latent)
    assert not miss["reuse"] and counted.take() == STEPS
    assert (out["samples"] - reference).abs().max() <= 1e-5 * max(1.0, reference.abs().max().item())
    _, repeat = sample(comfy, counted.model, cache, positive, negative, latent)
    assert repeat["exact_repeat"] and counted.take() == 0
    hit_out, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent)
    assert hit["reuse"] and hit["entry_id"] == miss["stored_as"], hit["reasons"]
    assert counted.take() < STEPS
    assert (hit_out["samples"] - out["samples"]).norm() / out["samples"].norm() < 0.05


def test_the_quantization_type_is_part_of_the_model_key(comfy, plugin, gguf_models, tiny_model, conds, latent,
                                                         tmp_path):
    from carnator_engine.hosts.comfyui import ComfyRunner

    def runner(model):
        return ComfyRunner(model, *conds, CFG, "euler", "simple", steps=STEPS)
    runners = {qtype: runner(model) for qtype, model in gguf_models.items()}
    plain = runner(tiny_model)                     # the same weights before quantization, from safetensors
    assert len({r.model_fingerprint for r in runners.values()} | {plain.model_fingerprint}) == 3
    for qtype, quantized in runners.items():
        assert "GGUF weights: " in quantized.model_text and f"{qtype} x " in quantized.model_text, quantized.model_text
        assert "GGUF" not in plain.model_text
    cache = open_cache(comfy, tmp_path / "cache")
    positive, negative = conds
    _, first = sample(comfy, gguf_models["Q6_K"], cache, positive, negative, latent)
    _, other = sample(comfy, gguf_models["Q8_0"], cache, nudged(positive), negative, latent)
    assert not other["reuse"] and not other["exact_repeat"]
    assert "differs in model/patches" in " ".join(other["reasons"]), other["reasons"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_a_gguf_region_step_gives_the_target_what_the_full_step_gives_it(comfy, plugin, gguf_models, conds, qtype):
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens
    from test_region_host import REGION_STEP, _corner, _full_then_region, _same_target
    model, shape = gguf_models[qtype], (1, 16, 5, 16, 16)
    runner = ComfyRunner(model, *conds, CFG, "euler", "simple", steps=STEPS, seed=SEED)
    target = _corner(runner, shape)
    full, part, rows, forwards = _full_then_region(runner, model, "blocks", shape,
                                                   RegionTokens(target, frozenset({REGION_STEP})))
    assert rows == [target.numel()] * forwards + [int(target.sum())] * forwards
    _same_target(runner, target, shape, full, part)
