"""CPU smoke run of benchmarks/few_step.py (--smoke, both Wan backbones, 4 steps): plain, miss, hit and repeat
through ComfyUI with the gate's few-step defaults. Guards the plumbing and the call counts, not speed."""
import json
import os

from benchmark_smoke import ROOT, run_smoke, skip_without_comfyui

SCRIPT = os.path.join(ROOT, "benchmarks", "few_step.py")


def test_few_step_benchmark_smoke(tmp_path):
    skip_without_comfyui()
    for backbone in ("wan2.1-1.3b", "wan2.2-a14b"):
        out = tmp_path / f"{backbone}.json"
        proc = run_smoke([SCRIPT, "--smoke", "--device", "cpu", "--backbone", backbone, "--steps", "4",
                          "--repeats", "1", "--out", str(out)], 300)
        result = json.loads(out.read_text())["results"]["4"]
        assert result["probe_steps"] == 1 and result["miss"]["model_calls"] == 4
        assert result["miss"]["rel_diff_vs_plain"] < 1e-3
        for key in ("hit", "hit_dense"):
            assert result[key]["resume_step"] == 3 and result[key]["model_calls"] == 2
            assert not result[key]["runs"][0]["forced_resume_step"]
        assert result["repeat"]["exact_repeat"] and result["repeat"]["model_calls"] == 0
        assert result["switch_step"] == (2 if backbone == "wan2.2-a14b" else None)
        assert "| N | p | k |" in proc.stdout
