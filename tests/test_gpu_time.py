"""benchmarks/gpu_time.py: per-step GPU costs from a gpu_compose.py report, and a trace run priced with them (every
kind of request: a miss, a whole-clip hit's sparse steps, a region-only hit's region steps, an exact repeat)."""
from __future__ import annotations

import json

import pytest

from test_quality_smoke import _script

N, K = 50, 25


def _compose(a=0.08, b=0.9):
    """A gpu_compose.py report: plain steps of 0.6 s, sparse steps at 0.68 of one, region steps at a + b x share."""
    dense, sparse = 0.6, 0.68
    region = {f"region hit {share:.0%}": {"region_only": True, "region_share": share, "region_steps": N - K - 2,
                                          "resume_and_write_s": dense * (2 * sparse + (N - K - 2) * (a + b * share))}
              for share in (0.1, 0.3, 0.5)}
    return {"device": "test card", "config": {"steps": N, "resume": K},
            "cases": {"plain": {"seconds": dense * N}, "miss": {"seconds": dense * N * 1.01},
                      "hit": {"resume_s": dense * sparse * (N - K)}, **region,
                      "region hit 10% resident": {"region_only": True, "region_share": 0.1, "region_steps": 23,
                                                  "resume_and_write_s": 99.0}}}


def test_step_costs_come_from_the_gpu_run():
    costs = _script("gpu_time").step_costs(_compose())
    assert costs["dense_s"] == pytest.approx(0.6) and costs["sparse"] == pytest.approx(0.68)
    assert costs["miss"] == pytest.approx(1.01)
    assert costs["region_a"] == pytest.approx(0.08) and costs["region_b"] == pytest.approx(0.9)
    assert len(costs["region_points"]) == 3          # the resident variant is not a point of the fit


def test_each_request_is_priced_by_what_its_calls_are():
    gpu_time = _script("gpu_time")
    costs = gpu_time.step_costs(_compose())
    row = {"model_calls": 18, "reused": True, "exact_repeat": False, "gate": {}}
    assert gpu_time.request_cost(row, True, 3, costs) == pytest.approx(3 + 15 * 0.68)   # probe dense, rest sparse
    assert gpu_time.request_cost(row, False, 3, costs) == 18                            # the text baseline: dense
    region = dict(row, gate={"region_only": True, "region_share": 0.2, "region_steps": 12})
    assert gpu_time.request_cost(region, True, 3, costs) == pytest.approx(3 + 3 * 0.68 + 12 * (0.08 + 0.9 * 0.2))
    miss = {"model_calls": 20, "reused": False, "exact_repeat": False, "gate": {}}
    assert gpu_time.request_cost(miss, True, 3, costs) == pytest.approx(20 * 1.01)
    repeat = {"model_calls": 0, "reused": True, "exact_repeat": True, "gate": {}}
    assert gpu_time.request_cost(repeat, True, 3, costs) == 0


def test_a_trace_run_with_region_only_is_priced_per_method(tmp_path):
    trace, gpu_time = _script("trace"), _script("gpu_time")
    out = tmp_path / "trace.json"
    assert trace.main(["--requests", "6", "--pairs", "0", "--steps", "6", "--probe-steps", "2", "--fewer-steps", "4",
                       "--text-resume-step", "3", "--habits", "fixed", "--methods", "carnator_balanced,carnator_region",
                       "--region-max-share", "1.0", "--out", str(out)]) == 0
    costs = tmp_path / "compose.json"
    costs.write_text(json.dumps(_compose()))
    report = gpu_time.main(["--costs", str(costs), "--trace", str(out), "--out", str(tmp_path / "gpu_time.json")])
    figures = report["habits"]["fixed"]
    assert set(figures) == {"no_reuse", "carnator_balanced", "carnator_region"}
    assert figures["no_reuse"]["gpu_time_saved"] == 0
    for method in ("carnator_balanced", "carnator_region"):     # a hit's steps cost less than plain ones
        assert figures[method]["gpu_time_saved"] >= figures[method]["calls_saved"] - 0.02
    assert json.loads((tmp_path / "gpu_time.json").read_text())["costs"]["device"] == "test card"
    # the same run packed with others (benchmarks/reports.py pack) is priced the same
    packed = tmp_path / "pack.json"
    _script("reports").pack(str(packed), [str(out)])
    again = gpu_time.main(["--costs", str(costs), "--trace", str(packed), "--out", str(tmp_path / "again.json")])
    assert again["habits"] == report["habits"]


