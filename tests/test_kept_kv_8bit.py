"""The kept keys and values of a region-only resume in 8 bits (CarnatorConfig.region_kv_8bit): each row (a token of
a head) as int8 with a float32 scale, within half a quantization step of the original, in the model's own memory
order; about half the bytes kept and streamed; the plan counting their dequantized copy; a hit the same whether the
blocks are streamed or resident, and close to the 16-bit one. The host's real attention: tests/host/test_region_host.py.
"""
import pytest
import torch

from carnator_engine import kept_kv
from carnator_engine import resume as resume_stage
from carnator_engine.kept_kv import (GIB, KeptKeysValues, MemoryReading, dequantize_rows, empty_in_layout, placement,
                                     quantize_rows)
from carnator_engine.observer import GenerationObserver
from carnator_engine.pipeline import CarnatorConfig
from test_kept_kv import MIB, FakeMemory
from test_region_resume import _hit


def _token_major(tokens=50, heads=3, dim=16, seed=0):
    """[1, heads, tokens, dim] keys as a host's attention sees them: a view of a [1, tokens, heads x dim] projection,
    one channel an outlier, one row all zeros."""
    x = torch.randn(1, tokens, heads * dim, generator=torch.Generator().manual_seed(seed))
    x[..., 5] *= 20
    x[:, 7] = 0
    return x.view(1, tokens, heads, dim).transpose(1, 2)


def test_quantized_rows_are_within_half_a_step_in_the_keys_memory_order(monkeypatch):
    x = _token_major()
    values, scales = quantize_rows(x)
    assert values.dtype == torch.int8 and values.stride() == x.stride() and scales.shape == (1, 3, 50, 1)
    assert scales.stride() == empty_in_layout(x[..., :1]).stride() == (150, 1, 3, 1)    # token-major, as x
    step = x.abs().amax(dim=-1, keepdim=True) / 127
    assert torch.allclose(scales, step) and bool((values.abs() <= 127).all())
    back = dequantize_rows(values, scales, torch.float32)
    assert back.stride() == x.stride() and bool(((back - x).abs() <= step / 2 + 1e-6).all())
    assert bool((back[:, :, 7] == 0).all())                           # a zero row stays zero, no NaN
    monkeypatch.setattr(kept_kv, "QUANTIZE_CHUNK", 100)                # a handful of rows at a time: the same
    chunked = quantize_rows(x)
    assert torch.equal(chunked[0], values) and torch.equal(chunked[1], scales)


def test_empty_in_layout_keeps_the_memory_order_of_its_model():
    token_major = _token_major()
    assert empty_in_layout(token_major).stride() == token_major.stride()
    contiguous = torch.randn(2, 3, 4, 5)
    assert empty_in_layout(contiguous, torch.int8).is_contiguous()
    assert empty_in_layout(contiguous.permute(3, 1, 0, 2)).stride() == contiguous.permute(3, 1, 0, 2).stride()


def test_16_bit_kept_keys_keep_the_hosts_memory_order():
    """Viewable as the host's [B, L, heads x D] without a copy per block (ComfyUI's attention takes that shape)."""
    k = _token_major()
    kept = KeptKeysValues(FakeMemory(reading=None))
    assert kept.capture((0, 0), k, k + 1) is None and kept.plan(0.5) is None
    keys, values = kept.fetch((0, 0))
    assert torch.equal(keys, k) and keys.transpose(1, 2).is_contiguous() and values.transpose(1, 2).is_contiguous()


def test_8_bit_kept_keys_take_about_half_the_bytes_and_come_back_in_their_own_dtype():
    k = _token_major(dim=64)
    kept = KeptKeysValues(FakeMemory(reading=None), eight_bit=True)
    assert kept.capture((0, 0), k, -k) is None and kept.plan(0.5) is None
    rows = k.numel() // k.shape[-1]
    assert kept.placed == {"resident": 2 * (k.numel() + 4 * rows), "streamed": 0}   # vs 2 x 4 x numel in float32
    keys, values = kept.fetch((0, 0))
    assert keys.dtype == k.dtype and keys.stride() == k.stride()
    step = k.abs().amax(dim=-1, keepdim=True) / 127
    assert bool(((keys - k).abs() <= step / 2 + 1e-6).all()) and bool(((values + k).abs() <= step / 2 + 1e-6).all())
    keys.zero_()                                                         # a step's rows written into what it fetched
    assert torch.equal(kept.fetch((0, 0))[0], dequantize_rows(*quantize_rows(k), k.dtype))   # never into the kept


