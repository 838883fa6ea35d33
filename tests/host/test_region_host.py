"""Region-only resume through the real host, on every supported backbone's tiny model (ComfyUI's own classes).

A step run twice from the same latent, first every token (capturing the others' keys and values), then the target
tokens alone, gives the target region the same result: the token cut reaches every block argument with a token
axis (Wan's rope, HunyuanVideo's joint rope and text padding mask, LTX-Video's rope) and the attention of the target
still sees the whole clip. A hook on the first transformer block counts the rows it receives.
"""
from __future__ import annotations

import json

import pytest
import torch

import hostsetup
from test_comfyui_host import SEED, STEPS, nudged, open_cache, sample, sampler_output

REGION_STEP = 4


def _ltxv_model(comfy, directory):
    import comfy.ldm.modules.attention as attention
    model = comfy.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet(hostsetup.build_tiny_ltxv(directory), "default")[0]

    def masked_sdpa(func, *args, **kwargs):     # the CPU default (sub-quadratic) rejects LTXV's text mask
        return attention.attention_pytorch(*args, **kwargs)
    model.model_options["transformer_options"]["optimized_attention_override"] = masked_sdpa
    mask = {"attention_mask": torch.ones(1, 1, 128)}
    conds = ([[hostsetup.conditioning(1)[0][0][:, :128], dict(mask)]],
             [[hostsetup.conditioning(2)[0][0][:, :128], dict(mask)]])
    return model, conds, (1, 128, 3, 8, 8), "transformer_blocks"


def _backbone(comfy, name, directory):
    """(MODEL, (positive, negative), latent shape, attribute holding the blocks) of a tiny model."""
    load = comfy.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet
    if name == "wan2.1":
        model = load(hostsetup.build_tiny_wan(directory), "default")[0]
        return model, (hostsetup.conditioning(1), hostsetup.conditioning(2)), (1, 16, 5, 16, 16), "blocks"
    if name == "wan2.2-5b":
        model = load(hostsetup.build_tiny_wan(directory, seed=13, name=hostsetup.TINY_WAN22_5B, channels=48),
                     "default")[0]
        return model, (hostsetup.conditioning(1), hostsetup.conditioning(2)), (1, 48, 3, 8, 8), "blocks"
    if name == "hunyuan":
        model = load(hostsetup.build_tiny_hunyuan(directory), "default")[0]
        conds = (hostsetup.hunyuan_conditioning(1, padded=8), hostsetup.hunyuan_conditioning(2))
        return model, conds, (1, 16, 5, 16, 16), "double_blocks"
    return _ltxv_model(comfy, directory)


