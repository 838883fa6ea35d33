"""CPU smoke run of benchmarks/miss_profile.py: the plumbing (per-step marks of plain and miss side by side, the
wrapped host calls restored afterwards, the profiler pair), not speed."""
from __future__ import annotations

import json
import os

from benchmark_smoke import ROOT, TIME_LIMIT_S, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "miss_profile.py")


def test_miss_profile_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "miss_profile.json"
    completed = run_smoke([SCRIPT, "--smoke", "--repeats", "2", "--device", "cpu", "--out", str(out)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    steps = report["config"]["steps"]
    assert len(report["runs"]) == 2
    for row in report["runs"]:
        assert [s for s, _ in row["plain"]["steps_ms"]] == [s for s, _ in row["miss"]["steps_ms"]] == list(range(steps))
        assert row["miss_calls"]["comfy.sample.sample_custom"]["calls"] == 2    # the probe, then the rest
        assert row["plain_calls"]["comfy.sample.sample_custom"]["calls"] == 1
        assert "pipeline.lookup" not in row["plain_calls"]
    assert {"extra_pct", "extra_ms_step_p", "extra_ms_steps_after_p"} <= set(report["summary"])
    assert set(report["profiled"]) == {"plain", "miss"}
    assert "| where | extra ms |" in completed.stdout


def test_miss_profile_takes_a_schedule_and_refuses_a_probe_that_does_not_fit_it():
    import subprocess
    import sys
    few = subprocess.run([sys.executable, SCRIPT, "--steps", "4", "--out", "x.json"], capture_output=True, text=True)
    assert few.returncode == 2 and "--probe 5 must be between 1 and --steps - 1 (3)" in few.stderr
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import miss_profile
    args = miss_profile.parse_args(["--steps", "4", "--probe", "1", "--out", "x.json"])
    assert (args.steps, args.probe) == (4, 1)
    assert miss_profile.parse_args(["--smoke", "--out", "x.json"]).steps == miss_profile.PRESETS["smoke"]["steps"]
