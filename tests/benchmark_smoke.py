"""What the benchmark smoke tests share: the ComfyUI the scripts would find, the skip without one, and a run
of a benchmark script on the CPU (its time limit only stops a hung run; the tests check plumbing, not speed).

The scripts run in children forked from one server process that imported torch and ComfyUI once for the whole
test session: each run is still a process of its own, started as `python script.py ARGS` would be (its argv,
the repository as working folder, __main__), without the interpreter start and ComfyUI import each fresh
process paid (about 40 s a script on a busy 2-core machine).
"""
from __future__ import annotations

import atexit
import functools
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIME_LIMIT_S = 300


def load_gpu_host():
    """benchmarks/gpu_host.py as a module (the benchmarks folder is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_host", os.path.join(ROOT, "benchmarks", "gpu_host.py"))
    host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host)
    return host


def _comfyui():
    """Where the script itself would find ComfyUI (its own lookup, so the two never disagree)."""
    return load_gpu_host().comfyui_checkout()


@functools.lru_cache(maxsize=1)
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


# The fork server: reads one job a line ({"argv", "stdout", "stderr", "limit_s"}), runs it in a forked child
# and answers its exit status. torch runs single-threaded: an OpenMP pool started before a fork hangs the child.
SERVER = r"""
import json, os, runpy, sys, time, traceback
sys.path[:0] = [{benchmarks!r}, {root!r}]
import torch
torch.set_num_threads(1)
import gpu_host
gpu_host.import_comfy({comfyui!r}, True)
print(json.dumps({{"ready": True}}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            os.chdir({root!r})
            sys.argv = list(job["argv"])
            sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            try:
                runpy.run_path(sys.argv[0], run_name="__main__")
                status = 0
            except SystemExit as done:
                status = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(status)
    deadline = time.monotonic() + job["limit_s"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            status = "timed out"
            break
        time.sleep(0.05)
    print(json.dumps({{"status": status}}), flush=True)
"""


@functools.lru_cache(maxsize=1)
def _server() -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", COMFYUI_PATH=_comfyui())
    code = SERVER.format(benchmarks=os.path.join(ROOT, "benchmarks"), root=ROOT, comfyui=_comfyui())
    server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT)
    atexit.register(_stop, server)
    _answer(server, 600)
    return server


def _stop(server: subprocess.Popen) -> None:
    server.stdin.close()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def _answer(server: subprocess.Popen, limit_s: float) -> dict:
    ready, _, _ = select.select([server.stdout], [], [], limit_s)
    line = server.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"the benchmark fork server gave no answer (exit status {server.poll()})")
    return json.loads(line)


def run_smoke(command: list, time_limit_s: int) -> subprocess.CompletedProcess:
    """Runs a benchmark script (`command`: the script and its arguments) on the CPU with the ComfyUI it would
    find, in a child of the fork server; the limit only stops a hung run. Returns the finished run, its exit
    status 0 checked."""
    server = _server()
    with tempfile.TemporaryDirectory(prefix="carnator-smoke-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        server.stdin.write(json.dumps({"argv": [str(part) for part in command], "stdout": out, "stderr": err,
                                       "limit_s": time_limit_s}) + "\n")
        server.stdin.flush()
        status = _answer(server, time_limit_s + 60)["status"]
        with open(out) as stdout, open(err) as stderr:
            proc = subprocess.CompletedProcess(command, status, stdout.read(), stderr.read())
    assert proc.returncode == 0, f"exit status {proc.returncode}\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc
