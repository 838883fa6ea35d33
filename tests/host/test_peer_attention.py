"""Another node's attention implementation next to Carnator's attention hook: chained, not replaced.

- KJNodes' "GGUF Loader KJ" with attention_override "sdpa" sets transformer_options["optimized_attention_override"]
  (its "sageattn" choice is the same code path with SageAttention's kernel, which needs a CUDA GPU);
- a test-only override standing in for SageAttention on the CPU: its attention differs visibly from the default
  (it sharpens the softmax: q scaled by 1.25), so the results show whether it ran.
A miss equals plain sampling (KSampler) with that override, and on a hit the dense part of attention (cross-attention,
and self-attention where no sparse connectivity applies) still runs through it.
- KJNodes' "Patch Sage Attention KJ" replaces ComfyUI's attention function globally while the model runs, past the
  per-model hook: Carnator then generates plainly (no reuse) and the result equals KSampler with the patch. Its
  kernel is stood in for by a CPU module named `sageattention`, so that KJNodes' own code runs unchanged.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

import hostsetup
from conftest import CallCounter
from test_comfyui_host import CFG, SEED, STEPS, node, nudged, open_cache, sample


def ksampler(comfy, model, positive, negative, latent):
    return node(comfy, "KSampler").sample(model, SEED, STEPS, CFG, "euler", "simple", positive, negative,
                                          latent)[0]["samples"]


def close(a, b, tolerance=1e-5):
    return (a - b).abs().max().item() <= tolerance * max(1.0, b.abs().max().item())


class AttentionLog:
    """Counts the attention calls an override makes, split into self-attention (q and k of one length) and
    cross-attention."""

    def __init__(self):
        self.self_attention = self.cross_attention = 0

    def record(self, q, k, skip_reshape=False):
        token_dim = 2 if skip_reshape else 1
        if q.shape[token_dim] == k.shape[token_dim]:
            self.self_attention += 1
        else:
            self.cross_attention += 1

    def take(self) -> tuple:
        counts = (self.self_attention, self.cross_attention)
        self.self_attention = self.cross_attention = 0
        return counts


@pytest.fixture(scope="module")
def kjnodes(comfy, host_dirs):
    missing = hostsetup.peer_missing("ComfyUI-KJNodes")
    if missing:
        pytest.skip(missing)
    return hostsetup.load_kjnodes_model_patches(host_dirs["custom_nodes"])


def sharper_override(log: AttentionLog):
    """What an attention node installs (SageAttention's kernels differ from the default by their INT8 rounding, which
    is not smooth: a stand-in that is, so that a miss can be compared with KSampler to float precision)."""
    def override(func, q, k, v, *args, **kwargs):
        log.record(q, k, kwargs.get("skip_reshape", False))
        return func(q * 1.25, k, v, *args, **kwargs)
    override.carnator_fingerprint = "sharper attention (test)"
    return override


@pytest.mark.parametrize("sparse_attention", [True, False])
def test_a_sage_like_override_runs_on_a_miss_and_on_the_dense_part_of_a_hit(comfy, plugin, tiny_model, conds, latent,
                                                                            tmp_path, sparse_attention):
    log = AttentionLog()
    model = tiny_model.clone()
    model.model_options["transformer_options"]["optimized_attention_override"] = sharper_override(log)
    counted = CallCounter(model)
    positive, negative = conds
    reference = ksampler(comfy, model, positive, negative, latent)
    assert not close(reference, ksampler(comfy, tiny_model, positive, negative, latent))   # the override matters
    log.take()
    cache = open_cache(comfy, tmp_path / "cache")
    out, miss = sample(comfy, counted.model, cache, positive, negative, latent, sparse_attention=sparse_attention)
    assert close(out["samples"], reference) and log.take() == (2 * STEPS, 2 * STEPS)   # 2 blocks, every step
    counted.take()
    _, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent, sparse_attention=sparse_attention)
    assert hit["reuse"], hit["reasons"]
    steps_run = counted.take()
    self_attention, cross_attention = log.take()
    assert cross_attention == 2 * steps_run
    if sparse_attention:       # the blocks with a cached connectivity attend sparsely, by Carnator's kernel
        assert self_attention < 2 * steps_run
    else:
        assert self_attention == 2 * steps_run
    assert model.model_options["transformer_options"]["optimized_attention_override"].carnator_fingerprint


def test_kjnodes_gguf_loader_attention_override_is_chained(comfy, plugin, kjnodes, conds, latent, tmp_path,
                                                           host_dirs, monkeypatch):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install -r requirements-dev.txt)")
    missing = hostsetup.peer_missing("ComfyUI-GGUF")
    if missing:
        pytest.skip(missing)
    import comfy.ldm.modules.attention as attention
    # GGUF Loader KJ imports ComfyUI-GGUF by the module name ComfyUI's own custom_nodes folder gives it
    monkeypatch.setitem(sys.modules, "ComfyUI-GGUF", hostsetup.install_peer(comfy, host_dirs["custom_nodes"],
                                                                          "ComfyUI-GGUF"))
    name = hostsetup.build_tiny_wan_gguf(host_dirs["models"], "Q8_0")
    model = hostsetup.run_node(kjnodes.GGUFLoaderKJ, name, "none", "default", "default", False, False,
                               "sdpa").result[0]
    override = model.model_options["transformer_options"]["optimized_attention_override"]
    assert override is kjnodes.GGUFLoaderKJ.ATTENTION_OVERRIDES["sdpa"]
    log = AttentionLog()
    plain_sdpa = attention.attention_pytorch

    def counted_sdpa(*args, **kwargs):        # what KJNodes' "sdpa" override calls, counted
        log.record(args[0], args[1], kwargs.get("skip_reshape", False))
        return plain_sdpa.__wrapped__(*args, **kwargs)
    monkeypatch.setattr(attention, "attention_pytorch", types.SimpleNamespace(__wrapped__=counted_sdpa))

    counted = CallCounter(model)
    positive, negative = conds
    reference = ksampler(comfy, model, positive, negative, latent)
    log.take()
    cache = open_cache(comfy, tmp_path / "cache")
    out, miss = sample(comfy, counted.model, cache, positive, negative, latent)
    assert not miss["reuse"] and not miss.get("uncacheable") and close(out["samples"], reference)
    assert log.take() == (2 * STEPS, 2 * STEPS)
    counted.take()
    _, hit = sample(comfy, counted.model, cache, nudged(positive), negative, latent, sparse_attention=False)
    assert hit["reuse"], hit["reasons"]
    assert log.take() == (2 * counted.take(),) * 2


def test_kjnodes_global_sage_patch_is_generated_plainly(comfy, plugin, kjnodes, tiny_model, conds, latent, tmp_path,
                                                        monkeypatch):
    log = AttentionLog()

    def sageattn(q, k, v, is_causal=False, attn_mask=None, tensor_layout="NHD"):   # the kernel, on the CPU
        layout = (lambda t: t.transpose(1, 2)) if tensor_layout == "NHD" else (lambda t: t)
        log.record(layout(q), layout(k), skip_reshape=True)
        out = torch.nn.functional.scaled_dot_product_attention(layout(q), layout(k), layout(v), attn_mask=attn_mask)
        return layout(out)
    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    model = kjnodes.PathchSageAttentionKJ().patch(tiny_model, "auto")[0]
    positive, negative = conds
    reference = ksampler(comfy, model, positive, negative, latent)
    assert log.take() == (2 * STEPS, 2 * STEPS)
    cache = open_cache(comfy, tmp_path / "cache")
    for _ in range(2):       # the same request twice: each generated in full, nothing stored or reused
        out, summary = sample(comfy, model, cache, positive, negative, latent)
        assert close(out["samples"], reference) and log.take() == (2 * STEPS, 2 * STEPS)
        assert not summary["reuse"] and not summary["exact_repeat"] and summary["stored_as"] is None
        assert "PathchSageAttentionKJ" in summary["reasons"][0], summary["reasons"]


@pytest.mark.parametrize("patch", ["WanVideoEnhanceAVideoKJ", "WanVideoNAG"])
def test_kjnodes_attention_object_patches_are_generated_plainly(comfy, plugin, kjnodes, tiny_model, conds, latent,
                                                                tmp_path, patch):
    """KJNodes' Enhance-A-Video and NAG replace each block's attention forward with an object (an object patch) whose
    settings Carnator cannot read: each request is generated in full, equal to KSampler with the patch, nothing
    stored or reused."""
    positive, negative = conds
    model = (kjnodes.WanVideoEnhanceAVideoKJ().enhance(tiny_model, 2.0, latent)[0] if patch == "WanVideoEnhanceAVideoKJ"
             else kjnodes.WanVideoNAG().patch(tiny_model, negative, 11.0, 0.25, 2.5)[0])
    reference = ksampler(comfy, model, positive, negative, latent)
    cache = open_cache(comfy, tmp_path / "cache")
    for request in (positive, positive, nudged(positive)):
        out, summary = sample(comfy, model, cache, request, negative, latent)
        assert not summary["reuse"] and not summary["exact_repeat"] and summary["stored_as"] is None
        assert summary["reasons"][0].startswith("Carnator cannot compare the settings of "), summary["reasons"]
    assert close(sample(comfy, model, cache, positive, negative, latent)[0]["samples"], reference)
