"""CPU smoke run of benchmarks/region_profile.py (the GPU benchmarks' smoke preset, one target share, every variant):
its step clock tells the probe's full steps, the capture step and the region steps apart, and each profile holds the
steps it was asked for; not speed."""
from __future__ import annotations

import json
import os

from benchmark_smoke import ROOT, TIME_LIMIT_S, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "region_profile.py")


def test_region_profile_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "profile.json"
    # no refresh: at the smoke's 10 steps a refresh leaves the region steps too few for EasyCache to skip one
    completed = run_smoke([SCRIPT, "--smoke", "--shares", "0.3", "--profile-steps", "2", "--device", "cpu",
                           "--refresh-steps", "0", "--out", str(out)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    assert report["fa4_installed"] is False   # the report says which kernel ran: the CPU has no FlashAttention-4
    assert report["fa4_failure"] is None
    steps, probe, k = (report["config"][key] for key in ("steps", "probe", "resume"))
    assert report["miss"]["profile_full"]["steps"] == 1 and report["miss"]["full_step_s"] > 0
    assert report["plain"]["seconds"] > 0          # the baseline of every hit's speedup, timed in the same run
    assert set(report["cases"]) == {"region hit 30% streamed", "region hit 30% resident", "region hit 30% 16-bit",
                                    "region hit 30% torch", "region hit 30% host kernel", "region hit 30% easycache",
                                    "region hit 30% easycache host kernel"}
    # the easycache variant ran on the EasyCache model: a region step answered without a forward
    assert report["cases"]["region hit 30% easycache"]["model_calls"] < \
        report["cases"]["region hit 30% streamed"]["model_calls"]
    for case in report["cases"].values():
        assert case["region_only"] and case["speedup_vs_plain"] == report["plain"]["seconds"] / case["seconds"]
        assert case["host_link_gbps"] is None          # the CPU has no host-to-GPU link to time
        kinds = case["step_s"]
        # every step in order, named by its kind: the probe, step k's capture, then region steps with the refreshes
        # (full steps) between them, never first or last
        sequence = [entry.split()[0] for entry in kinds["sequence"]]
        assert sequence[:probe + 1] == [f"{s}f" for s in range(probe)] + [f"{k}f"]
        later = sequence[probe + 1:]
        assert [int(entry[:-1]) for entry in later] == list(range(k + 1, steps))
        assert later[0].endswith("r") and later[-1].endswith("r")
        refreshes = sum(entry.endswith("f") for entry in later)
        assert kinds["full"]["count"] == probe + 1 + refreshes and kinds["region"]["count"] == steps - k - 1 - refreshes
        profile = case["profile_region"]
        assert profile["steps"] == 2 and profile["top_ops"] and profile["wall_s_per_step"] > 0
    assert "top ops by self CPU" in completed.stdout
