"""CPU smoke run of benchmarks/gpu_speed.py (--smoke: 2 layers, dim 256, N=10, p=2, k=5) through ComfyUI,
with the default gate (no overrides).

Skipped when no ComfyUI checkout is found (COMFYUI_PATH, .host/ComfyUI, /opt/ComfyUI) or its
dependencies are missing. The test guards the script's plumbing (ComfyRunner + pipeline miss, hits, overhead,
JSON), not speed: its time limit only stops a hung run (the run takes 30-80 s on a shared 2-core CPU).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_speed.py")
TIME_LIMIT_S = 300


def _comfyui():
    """Where the script itself would find ComfyUI (its own lookup, so the two never disagree)."""
    spec = importlib.util.spec_from_file_location("gpu_host", os.path.join(ROOT, "benchmarks", "gpu_host.py"))
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    return host.comfyui_checkout()


def _skip_reason():
    comfy = _comfyui()
    if comfy is None:
        return "no ComfyUI checkout (set COMFYUI_PATH)"
    probe = subprocess.run([sys.executable, "-c", "import torchsde, diskcache, einops, scipy, safetensors"],
                           capture_output=True)
    if probe.returncode != 0:
        return "this interpreter lacks ComfyUI's sampler dependencies (torchsde, diskcache, ...)"
    return None


def skip_without_comfyui() -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def run_smoke(command: list, time_limit_s: int):
    """Runs a benchmark script on the CPU with the ComfyUI it would find; the limit only stops a hung run.
    Returns the finished process (exit status 0 checked)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", COMFYUI_PATH=_comfyui())
    proc = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=time_limit_s, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_gpu_speed_smoke(tmp_path):
    skip_without_comfyui()
    out = tmp_path / "smoke.json"
    proc = run_smoke([SCRIPT, "--smoke", "--device", "cpu", "--repeats", "1", "--out", str(out),
                      "--store-dir", str(tmp_path)], TIME_LIMIT_S)
    data = json.loads(out.read_text())
    res = data["results"]
    assert data["path"].startswith("ComfyRunner")
    assert res["full"]["finite"]
    assert res["miss"]["model_calls"] == 10 and data["gate_overrides"] == {}
    assert res["miss"]["rel_diff_vs_full"] < 1e-3        # the hooks do not change the computation
    for key in ("hit_budget", "hit_measured", "hit_band"):
        assert "error" not in res[key], res[key].get("error")
        run = res[key]["runs"][0]
        assert run["resume_step"] == 5 and run["model_calls"] == 2 + 5
        assert run["sparse_attend_calls"] == 5 * 2       # (N - k) steps x 2 blocks ran the cached plan
        assert run["finite"]
    assert 0.2 < res["hit_band"]["density"] < 0.45
    # the budgeted entry keeps at most ceil(0.3 * 8) blocks a row plus the diagonal: half of the mass-rule one
    assert res["kernel_budget_block_density"] <= 0.5 < res["kernel_measured_block_density"]
    assert res["overhead"]["store_entries"] >= 5
    assert {s["case"] for s in res["summary"]} == {"hit, measured, max_density 0.3", "hit, measured, mass rule alone",
                                                  "hit, band connectivity"}
    assert "| case" in proc.stdout
