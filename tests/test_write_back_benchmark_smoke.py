"""CPU smoke run of `benchmarks/store.py write-back` (the GPU benchmarks' smoke preset, one repeat, a 2-request session): the
script's plumbing (plain, a miss timed until returned and until written, the session, JSON), not speed."""
from __future__ import annotations

import json
import os

from benchmark_smoke import ROOT, TIME_LIMIT_S, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "store.py")


def test_write_back_benchmark_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "write_back.json"
    proc = run_smoke([SCRIPT, "write-back", "--preset", "smoke", "--repeats", "1", "--session", "2", "--out", str(out),
                      "--store-dir", str(tmp_path)], TIME_LIMIT_S)
    report = json.loads(out.read_text())
    medians = report["medians"]
    assert medians["written"] >= medians["returned"] > medians["queueing"] >= 0
    assert medians["write_after_return"] >= 0 and report["entry_bytes"] > 0
    assert set(report["session_seconds"]) == {"waiting for each write", "in the background"}
    assert "the write after the return (paired)" in proc.stdout
