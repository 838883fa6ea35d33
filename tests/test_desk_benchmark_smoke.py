"""CPU smoke run of benchmarks/desk.py (the smoke preset of its default setup, Wan 2.2 A14B's two experts with fp8
weights, cfg 5): the script's plumbing, every case's row and the region-only rows marked, not speed."""
from __future__ import annotations

import json
import os

from benchmark_smoke import ROOT, TIME_LIMIT_S, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "desk.py")


def test_desk_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "desk.json"
    completed = run_smoke([SCRIPT, "--smoke", "--device", "cpu", "--out", str(out)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    assert report["setup"] == "wan22-a14b-24gb-fp8" and report["weights"] == "fp8_e4m3fn"
    assert "torch.float8_e4m3fn" in report["stored_dtypes"]          # stored fp8, cast per layer
    assert report["comfyui_args"] == [] and report["device"]      # the CPU: no --reserve-vram
    cases = report["cases"]
    assert list(cases) == ["plain", "miss", "hit", "region hit 10% (first)", "region hit 10% (again)",
                           "region hit 30%", "easycache", "miss+easycache", "hit+easycache"]
    assert report["skipped"] == [] and report["errors"] == {}
    steps = report["config"]["steps"]
    assert cases["plain"]["model_calls"] == cases["miss"]["model_calls"] == steps
    assert cases["hit"]["model_calls"] < steps and cases["hit+easycache"]["model_calls"] < steps
    assert cases["easycache"]["model_calls"] < steps
    for name, case in cases.items():
        assert case["seconds"] > 0 and case["speedup_vs_plain"] > 0 and case["host_peak_rss_bytes"] > 0
        assert case["weights_moved"] == 0 and case["weights_move_s"] is None     # the CPU streams nothing
        assert (case.get("region_only_default") is False) == name.startswith("region")
    assert all(cases[name]["region_only"] for name in cases if name.startswith("region"))
    assert "| hit+easycache" in completed.stdout and "region-only is off by default" in completed.stdout


def test_desk_leaves_the_budget_through_comfyuis_reserve_vram(monkeypatch):
    """--reserve-vram is the card's total less the budget in GiB (ComfyUI reads it as GiB): 55.2 on an 80 GB H100."""
    import importlib.util
    import sys
    import torch
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("desk", SCRIPT)
    desk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(desk)

    class Card:
        total_memory = int(79.2 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Card)
    assert desk.comfy_memory_args(24, "default", True) == ["--reserve-vram", "55.2"]
    assert desk.comfy_memory_args(16, "lowvram", True) == ["--reserve-vram", "63.2", "--lowvram"]
    assert desk.comfy_memory_args(24, "default", False) == []