def test_seconds_per_request_for_plain_and_carnator_compiled_or_not(tmp_path):
    """The net figure: one request's expected seconds over a trace run's decisions, plain and Carnator, each under
    its own (compiled or uncompiled) costs of one card; runs of two cards are refused."""
    trace, gpu_time = _script("trace"), _script("gpu_time")
    out = tmp_path / "trace.json"
    assert trace.main(["--requests", "6", "--pairs", "0", "--steps", "6", "--probe-steps", "2", "--fewer-steps", "4",
                       "--text-resume-step", "3", "--habits", "fixed", "--methods", "carnator_balanced",
                       "--out", str(out)]) == 0
    plain, compiled = tmp_path / "plain.json", tmp_path / "compiled.json"
    plain.write_text(json.dumps(_compose()))
    faster = _compose()
    for case in faster["cases"].values():            # compiled: every step 20 % faster
        for key in ("seconds", "resume_s", "resume_and_write_s"):
            if key in case:
                case[key] *= 0.8
    compiled.write_text(json.dumps(faster))
    report = gpu_time.main(["--costs", str(plain), "--compiled-costs", str(compiled), "--trace", str(out),
                            "--out", str(tmp_path / "gpu_time.json")])
    seconds = report["seconds_per_request"]["fixed"]
    assert seconds["plain"] == pytest.approx(0.6 * N, abs=1e-3)             # every request: N dense steps
    assert seconds["plain compiled"] == pytest.approx(0.8 * seconds["plain"], abs=1e-3)
    assert seconds["Carnator compiled"] == pytest.approx(0.8 * seconds["Carnator"], abs=1e-3)
    assert seconds["Carnator"] <= seconds["plain"] * 1.01
    faster["device"] = "another card"
    compiled.write_text(json.dumps(faster))
    with pytest.raises(SystemExit, match="give runs of one card"):
        gpu_time.main(["--costs", str(plain), "--compiled-costs", str(compiled), "--trace", str(out),
                       "--out", str(tmp_path / "gpu_time.json")])


def test_the_other_tools_caches_run_on_the_trace_and_their_steps_are_priced_dense(tmp_path):
    """cacheseek, redi and comfyui_cache on a few trace requests: a CacheSeek hit skips its first steps, a ReDi hit
    its middle ones, a ComfyUI hit is an exact repeat with no call; every step they compute is a dense step."""
    trace, gpu_time, reports = _script("trace"), _script("gpu_time"), _script("reports")
    out = tmp_path / "trace.json"
    assert trace.main(["--requests", "8", "--pairs", "1", "--steps", "10", "--probe-steps", "2", "--fewer-steps", "4",
                       "--habits", "fixed",
                       "--methods", "cacheseek,redi,comfyui_cache,cacheseek_1.01", "--cacheseek-sweep", "1.01",
                       "--out", str(out)]) == 0
    rows = reports.read(str(out))["rows"]["fixed"]
    assert not any(r["reused"] for r in rows["cacheseek_1.01"]["trace"])     # a threshold no cosine reaches
    for method, hit_calls in (("cacheseek", {9}), ("redi", {2 + 10 - 7}), ("comfyui_cache", {0})):
        found = rows[method]["trace"] + rows[method]["pairs"]
        assert any(r["reused"] for r in found), method
        assert {r["model_calls"] for r in found if r["reused"]} <= hit_calls
        assert {r["model_calls"] for r in found if not r["reused"]} == {10}
    assert all(r["exact_repeat"] for r in rows["comfyui_cache"]["trace"] if r["reused"])
    costs = tmp_path / "compose.json"
    costs.write_text(json.dumps(_compose()))
    figures = gpu_time.main(["--costs", str(costs), "--trace", str(out), "--out", str(tmp_path / "g.json")])["habits"]
    for method in ("cacheseek", "redi", "comfyui_cache"):
        assert figures["fixed"][method]["gpu_time_saved"] == pytest.approx(figures["fixed"][method]["calls_saved"],
                                                                           abs=1e-4)
