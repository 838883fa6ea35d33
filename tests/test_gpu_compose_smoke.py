"""CPU smoke run of benchmarks/gpu_compose.py (the GPU benchmarks' smoke preset, cfg 1 only, one EasyCache threshold,
one region-only target share, with and without sparse keys, in 8 bits (the default) and 16): the script's plumbing
and the composition it reports (a Carnator miss with EasyCache equals EasyCache alone, with the same model calls), not
speed."""
from __future__ import annotations

import json
import os

import pytest

from benchmark_smoke import ROOT, TIME_LIMIT_S, load_gpu_host, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_compose.py")


def test_a_gpu_report_says_when_flashattention4_failed_in_the_run(tmp_path, monkeypatch):
    """Its figures after the failure are the other kernels' although FA4 is installed (attention.fa4)."""
    from carnator_engine.attention import fa4
    gpu_host = load_gpu_host()
    path = tmp_path / "report.json"
    monkeypatch.setattr(fa4, "_FAILURE", [])
    gpu_host.write_report(str(path), {"fa4_installed": True})
    assert json.loads(path.read_text()) == {"fa4_installed": True, "fa4_failure": None}
    monkeypatch.setattr(fa4, "_FAILURE", ["ValueError: Unsupported compute capability: 130"])
    gpu_host.write_report(str(path), {"fa4_installed": True})
    assert json.loads(path.read_text())["fa4_failure"] == "ValueError: Unsupported compute capability: 130"


def test_gpu_compose_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "compose.json"
    completed = run_smoke([SCRIPT, "--smoke", "--skip-cfg5", "--easycache-thresholds", "0.1", "--region-shares", "0.3",
                           "--region-sparse-shares", "0.3", "--region-16bit-shares", "0.3", "--device", "cpu",
                           "--out", str(out), "--store-dir", str(tmp_path)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    assert report["fa4_installed"] is False   # the report says which kernel ran: the CPU has no FlashAttention-4
    assert report["fa4_failure"] is None
    cases = report["cases"]
    assert set(cases) == {"plain", "easycache", "miss", "hit", "miss+easycache", "hit+easycache", "region hit 30%",
                          "region hit 30%+easycache", "region hit 10% resident", "region hit 30% sparse keys",
                          "region hit 30%+easycache sparse keys", "region hit 30% 16-bit",
                          "region hit 30%+easycache 16-bit"}
    # sparse keys beside the same hit without them: only the keys the target reaches kept (every block has a table)
    for suffix in ("", "+easycache"):
        dense, sparse = cases[f"region hit 30%{suffix}"], cases[f"region hit 30%{suffix} sparse keys"]
        assert sparse["region_only"] and dense["region_key_share"] is None and "peak_bytes" in sparse
        assert 0 < sparse["region_key_share"] <= 1
        assert sparse["region_resident_bytes"] == pytest.approx(dense["region_resident_bytes"]
                                                                * sparse["region_key_share"], rel=1e-3)
    assert report["region_sparse_keys_warm_up_s"] > 0
    for suffix in ("", "+easycache"):     # 8 bits beside float32 on the CPU: int8 and a float32 scale per row of 128
        eight, wide = cases[f"region hit 30%{suffix}"], cases[f"region hit 30%{suffix} 16-bit"]
        assert wide["region_only"] and eight["region_resident_bytes"] == wide["region_resident_bytes"] * 33 // 128
        assert 0 < wide["rel_l2_vs_default"] < 1e-2
    assert report["region_16bit_warm_up_s"] > 0
    region = cases["region hit 30%"]          # the region-only hit: the resume stage took it, on part of the tokens
    assert region["region_only"] and 0 < region["region_share"] < 1 and region["model_calls"] < 10
    assert cases["region hit 30%+easycache"]["region_only"] and cases["region hit 10% resident"]["region_only"]
    assert region["region_resident_bytes"] > 0 == region["region_streamed_bytes"]   # the CPU: nothing streamed
    assert report["region_warm_up_s"] > 0 and all("peak_bytes" in case for case in cases.values())
    assert cases["miss+easycache"]["rel_l2_vs_easycache"] < 1e-4
    assert cases["miss+easycache"]["model_calls"] == cases["easycache"]["model_calls"] < cases["plain"]["model_calls"]
    assert cases["miss"]["rel_l2_vs_plain"] < 1e-4
    assert cases["hit"]["model_calls"] < cases["plain"]["model_calls"]
    assert report["gate_overrides"] == {} and cases["hit"]["resume_step"] == report["config"]["resume"]
    assert len(cases["miss"]["runs_s"]) == len(cases["plain"]["runs_s"]) == 2
    assert cases["miss"]["write_after_s"] >= 0 and "write_back" in cases["miss"]["parts_s"]
    assert "| hit+easycache" in completed.stdout


def test_gpu_compose_compiled_smoke(tmp_path):
    """--compile (backend eager on the CPU: dynamo's compiles are the same whatever runs the graphs): plain, miss, hit
    and a region-only hit on the compiled model, the warm-ups taking every compile and the timed cases none, beside
    plain sampling uncompiled."""
    skip_without_comfyui()
    out = tmp_path / "compose_compiled.json"
    completed = run_smoke([SCRIPT, "--smoke", "--compile", "--compile-backend", "eager", "--repeats", "1",
                           "--region-shares", "0.3", "--region-resident-shares", "", "--device", "cpu",
                           "--out", str(out), "--store-dir", str(tmp_path)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    cases = report["cases"]
    assert set(cases) == {"plain (uncompiled)", "plain", "miss", "hit", "region hit 30%"}
    compiled = report["compile"]
    assert compiled["backend"] == "eager" and compiled["warm_up_compiles"] > 0 and compiled["warm_up_s"] > 0
    assert compiled["compiles_in_cases"] == 0
    assert cases["region hit 30%"]["region_only"]
    assert cases["miss"]["rel_l2_vs_plain"] < 1e-4 and cases["plain (uncompiled)"]["rel_l2_vs_plain"] < 1e-4
    assert cases["hit"]["model_calls"] < cases["plain"]["model_calls"]
    assert "compiles inside the timed cases: 0" in completed.stdout
