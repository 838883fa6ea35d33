"""The kept keys and values of a region-only resume within a memory budget: the placement's accounting, the same result
whether blocks are resident or streamed through the two buffers, and every memory fallback (not even streaming fits,
no host memory, a region step out of memory) ending as whole-clip resume with its reason, never a failed request."""
import dataclasses

import pytest
import torch

from carnator_engine import kept_kv
from carnator_engine import resume as resume_stage
from carnator_engine.hosts.compiled import region_only_unfit
from carnator_engine.kept_kv import GIB, RESERVE, KeptKeysValues, MemoryReading, placement
from carnator_engine.observer import GenerationObserver
from carnator_engine.pipeline import CarnatorConfig, resume
from test_region_resume import PROMPT, STEPS, _hit

MIB = 1 << 20


class FakeMemory:
    """A device memory reading and a host's available memory, as a test sets them."""

    def __init__(self, reading=None, host=64 * GIB):
        self.reading, self.host = reading, host
        self.reads = 0

    def read(self, device):
        self.reads += 1
        return self.reading

    def host_available(self):
        return self.host


def test_blocks_are_resident_while_they_fit_under_the_high_water_mark_and_streamed_beyond():
    order = list(range(20))
    sizes = {key: 100 * MIB for key in order}
    # 4 GiB in use, a full step peaked at 5 GiB: 5 % margin -> 5.25 GiB; a 10 % region step takes 0.1 GiB of it
    reading = MemoryReading(in_use=4 * GIB, high_water=5 * GIB, free=70 * GIB)
    resident, why = placement(order, sizes, reading, share=0.1, margin=0.05)
    room = 5.25 * GIB - 4 * GIB - 0.1 * GIB - 100 * MIB     # less the attention's copy of one block
    assert not why and len(resident) == int((room - 200 * MIB) // (100 * MIB)) and resident == set(range(len(resident)))
    everything, _ = placement(order, sizes, reading, share=0.1, margin=1.0)
    assert everything == set(order)
    # the host's free memory caps the ceiling below the high-water mark
    tight = dataclasses.replace(reading, free=RESERVE + 350 * MIB)
    resident, why = placement(order, sizes, tight, share=0.0, margin=1.0)
    assert not why and resident == set()                     # room for the two stream buffers only
    none, why = placement(order, sizes, dataclasses.replace(reading, free=RESERVE + 250 * MIB), share=0.0, margin=1.0)
    assert none is None and why.note == "not enough GPU memory for region-only resume" \
        and why.reason.startswith(why.note + ": streaming the kept keys and values needs") \
        and why.reason.endswith("whole-clip resume")


def test_off_cuda_the_kept_keys_stay_where_they_are():
    store = KeptKeysValues(FakeMemory(reading=None))
    k = torch.randn(1, 2, 6, 4)
    assert store.capture((0, 0), k, k + 1) is None
    assert store.plan(0.5) is None and store.placed == {"resident": 2 * k.numel() * 4, "streamed": 0}
    keys, values = store.fetch((0, 0))
    assert torch.equal(keys, k) and torch.equal(values, k + 1)
    assert store.fetch((1, 0)) is None


@pytest.mark.parametrize("resident", [set(), {(0, 0)}])
def test_streamed_blocks_give_the_same_hit_as_resident_ones(live_tiny_model, store, monkeypatch, resident):
    """The two-buffer stream (prefetching the next block while one attends) against every block resident: the same
    latent, with every block (or all but one) streamed."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    payload = store.trajectory(store.record(decision.entry_id))
    decision, _, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    assert decision.numbers["region_only"]

    def run(placed):
        _, region, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
        out = resume_stage.follow_entry(runner, probed, decision, payload, config, GenerationObserver(), region)
        return out, region, placed(region)

    whole, region, _ = run(lambda region: None)
    assert not region.fallback and not region.missing
    monkeypatch.setattr(kept_kv, "placement", lambda order, *args: (set(resident), ""))
    runner.memory = FakeMemory(reading=MemoryReading(0, 0, 0))
    loads = []
    original = KeptKeysValues._load
    monkeypatch.setattr(KeptKeysValues, "_load", lambda self, key, index: (loads.append(key),
                                                                           original(self, key, index))[1])
    streamed, region, _ = run(lambda region: None)
    assert not region.fallback and not region.missing and runner.memory.reads == len(region.full_steps)   # a plan each
    blocks = len(live_tiny_model.blocks)
    assert loads and not set(loads) & resident and len({key for key in loads}) == blocks - len(resident)
    assert torch.allclose(streamed, whole, rtol=1e-5, atol=1e-5)
    numbers = resume(runner, probed, decision, store, config, PROMPT, 2).decision.numbers
    assert numbers["region_only"] and numbers["region_streamed_bytes"] > 0
    assert numbers["region_resident_bytes"] == numbers["region_streamed_bytes"] // (blocks - 1) * len(resident)


def _whole_clip(runner, probed, decision, payload, config):
    """Whole-clip resume of the target a region-only resume of this hit would take."""
    decision, _, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    return resume_stage.follow_entry(runner, probed, decision, payload, config, GenerationObserver())


def test_a_hit_whose_kept_keys_do_not_fit_even_streamed_resumes_whole_clip_with_the_reason(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    whole = _whole_clip(runner, probed, decision, store.trajectory(store.record(decision.entry_id)), config)
    runner.memory = FakeMemory(reading=MemoryReading(in_use=GIB, high_water=GIB, free=0))
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    d = result.decision
    assert d.reuse and d.numbers["region_only"] is False and d.numbers["region_steps"] == 0
    assert d.reasons[-1].startswith("not enough GPU memory for region-only resume")
    assert d.region == "whole clip: not enough GPU memory for region-only resume"
    assert d.expected_speedup == STEPS / d.model_calls      # the node's estimate is the whole clip's again
    assert torch.allclose(result.latent, whole, rtol=1e-5, atol=1e-5)


def test_a_hit_without_host_memory_for_the_kept_keys_resumes_whole_clip(live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    runner.memory = FakeMemory(host=0)
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    assert result.decision.numbers["region_only"] is False
    assert result.decision.reasons[-1].startswith("not enough host memory to keep the other tokens' keys and values")
    assert result.decision.region == "whole clip: not enough host memory to keep the other tokens' keys and values"


def test_the_kept_keys_take_at_most_half_of_the_host_memory_a_run_began_with():
    """The host keeps the other half (ComfyUI offloads models there); on CUDA, pinned memory that torch keeps cached
    from an earlier run counts as available to the next, which reuses it."""
    k = torch.zeros(1, 2, 256, 64)                     # 2 x 128 KiB per block
    block = 2 * k.numel() * k.element_size()
    kept = KeptKeysValues(FakeMemory(host=int(4.5 * block / kept_kv.HOST_SHARE)))
    assert all(kept.capture((b, 0), k, k) is None for b in range(4))
    why = kept.capture((4, 0), k, k)
    assert why.note == "not enough host memory to keep the other tokens' keys and values"
    assert "50% of what the host has available" in why.reason and why.reason.endswith("whole-clip resume")
    kept.release()                                     # a new run reads the host afresh
    assert kept.capture((0, 0), k, k) is None and kept._host_budget == int(4.5 * block)
    # on CUDA, what earlier runs pinned and torch keeps cached counts as available
    assert kept_kv.host_budget(available=10 * GIB, cached=6 * GIB) == int(kept_kv.HOST_SHARE * 16 * GIB)


def test_a_host_that_will_not_pin_more_memory_gives_a_whole_clip_reason_not_an_error(monkeypatch):
    def refuse(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory\nmore lines")
        return torch.zeros(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", refuse)
    k = torch.zeros(1, 2, 8, 4)

    class OnCuda:
        """k, said to be on a CUDA device."""
        device = torch.device("cuda")

        def __getattr__(self, name):
            return getattr(k, name)

        def detach(self):
            return self
    on_cuda = OnCuda()
    kept = KeptKeysValues(FakeMemory())
    why = kept.capture((0, 0), on_cuda, on_cuda)
    assert why.note == "not enough host memory to keep the other tokens' keys and values"
    assert why.reason.endswith("failed: CUDA error: out of memory); whole-clip resume") and len(kept) == 0


class Cancelled(Exception):
    """What a host's cancel looks like to the engine (ComfyUI's InterruptProcessingException): no RuntimeError."""


@pytest.mark.parametrize("fault", ["out of memory", "a fault of the region path", "a cancel"])
def test_a_region_step_that_fails_resumes_the_whole_clip_from_the_resume_step(live_tiny_model, store, monkeypatch,
                                                                             fault):
    """Never a failed request: out of GPU memory, or any other error of the region steps (said as a warning too),
    the hit resumes the whole clip from step k; a cancel goes through."""
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    whole = _whole_clip(runner, probed, decision, store.trajectory(store.record(decision.entry_id)), config)
    original = type(runner).run
    error = {"out of memory": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore"),
             "a fault of the region path": RuntimeError("shape mismatch in block 3"),
             "a cancel": Cancelled("cancelled")}[fault]

    def run(self, x, sigmas, start, end, observer):
        if observer.region is not None:
            raise error
        return original(self, x, sigmas, start, end, observer)
    monkeypatch.setattr(type(runner), "run", run)
    if fault == "a cancel":
        with pytest.raises(Cancelled):
            resume(runner, probed, decision, store, config, PROMPT, 2)
        return
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    d = result.decision
    assert d.reuse and d.numbers["region_only"] is False
    assert torch.allclose(result.latent, whole, rtol=1e-5, atol=1e-5)
    if fault == "out of memory":
        assert d.reasons[-1] == (f"region-only resume ran out of GPU memory (CUDA out of memory. Tried to allocate "
                                 f"2.00 GiB); whole-clip resume from step {d.resume_step}")
        assert d.region == "whole clip: region-only resume ran out of GPU memory" and not result.warnings
    else:
        said = (f"region-only resume failed (RuntimeError: shape mismatch in block 3); whole-clip resume from step "
                f"{d.resume_step}")
        assert d.reasons[-1] == said and result.warnings == [said]
        assert d.region == "whole clip: region-only resume failed"


def test_the_kept_keys_are_freed_when_the_region_steps_end(live_tiny_model, store, monkeypatch):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    held = []
    original = type(runner).run

    def run(self, x, sigmas, start, end, observer):
        out = original(self, x, sigmas, start, end, observer)
        held.append((start, observer.region))
        return out
    monkeypatch.setattr(type(runner), "run", run)
    payload = store.trajectory(store.record(decision.entry_id))
    decision, region, _ = resume_stage.plan_region(runner, probed, decision, payload, config)
    observer = GenerationObserver()
    resume_stage.follow_entry(runner, probed, decision, payload, config, observer, region)
    assert region.region_steps_run == decision.numbers["region_steps"] > 0
    # the last run was a region run, and nothing of it is held after it: no kept keys, no region on the observer
    assert held[-1][1] is region and len(region.keys_values) == 0 and observer.region is None


def test_the_memory_margin_is_validated_with_the_fix():
    with pytest.raises(ValueError, match=r"region_memory_margin=-0.1 must be in \[0, 100\]"):
        CarnatorConfig(region_memory_margin=-0.1).validate(10)


@pytest.mark.gpu
@pytest.mark.parametrize("eight_bit", [False, True])
@pytest.mark.parametrize("rows", [[64] * 6, [64, 40, 64, 24, 56, 16]])
def test_on_cuda_streamed_blocks_from_pinned_memory_match_resident_ones(rows, eight_bit):
    """The CUDA path: captured into pinned host memory on a side stream, every block but the first streamed through
    the two buffers while the block before attends; the same keys and values as resident ones, and nothing left
    allocated on the device after release. Blocks of different sizes (region_sparse_keys) share the buffers; kept
    in 8 bits (region_kv_8bit), each part of a block (values, scales) through a buffer of its own."""
    device = torch.device("cuda")
    blocks, step_rows = len(rows), torch.tensor([1, 4, 9], device=device)
    # as a host's attention sees them: [B, heads, L, D] views of [B, L, heads x D] projections
    captured = [torch.randn(2, count, 3, 8, device=device, dtype=torch.bfloat16).transpose(1, 2) for count in rows]

    def attend(store, step):
        outs = []
        for block in range(blocks):
            held = store.fetch((block, 0))
            new = torch.full((2, 3, 3, 8), float(step), device=device, dtype=torch.bfloat16)
            held[0].index_copy_(2, step_rows, new)
            outs.append(held[0].float().sum(dim=2) + held[1].float().sum(dim=2))
        return torch.stack(outs)

    results = []
    for streamed in (False, True):
        reading = MemoryReading(in_use=0, high_water=10 * GIB if not streamed else 0, free=100 * GIB)
        store = KeptKeysValues(FakeMemory(reading), margin=0.0, eight_bit=eight_bit)
        if streamed:
            block_bytes = 2 * captured[0].numel() * 2
            # room for the attention's copy, the two stream buffers and one resident block: the other five stream
            store.memory.reading = MemoryReading(in_use=0, high_water=4 * block_bytes, free=100 * GIB)
        for block, k in enumerate(captured):
            assert store.capture((block, 0), k, k * 2) is None
        assert store.plan(0.0) is None
        assert (store.placed["streamed"] > 0) == streamed
        results.append(torch.stack([attend(store, step) for step in range(3)]))
        store.release()
    torch.cuda.synchronize()
    assert torch.equal(results[0], results[1])


def test_a_model_compiled_with_static_shapes_resumes_whole_clip_in_a_short_note_with_the_fix_in_the_reasons(
        live_tiny_model, store):
    runner, probed, decision, config = _hit(live_tiny_model, store, region_only=True, region_max_share=1.0)
    runner.region_only_unfit = region_only_unfit({"dynamic": False})
    result = resume(runner, probed, decision, store, config, PROMPT, 2)
    d = result.decision
    assert d.reuse and d.numbers["region_only"] is False
    assert d.region == "whole clip: the model is compiled with static shapes"
    assert d.reasons[-1].startswith("region-only resume not possible: the model is compiled with static shapes (")
    assert "set dynamic to true on the compile node" in d.reasons[-1]
    assert region_only_unfit({"dynamic": True}) is None and region_only_unfit(None) is None
