"""A region-only hit keeps the untouched part of the clip as the cached generation made it.

The creator's edit of docs/region-resume.md's fidelity table, through the real host on the tiny Wan 2.1: a base
prompt plus a second prompt on a 48x48 corner (ConditioningSetMask); the edit changes only the corner's prompt. The
region-only hit's final latent is compared, outside its region, with the cached clip, and whole with plain sampling of
the edit and with a whole-clip hit of the same request.
"""
from __future__ import annotations

import math

import pytest
import torch

import hostsetup
from test_comfyui_host import SEED

STEPS, PROBE = 20, 2
SHAPE = (1, 16, 5, 16, 16)      # 128x128 pixels, 17 frames


def _masked(comfy, corner_seed: int):
    mask = torch.zeros(1, 128, 128)
    mask[:, :48, :48] = 1
    corner = comfy.NODE_CLASS_MAPPINGS["ConditioningSetMask"]().append(hostsetup.conditioning(corner_seed), mask,
                                                                       "default", 1.0)[0]
    return comfy.NODE_CLASS_MAPPINGS["ConditioningCombine"]().combine(hostsetup.conditioning(1), corner)[0]


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return 10 * math.log10(float(b.abs().max()) ** 2 / max(float(((a - b) ** 2).mean()), 1e-20))


@pytest.mark.parametrize("cfg, shift", [(5.0, None), (1.0, 3.0)])
def test_a_region_only_hit_leaves_the_rest_of_the_clip_as_the_cached_generation(comfy, plugin, tiny_model, tmp_path,
                                                                                cfg, shift):
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.region import latent_mask_of_tokens
    from carnator_engine.store import CarnatorStore
    model = tiny_model if shift is None else comfy.NODE_CLASS_MAPPINGS["ModelSamplingSD3"]().patch(tiny_model,
                                                                                                 shift)[0]
    negative = hostsetup.conditioning(2)
    cached_request = ComfyRunner(model, _masked(comfy, 3), negative, cfg, "euler", "simple", steps=STEPS, seed=SEED)
    edit = ComfyRunner(model, _masked(comfy, 4), negative, cfg, "euler", "simple", steps=STEPS, seed=SEED)
    noise = torch.randn(SHAPE, generator=torch.Generator().manual_seed(SEED))

    def run(name, runner, **settings):
        store = CarnatorStore(str(tmp_path / name), 1 << 30)
        try:
            config = CarnatorConfig(probe_steps=PROBE, **settings)
            cached = generate(cached_request, noise, cached_request.sigmas, store, config).latent
            store.writer.settle()
            return cached, generate(runner, noise, runner.sigmas, store, config)
        finally:
            store.close()
    plain = generate(edit, noise, edit.sigmas, CarnatorStore(str(tmp_path / "plain"), 1 << 30),
                     CarnatorConfig(probe_steps=PROBE)).latent              # a miss: KSampler's result
    cached, region = run("region", edit, region_only=True)
    _, whole = run("whole", edit, region_only=False)
    assert region.decision.reuse and region.decision.numbers["region_only"], region.decision.reasons
    assert whole.decision.reuse and whole.decision.resume_step == region.decision.resume_step
    assert 0 < region.decision.numbers["region_share"] < 0.5

    from carnator_engine.region import target_tokens
    from carnator_engine.resume import REGION_HALO, region_latent_cells
    cells = region_latent_cells(region.decision, SHAPE[-3:], CarnatorConfig().region_target_mass)
    computed = latent_mask_of_tokens(edit.layout, target_tokens(edit.layout, cells, REGION_HALO), SHAPE[-3:])
    outside = ~computed
    # outside the region (its ring excluded): the cached clip itself, where a whole-clip hit is only near it
    assert torch.equal(region.latent[..., outside], cached[..., outside])
    assert float((whole.latent - cached)[..., outside].abs().max()) > 0
    # inside: the edit, not the cached clip
    inside = latent_mask_of_tokens(edit.layout, target_tokens(edit.layout, cells, (0, 0, 0)), SHAPE[-3:])
    assert float(((region.latent - plain)[..., inside] ** 2).mean()) < float(((cached - plain)[..., inside] ** 2).mean())
    # the whole result: within 3 dB of the whole-clip hit's distance to plain sampling of the edit
    assert _psnr(region.latent, plain) >= _psnr(whole.latent, plain) - 3.0


def test_through_the_staged_chain_a_region_only_hit_leaves_the_rest_as_the_cached_clip(comfy, plugin, tiny_model,
                                                                                     tmp_path):
    """The same edit through the staged nodes (Early Probe -> Signature Cache Lookup -> Compatibility Gate ->
    Trajectory Resume with region_only on), as ComfyUI's executor runs them."""
    import json
    from carnator_engine.pipeline import CarnatorConfig
    from carnator_engine.region import latent_mask_of_tokens, target_tokens
    from carnator_engine.resume import REGION_HALO, region_latent_cells
    from test_comfyui_host import node, open_cache
    cache = open_cache(comfy, tmp_path / "cache")
    negative, latent = hostsetup.conditioning(2), hostsetup.empty_video_latent(comfy)

    def staged(positive, region_only):
        probe = node(comfy, "CarnatorEarlyProbe")(tiny_model, positive, negative, latent, SEED, STEPS, 5.0, "euler",
                                                  "simple", PROBE, 64)[0]
        matches = node(comfy, "CarnatorSignatureCacheLookup")(cache, probe, 3).result[0]
        decision = node(comfy, "CarnatorCompatibilityGate")(probe, matches, "balanced").result[0]
        out = node(comfy, "CarnatorTrajectoryResume")(cache, probe, decision, True, region_only=region_only)
        cache.writer.settle()
        return out.result[0]["samples"], json.loads(out.result[1]), decision.decision
    cached, first, _ = staged(_masked(comfy, 3), False)
    edited, summary, decision = staged(_masked(comfy, 4), True)
    assert not first["reuse"] and summary["reuse"] and summary["numbers"]["region_only"], summary["reasons"]
    fhw = tuple(cached.shape[-3:])
    from carnator_engine.hosts.comfyui import ComfyRunner
    runner = ComfyRunner(tiny_model, _masked(comfy, 4), negative, 5.0, "euler", "simple", steps=STEPS, seed=SEED)
    cells = region_latent_cells(decision, fhw, CarnatorConfig().region_target_mass)
    outside = ~latent_mask_of_tokens(runner.layout, target_tokens(runner.layout, cells, REGION_HALO), fhw)
    assert bool(outside.any())
    # the node's latent is in the latent format ComfyUI stores; the cached clip came out of the same node
    assert torch.equal(edited[..., outside], cached[..., outside])
    assert not torch.equal(edited[..., ~outside], cached[..., ~outside])
