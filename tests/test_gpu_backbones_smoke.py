"""CPU smoke run of benchmarks/gpu_backbones.py at tiny size: Wan 2.2 A14B's two experts, HunyuanVideo and
LTX-Video through the ComfyUI adapter with the default gate (plumbing, JSON and table; not speed). Skipped like
the gpu_speed smoke test; the time limit only stops a hung run."""
from __future__ import annotations

import json
import os

from test_gpu_speed_smoke import ROOT, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_backbones.py")
TIME_LIMIT_S = 600


def test_gpu_backbones_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "backbones.json"
    proc = run_smoke([SCRIPT, "--smoke", "--steps", "10", "--probe", "2", "--resume", "5", "--out", str(out)],
                     TIME_LIMIT_S)
    data = json.loads(out.read_text())
    assert data["gate_overrides"] == {} and set(data["results"]) == {"wan2.2-a14b", "hunyuan-13b", "ltxv-2b"}
    for name, res in data["results"].items():
        assert "error" not in res, res.get("error")
        assert res["miss"]["model_calls"] == 10 and res["miss"]["rel_diff_vs_plain"] < 1e-4, name
        assert res["hit"]["resume_step"] == 5 and res["hit"]["model_calls"] == 2 + 5, name
        assert res["hit"]["sparse_attend_calls"] > 0, name            # the cached plan ran
        assert not res["new_seed"]["reuse"], name
        assert {"speedup_vs_plain", "ideal", "peak_hit_vs_plain_pct"} <= set(res["summary"])
    assert data["results"]["wan2.2-a14b"]["switch_step"] == 5
    assert "| backbone |" in proc.stdout
