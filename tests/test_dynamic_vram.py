"""Dynamic VRAM (newer ComfyUI's comfy-aimdo, ModelPatcherDynamic): detected from the MODEL or the host's flag, and
then a region-only hit keeps no kept keys and values on the GPU, every block streamed from host memory, with the
reason on the node (docs/dynamic-vram.md). Stand-ins shaped after ComfyUI 0.38's names."""
from __future__ import annotations

import sys
import types

import torch

from carnator_engine.hosts.contract import dynamic_vram
from carnator_engine.kept_kv import GIB, KeptKeysValues, MemoryReading
from nodes.inputs import summary_text
from test_kept_kv import FakeMemory


class ModelPatcher:
    def is_dynamic(self):
        return False


class ModelPatcherDynamic(ModelPatcher):
    def is_dynamic(self):
        return True


class OlderPatcher:
    """A patcher from before is_dynamic (0.3.64): the host's flag says."""


def test_dynamic_vram_is_read_from_the_patcher_or_the_hosts_flag(monkeypatch):
    assert dynamic_vram(ModelPatcher()) == "" and dynamic_vram(OlderPatcher()) == ""
    assert dynamic_vram(ModelPatcherDynamic()).startswith("dynamic VRAM is on (comfy-aimdo)")
    monkeypatch.setitem(sys.modules, "comfy.memory_management", types.SimpleNamespace(aimdo_enabled=True))
    assert dynamic_vram(OlderPatcher()).startswith("dynamic VRAM is on")
    assert dynamic_vram(ModelPatcher()) == ""       # this patcher is not dynamic (a hooked model's delegate)


class PagedMemory(FakeMemory):
    paged = "dynamic VRAM is on"


def _planned(memory) -> KeptKeysValues:
    store = KeptKeysValues(memory)
    k = torch.randn(1, 2, 6, 4)
    for block in range(3):
        assert store.capture((block, 0), k, k + 1) is None
    assert store.plan(0.5) is None
    return store


def test_under_dynamic_vram_no_kept_block_stays_on_the_gpu():
    plenty = MemoryReading(in_use=GIB, high_water=4 * GIB, free=70 * GIB)
    block = 2 * 2 * 6 * 4 * 4
    assert _planned(FakeMemory(reading=plenty)).placed == {"resident": 3 * block, "streamed": 0}
    assert _planned(PagedMemory(reading=plenty)).placed == {"resident": 0, "streamed": 3 * block}


def test_the_reason_is_a_note_on_the_node():
    summary = {"reuse": True, "risk": "balanced", "steps": 10, "resume_step": 6, "entry_id": "e1", "model_calls": 5,
               "steps_run": 5, "expected_speedup": 2.0, "notes": ["dynamic VRAM is on (comfy-aimdo): ..."],
               "warnings": ["w"]}
    lines = summary_text(summary).splitlines()
    assert lines[0].startswith("Carnator HIT") and lines[1:] == ["note: dynamic VRAM is on (comfy-aimdo): ...",
                                                                 "warning: w"]


def test_streaming_every_block_still_needs_room_for_the_two_buffers():
    """A single block that fits resident may not fit twice (the two stream buffers): then not even streaming fits."""
    from carnator_engine.kept_kv import RESERVE, placement
    reading = MemoryReading(in_use=0, high_water=10 * GIB, free=RESERVE + 250 * (1 << 20))
    sizes = {0: 100 << 20}
    assert placement([0], sizes, reading, 0.0, 0.05) == ({0}, None)
    none, why = placement([0], sizes, reading, 0.0, 0.05, None, False)
    assert none is None and why.note == "not enough GPU memory for region-only resume"