def _corner(runner, shape):
    """[L] token mask: a corner of the clip after its first frame."""
    grid = runner.layout.token_grid(shape)
    target = torch.zeros(grid, dtype=torch.bool)
    target[1:, : grid[1] // 2, 1:] = True
    return target.flatten()


def _full_then_region(runner, model, blocks, shape, region, full_plan=None):
    """One step run twice from the same latent: every token (capturing the others' keys and values, attending
    through `full_plan` if given), then the target tokens alone. (full, part, rows the first block received per
    forward, forwards of each run)."""
    from carnator_engine.observer import GenerationObserver
    sigma = float(runner.sigmas[REGION_STEP])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * sigma
    rows = []
    first = getattr(model.model.diffusion_model, blocks)[0]
    handle = first.register_forward_pre_hook(
        lambda module, args, kwargs: rows.append(int((args[0] if args else kwargs.get("img", kwargs.get("x"))).shape[1])),
        with_kwargs=True)
    try:
        full_observer = GenerationObserver(region=region, sparse=full_plan)
        full = runner.run(x, runner.sigmas, REGION_STEP, REGION_STEP + 1, full_observer)
        assert region.keys_values and not region.active
        region.full_steps = frozenset()                   # the same step again, now as a region step
        part_observer = GenerationObserver(region=region)
        part = runner.run(x, runner.sigmas, REGION_STEP, REGION_STEP + 1, part_observer)
        assert region.active and not region.missing
    finally:
        handle.remove()
    assert full_observer.forwards == part_observer.forwards >= 1
    return full, part, rows, full_observer.forwards


def _same_target(runner, target, shape, full, part):
    from carnator_engine.region import latent_mask_of_tokens
    inside = latent_mask_of_tokens(runner.layout, target, shape[-3:])
    scale = float(full.abs().max())
    assert (part[..., inside] - full[..., inside]).abs().max() <= 1e-4 * max(1.0, scale)
    assert torch.isfinite(part).all()


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("name", ["wan2.1", "wan2.2-5b", "hunyuan", "ltxv"])
def test_a_region_step_gives_the_target_what_the_full_step_gives_it(comfy, plugin, host_dirs, name, cfg):
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens
    model, (positive, negative), shape, blocks = _backbone(comfy, name, host_dirs["models"])
    runner = ComfyRunner(model, positive, negative, cfg, "euler", "simple", steps=STEPS, seed=SEED)
    target = _corner(runner, shape)
    full, part, rows, forwards = _full_then_region(runner, model, blocks, shape,
                                                   RegionTokens(target, frozenset({REGION_STEP})))
    kept, length = int(target.sum()), target.numel()
    assert rows == [length] * forwards + [kept] * forwards           # the region step: the target rows only
    _same_target(runner, target, shape, full, part)


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2-5b", "hunyuan", "ltxv"])
def test_a_region_step_with_sparse_keys_gives_the_target_the_masked_full_steps_result(comfy, plugin, host_dirs,
                                                                                       name):
    """region_sparse_keys: with a cached table in which every query block reaches the first key block and itself,
    the region step's target equals a full step whose target queries attend to the key blocks they reach alone
    (HunyuanVideo's text queries to every key, as its target's to the text). Without text rows, only the reached
    rows are kept."""
    from carnator_engine.attention.connectivity import reached_key_rows
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens
    from test_region_sparse_keys import reference_plan, sink_tables
    model, (positive, negative), shape, blocks = _backbone(comfy, name, host_dirs["models"])
    runner = ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=STEPS, seed=SEED)
    target, block_size = _corner(runner, shape), 8
    reach = reached_key_rows(sink_tables(target.numel() // block_size, range(64), block_size), target)
    assert all(int(target.sum()) < len(rows) < target.numel() for rows in reach.values())
    region = RegionTokens(target, frozenset({REGION_STEP}), reach=reach)
    full, part, _, _ = _full_then_region(runner, model, blocks, shape, region,
                                         reference_plan(reach, target, block_size))
    _same_target(runner, target, shape, full, part)
    reached = len(next(iter(reach.values())))
    kept_rows = {held[0].shape[2] for held in region.keys_values._held.values()}
    if name == "hunyuan":     # its text queries attend to every key: every row kept, the text's after the video
        assert all(rows > target.numel() for rows in kept_rows)
    else:
        assert kept_rows == {reached}


def test_the_sampler_node_says_how_a_hit_resumed(comfy, plugin, tiny_model, conds, latent, tmp_path):
    cache = open_cache(comfy, tmp_path / "cache")
    positive, negative = conds
    _, miss = sample(comfy, tiny_model, cache, positive, negative, latent, region_only=True)
    assert not miss["reuse"]
    out = sampler_output(comfy, tiny_model, cache, nudged(positive), negative, latent, region_only=True)
    hit = json.loads(out.result[1])
    assert hit["reuse"] and "region_only" in hit["numbers"] and not hit["warnings"]
    said = [reason for reason in hit["reasons"] if "region-only" in reason or "whole-clip resume" in reason]
    assert said and ("whole-clip resume" in said[-1]) != hit["numbers"]["region_only"]
    # the node's own text says it: region-only on a share of the clip, or why the whole clip was resumed
    shown = hostsetup.shown_text(out)
    assert hit["region"].startswith("region-only on" if hit["numbers"]["region_only"] else "whole clip: ")
    assert shown.startswith("Carnator HIT") and f"; {hit['region']}; " in shown


def test_two_experts_recapture_the_other_tokens_at_the_switch(comfy, plugin, host_dirs):
    """Wan 2.2 A14B: the low-noise expert's keys differ from the high-noise expert's, so its first step runs every
    token again and the region steps after it attend to its own keys."""
    from carnator_engine import resume as resume_stage
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.pipeline import CarnatorConfig
    from carnator_engine.region import RegionTokens
    from test_two_experts import HIGH, LOW, load
    hostsetup.build_tiny_wan(host_dirs["models"], seed=11, name=HIGH)
    hostsetup.build_tiny_wan(host_dirs["models"], seed=12, name=LOW)
    high, low = load(comfy, HIGH), load(comfy, LOW)
    positive, negative = hostsetup.conditioning(1), hostsetup.conditioning(2)
    runner = ComfyRunner(high, positive, negative, 3.0, "euler", "simple", steps=STEPS, seed=SEED,
                         low_noise_model=low, switch_step=6)
    decision = type("Decision", (), {"resume_step": 3, "steps": STEPS})()
    full = resume_stage._full_steps(runner, decision, CarnatorConfig(region_refresh_steps=0), None)
    assert full == {3, 6}
    shape = (1, 16, 5, 16, 16)
    target = torch.zeros(runner.layout.token_grid(shape), dtype=torch.bool)
    target[:, :4] = True
    region = RegionTokens(target.flatten(), full)
    modes = []
    original = region.begin_step

    def begin_step(step):
        original(step)
        modes.append((step, region.capturing, region.active))
    region.begin_step = begin_step
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * float(runner.sigmas[3])
    out = runner.run(x, runner.sigmas, 3, 9, GenerationObserver(region=region))
    assert modes == [(3, True, False), (4, False, True), (5, False, True), (6, True, False), (7, False, True),
                     (8, False, True)]
    assert torch.isfinite(out).all() and not region.missing


# a gate loose enough that every tiny random model takes the nudged request as a hit; the target cell threshold
# stays the preset's (0.35), under which these models mark no cell at all
LOOSE = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, max_context_share=10.0, max_target_fraction=1.0,
             max_resume_fraction=0.9, refine_target=False, shrink_with_risk=False)


AMPLITUDE = 0.1


def corner_requests(runner, shape, directory) -> tuple:
    """(the first request's result, the result of the same request with its noise nudged in one corner of every
    frame), through the whole pipeline on a fresh store at `directory`, with region-only resume and loose limits."""
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(SEED))
    nudge = noise.clone()
    rows, cols = shape[-2] // 4, shape[-1] // 4
    nudge[..., :rows, :cols] += AMPLITUDE * torch.randn(*shape[:-2], rows, cols,
                                                        generator=torch.Generator().manual_seed(7))
    config = CarnatorConfig(probe_steps=2, block_size=16, region_only=True, region_max_share=0.9,
                            gate_overrides=dict(LOOSE))
    store = CarnatorStore(str(directory), 1 << 30)
    try:
        return tuple(generate(runner, x, runner.sigmas, store, config, "a corner", SEED) for x in (noise, nudge))
    finally:
        store.close()


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2-5b", "hunyuan", "ltxv"])
def test_a_nudge_that_touches_one_region_resumes_region_only(comfy, plugin, host_dirs, tmp_path, name):
    """The region-only target carries across models: a request whose noise is nudged in one corner of every frame
    (too little for the gate's absolute cell threshold to mark any cell) resumes region-only on about that corner,
    neither nothing nor the whole clip."""
    from carnator_engine.hosts.comfyui import ComfyRunner
    model, (positive, negative), shape, _ = _backbone(comfy, name, host_dirs["models"])
    runner = ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=STEPS, seed=SEED)
    first, hit = corner_requests(runner, shape, tmp_path / "cache")
    decision = hit.decision
    assert not first.decision.reuse and decision.reuse and decision.numbers["target_fraction"] == 0      # the gate's threshold marks nothing
    assert decision.numbers["region_only"], decision.reasons
    assert 0 < decision.numbers["region_share"] <= 0.6
    from carnator_engine.pipeline import CarnatorConfig
    from carnator_engine.resume import region_latent_cells
    cells = region_latent_cells(decision, shape[-3:], CarnatorConfig().region_target_mass)
    assert cells[:, : max(1, shape[-2] // 4), : max(1, shape[-1] // 4)].all()   # the corner is in it


def test_the_kept_keys_budget_reads_comfyuis_free_memory(comfy, plugin, tiny_model, conds, monkeypatch):
    """Under ComfyUI the region-only budget takes the free GPU memory from ComfyUI's model management (what its
    own loading decisions use), not from torch alone."""
    import comfy.model_management
    from carnator_engine.hosts.comfyui import ComfyRunner
    asked = []
    monkeypatch.setattr(comfy.model_management, "get_free_memory", lambda device=None, *a, **k: asked.append(device)
                        or 123 << 20)
    positive, negative = conds
    runner = ComfyRunner(tiny_model, positive, negative, 1.0, "euler", "simple", steps=STEPS, seed=SEED)
    assert runner.memory.free(torch.device("cuda", 0)) == 123 << 20 and asked == [torch.device("cuda", 0)]


@pytest.mark.parametrize("name", ["wan2.1", "wan2.2-5b", "hunyuan", "ltxv"])
def test_a_region_step_with_8_bit_kept_keys_gives_the_target_nearly_the_full_steps_result(comfy, plugin, host_dirs,
                                                                                          name):
    """CarnatorConfig.region_kv_8bit through each backbone's host attention: the kept keys and values come back in the
    model's dtype and memory order, within the rows' quantization error of the full step's result (not equal to it:
    the 8 bits are used)."""
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens, latent_mask_of_tokens
    model, (positive, negative), shape, blocks = _backbone(comfy, name, host_dirs["models"])
    runner = ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=STEPS, seed=SEED)
    target = _corner(runner, shape)
    full, part, _, _ = _full_then_region(runner, model, blocks, shape,
                                         RegionTokens(target, frozenset({REGION_STEP}), eight_bit=True))
    inside = latent_mask_of_tokens(runner.layout, target, shape[-3:])
    error = float((part[..., inside] - full[..., inside]).abs().max())
    assert 0 < error <= 2e-2 * max(1.0, float(full.abs().max()))


@pytest.mark.parametrize("chained", [False, True])
def test_region_fa4_stands_in_only_for_the_hosts_own_sdpa(comfy, plugin, host_dirs, monkeypatch, chained):
    """CarnatorConfig.region_fa4: a region step's target attention runs on attention.fa4.dense where it runs (here a
    stand-in computing torch's SDPA: the CPU has no FA4) when ComfyUI attends with its own SDPA (attention_pytorch,
    as on a GPU); under another node's attention override that node's kernel stays. The full step never uses it."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    from carnator_engine.attention import fa4
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.region import RegionTokens
    calls = []

    def stand_in(q, k, v, scale=None):
        calls.append((q.shape[2], k.shape[2]))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    monkeypatch.setattr(fa4, "supports", lambda q, block_size=fa4.KERNEL_BLOCK: True)
    monkeypatch.setattr(fa4, "dense", stand_in)
    monkeypatch.setattr(wan, "optimized_attention", attention.attention_pytorch)
    model, (positive, negative), shape, blocks = _backbone(comfy, "wan2.1", host_dirs["models"])
    if chained:
        def other_node(func, *args, **kwargs):
            return func(*args, **kwargs)
        model.model_options["transformer_options"]["optimized_attention_override"] = other_node
    runner = ComfyRunner(model, positive, negative, 1.0, "euler", "simple", steps=STEPS, seed=SEED)
    target = _corner(runner, shape)
    full, part, _, forwards = _full_then_region(runner, model, blocks, shape,
                                                RegionTokens(target, frozenset({REGION_STEP}), fa4=True))
    _same_target(runner, target, shape, full, part)
    layers = len(getattr(model.model.diffusion_model, blocks))
    expected = [] if chained else [(int(target.sum()), target.numel())] * (layers * forwards)
    assert calls == expected