def test_the_plan_counts_the_dequantized_keys_and_values_beside_the_kept_ones(monkeypatch):
    order, sizes = list(range(20)), {key: 100 * MIB for key in range(20)}
    reading = MemoryReading(in_use=4 * GIB, high_water=5 * GIB, free=70 * GIB)
    alone, _ = placement(order, sizes, reading, share=0.0, margin=0.05)
    working, _ = placement(order, sizes, reading, share=0.0, margin=0.05, working=400 * MIB)
    assert len(working) == len(alone) - 3                                  # 300 MiB more than one block's copy
    asked = []
    monkeypatch.setattr(kept_kv, "placement", lambda *args: (asked.append(args[5]), (set(), None))[1])   # working
    k = torch.randn(1, 2, 8, 4, dtype=torch.bfloat16)
    for eight_bit, expected in ((False, None), (True, 2 * 2 * k.numel() * 2)):
        kept = KeptKeysValues(FakeMemory(reading=reading), eight_bit=eight_bit)
        kept.capture((0, 0), k, k)
        kept.plan(0.1)
        assert asked[-1] == expected      # 8 bits: the dequantized keys and values and the attention's copy of them


@pytest.mark.parametrize("streamed", [False, True])
def test_an_8_bit_hit_is_the_same_streamed_or_resident_and_close_to_the_16_bit_one(live_tiny_model, store, monkeypatch,
                                                                                   streamed):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    payload = store.trajectory(store.record(decision.entry_id))
    decision, _, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    assert decision.numbers["region_only"]

    def run(eight_bit):
        on = CarnatorConfig(**{**config.__dict__, "region_kv_8bit": eight_bit})
        _, region, _ = resume_stage.plan_region(runner, probed, decision, payload, on)
        assert region.keys_values.eight_bit == eight_bit
        out = resume_stage.follow_entry(runner, probed, decision, payload, on, GenerationObserver(), region)
        assert not region.fallback and not region.missing and region.region_steps_run > 0
        return out

    sixteen, resident = run(False), run(True)
    if streamed:                      # every block through the two stream buffers (host copies on the CPU)
        monkeypatch.setattr(kept_kv, "placement", lambda order, *args: (set(), None))
        runner.memory = FakeMemory(reading=MemoryReading(0, 0, 0))
        assert torch.equal(run(True), resident)
    error = float((resident - sixteen).norm() / sixteen.norm())
    assert 0 < error < 1e-2


def test_a_default_region_only_hit_keeps_them_in_8_bits_dequantized_by_the_kernel(live_tiny_model, store):
    """Both on by default since measured (docs/region-resume.md#why-it-is-on-by-default and #8-bit-keys-and-values);
    off, the model's dtype and torch's dequantize."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_max_share=1.0)   # region settings unset
    payload = store.trajectory(store.record(decision.entry_id))
    for setting, eight_bit, kernel in (({}, True, True), ({"region_kv_8bit": False}, False, True),
                                       ({"region_kv_triton": False}, True, False)):
        _, region, _ = resume_stage.plan_region(runner, probed, decision, payload,
                                                CarnatorConfig(**{**config.__dict__, **setting}))
        assert region is not None and (region.keys_values.eight_bit, region.keys_values.kernel) == (eight_bit, kernel)


def test_region_kv_8bit_is_validated_with_the_fix():
    with pytest.raises(ValueError, match="region_kv_8bit must be True or False"):
        CarnatorConfig(region_kv_8bit="yes").validate(10)
