"""What the benchmark smoke tests share: the ComfyUI the scripts would find, the skip without one, and a run
of a benchmark script on the CPU (its time limit only stops a hung run; the tests check plumbing, not speed)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
