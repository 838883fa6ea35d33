"""CarnatorConfig.region_pin_ahead: the probe measures the keys and values its first step attends with, and from its
next step on pins, on a background thread, the host memory a region-only hit's capture would pin, into torch's cache
of pinned memory; never beyond the host budget, never twice what runs of the process already hold, nothing off CUDA;
a capture waits for it. The CUDA path itself (the capture then pins nothing new): the last test, on a GPU."""
import threading

import pytest
import torch

from carnator_engine import kept_kv
from carnator_engine import pipeline
from carnator_engine.euler import TinyDiTRunner
from carnator_engine.kept_kv import GIB, KeptKeysValues, PinAhead, kept_part_bytes, pin_ahead, quantize_rows
from carnator_engine.pipeline import CarnatorConfig, probe
from test_kept_kv import MIB, FakeMemory
from test_region_resume import PROMPT, SIGMAS, _noise


@pytest.fixture(autouse=True)
def nothing_pinned_before(monkeypatch):
    monkeypatch.setattr(KeptKeysValues, "pinned_high_water", 0)
    monkeypatch.setattr(PinAhead, "_running", None)
    yield
    PinAhead.wait()


class OnCuda:
    """A tensor said to be on a CUDA device (the sizes are its own)."""
    is_cuda = True

    def __init__(self, tensor):
        self.tensor = tensor

    def __getattr__(self, name):
        return getattr(self.tensor, name)


class OnCudaDetached(OnCuda):
    """As a capture sees a host's keys (on a CUDA device, detached)."""
    device = torch.device("cuda")

    def detach(self):
        return self


def _keys(tokens=40, heads=3, dim=16):
    return torch.randn(1, tokens, heads, dim).transpose(1, 2)


@pytest.mark.parametrize("eight_bit", [False, True])
def test_the_sizes_pinned_ahead_are_those_a_capture_pins(eight_bit):
    """Torch's cache gives a block back to an allocation of its own size class: the sizes must be the capture's."""
    k = _keys().to(torch.bfloat16)
    parts = quantize_rows(k) if eight_bit else (k,)
    assert kept_part_bytes(k, eight_bit) == [part.numel() * part.element_size() for part in parts]


def test_pins_the_sizes_into_the_cache_and_counts_them_as_held():
    pinned = []
    assert pin_ahead([3 * MIB, 5 * MIB], FakeMemory(host=GIB), lambda size: pinned.append(size) or
                     torch.empty(size, dtype=torch.uint8)) == 8 * MIB
    assert pinned == [3 * MIB, 5 * MIB] and KeptKeysValues.pinned_high_water == 8 * MIB
    # the next request's probe: runs of the process hold as much already
    assert pin_ahead([3 * MIB, 5 * MIB], FakeMemory(host=GIB), lambda size: pytest.fail("pinned twice")) == 0


def test_pins_nothing_beyond_the_host_budget_a_capture_has():
    assert pin_ahead([300 * MIB, 300 * MIB], FakeMemory(host=GIB), lambda size: pytest.fail("over budget")) == 0
    assert KeptKeysValues.pinned_high_water == 0


def test_a_host_that_stops_pinning_keeps_what_was_pinned_counted():
    def pin(size):
        if size > 4 * MIB:
            raise RuntimeError("CUDA error: out of memory")
        return torch.empty(size, dtype=torch.uint8)
    assert pin_ahead([2 * MIB, 3 * MIB, 5 * MIB], FakeMemory(host=GIB), pin) == 5 * MIB
    assert KeptKeysValues.pinned_high_water == 5 * MIB


def test_measures_the_first_step_and_pins_from_the_next_on_a_thread(monkeypatch):
    calls, started = [], threading.Event()

    def pin(sizes, memory):
        calls.append((sizes, threading.current_thread().name))
        started.set()
    monkeypatch.setattr(kept_kv, "pin_ahead", pin)
    ahead, k = PinAhead(eight_bit=False), OnCuda(_keys())
    for step in (0, 0):              # a step's blocks (here two), all measured
        ahead.begin_step(0)
        ahead.self_attention(step, k, k)
    assert not ahead.started          # nothing pinned while the measured step runs
    ahead.begin_step(1)
    ahead.self_attention(1, k, k)     # later steps are not counted
    ahead.begin_step(2)
    assert started.wait(10)
    PinAhead.wait()
    assert calls == [([k.numel() * 4] * 4, "carnator-pin-ahead")]


def test_off_cuda_it_pins_nothing(monkeypatch):
    monkeypatch.setattr(kept_kv, "pin_ahead", lambda *args: pytest.fail("pinned off CUDA"))
    ahead, k = PinAhead(eight_bit=True), _keys()
    ahead.self_attention(0, k, k)
    ahead.begin_step(1)
    assert ahead.sizes == [] and not ahead.started


def test_a_capture_waits_for_the_pinning_in_progress(monkeypatch):
    """Else the capture would pin the same memory again beside it, over the host budget."""
    release, waited = threading.Event(), []
    monkeypatch.setattr(kept_kv, "pin_ahead", lambda sizes, memory: release.wait(10))
    ahead, k = PinAhead(eight_bit=False), OnCuda(_keys())
    ahead.self_attention(0, k, k)
    ahead.begin_step(1)
    real_wait = PinAhead.wait

    def wait():
        waited.append(PinAhead._running.is_alive())
        release.set()
        real_wait()
    monkeypatch.setattr(PinAhead, "wait", staticmethod(wait))

    def no_pinning(*args, **kwargs):      # the capture's own pinning, after the wait, is not this test's
        raise RuntimeError("stopped here")
    monkeypatch.setattr(kept_kv, "empty_in_layout", no_pinning)
    on_cuda = OnCudaDetached(k.tensor)
    assert KeptKeysValues(FakeMemory()).capture((0, 0), on_cuda, on_cuda).reason.endswith(
        "failed: stopped here); whole-clip resume")
    assert waited == [True] and not PinAhead._running.is_alive()


@pytest.mark.parametrize("enabled", [False, True])
def test_the_probe_pins_ahead_only_with_the_setting_and_region_only(monkeypatch, tiny_model, enabled):
    made = []

    class Recording(PinAhead):
        def __init__(self, eight_bit, memory=None):
            super().__init__(eight_bit, memory)
            made.append(self)
            self.seen = []

        def self_attention(self, step, k, v):
            self.seen.append(step)
    monkeypatch.setattr(pipeline, "PinAhead", Recording)
    runner = TinyDiTRunner(tiny_model, PROMPT, 1.0)
    probe(runner, _noise(1), SIGMAS, CarnatorConfig(probe_steps=2, region_pin_ahead=enabled, region_kv_8bit=True))
    probe(runner, _noise(1), SIGMAS, CarnatorConfig(probe_steps=2, region_pin_ahead=True, region_only=False))
    assert len(made) == int(enabled)
    if enabled:
        assert made[0].eight_bit and set(made[0].seen) == {0, 1}


def test_the_setting_is_validated():
    with pytest.raises(ValueError, match="region_pin_ahead must be True or False"):
        CarnatorConfig(region_pin_ahead="yes").validate(10)


@pytest.mark.gpu
def test_on_cuda_a_capture_after_pinning_ahead_pins_nothing_new():
    device = torch.device("cuda")
    k = torch.randn(1, 4096, 4, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
    ahead = PinAhead(eight_bit=False, memory=FakeMemory())
    for block in range(3):
        ahead.self_attention(0, k, k)
    ahead.begin_step(1)
    PinAhead.wait()
    before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    kept = KeptKeysValues(FakeMemory())
    for block in range(3):
        assert kept.capture((block, 0), k, k) is None
    kept.plan(0.1)
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == before
    kept.release()
