"""A real ComfyUI server for the host tests, with this repository installed as a custom node.

Nothing is written into the ComfyUI tree: the server runs with `--base-directory` pointing at a
temporary folder holding custom_nodes/carnator (a symlink to this repository), models/, user/
(where the plugin's default cache store lives: user/carnator_cache), input/, output/ and temp/.

COMFYUI_PATH (default /opt/ComfyUI) finds the host; COMFYUI_PYTHON the interpreter that runs it
(default: this one). Tests call `skip_reason()` and skip with its text when the host is absent.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "host"))
import hostsetup  # noqa: E402  (one place says where the host is and how the plugin folder is named)

COMFYUI = hostsetup.comfyui_path()
PYTHON = os.environ.get("COMFYUI_PYTHON", sys.executable)
PLUGIN_DIR_NAME = hostsetup.PLUGIN_DIR_NAME


def skip_reason() -> Optional[str]:
    if not os.path.isfile(os.path.join(COMFYUI, "main.py")):
        return f"no ComfyUI at {COMFYUI} (set COMFYUI_PATH to a ComfyUI checkout to run the host tests)"
    if not os.path.isfile(os.path.join(ROOT, "__init__.py")):
        return "the plugin has no root __init__.py yet, so ComfyUI cannot load it as a custom node"
    probe = subprocess.run([PYTHON, "-c", "import aiohttp, torch, safetensors, diskcache"], capture_output=True)
    if probe.returncode != 0:
        return f"{PYTHON} cannot import ComfyUI's dependencies (set COMFYUI_PYTHON to ComfyUI's interpreter)"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_base(path: str, extra_nodes: tuple = ()) -> str:
    """A --base-directory with this plugin (and optional extra custom node dirs) installed by symlink."""
    nodes = os.path.join(path, "custom_nodes")
    os.makedirs(nodes, exist_ok=True)
    os.makedirs(os.path.join(path, "models", "diffusion_models"), exist_ok=True)
    os.makedirs(os.path.join(path, "user"), exist_ok=True)
    os.symlink(ROOT, os.path.join(nodes, PLUGIN_DIR_NAME))
    for extra in extra_nodes:
        os.symlink(os.path.abspath(extra), os.path.join(nodes, os.path.basename(extra.rstrip("/"))))
    return path


def default_store_dir(base: str) -> str:
    return os.path.join(base, "user", "carnator_cache")


def build_tiny_wan(base: str, every: bool = False) -> str:
    """The host tests' tiny random Wan2.1 T2V model (ComfyUI's WanModel), saved into base/models/diffusion_models;
    `every`: the other tiny backbones too (hostsetup's names)."""
    folder = os.path.join(base, "models", "diffusion_models")
    run = subprocess.run([PYTHON, os.path.join(ROOT, "tests", "host", "make_tiny_wan.py"), folder]
                         + (["--all"] if every else []),
                         cwd=COMFYUI, check=True, capture_output=True, text=True, timeout=300)
    return run.stdout.strip().splitlines()[-1]


def write_start_image(base: str, name: str, kind: str) -> str:
    """One of hostsetup's start images as a PNG in base/input, where LoadImage finds it; returns `name`."""
    import numpy
    from PIL import Image
    image = hostsetup.start_image(kind)[0]
    os.makedirs(os.path.join(base, "input"), exist_ok=True)
    Image.fromarray((image.numpy() * 255).round().astype(numpy.uint8)).save(os.path.join(base, "input", name))
    return name


class ComfyServer:
    """`python main.py --cpu` on a free port, in its own process group; stopped (group killed) on exit."""

    def __init__(self, base: str, port: Optional[int] = None, ready_timeout: float = 240.0, extra_args: tuple = ()):
        self.base = base
        self.extra_args = tuple(extra_args)
        self.port = port or free_port()
        self.ready_timeout = ready_timeout
        self.log_path = os.path.join(base, "comfyui.log")
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ComfyServer":
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(self.port),
                 "--disable-auto-launch", "--base-directory", self.base, "--preview-method", "none", *self.extra_args],
                cwd=COMFYUI, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                status, _, _ = self.request("GET", "/api/system_stats", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"ComfyUI did not answer within {self.ready_timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def request(self, method: str, path: str, body=None, timeout: float = 30.0):
        """(status, content type, body bytes); HTTP errors are answers, not exceptions."""
        data = None
        headers = {}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.headers.get_content_type(), response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get_content_type(), error.read()

    def json(self, method: str, path: str, body=None, timeout: float = 30.0):
        status, _, data = self.request(method, path, body, timeout)
        return status, json.loads(data) if data else None

    def wait_history(self, prompt_id: str, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, history = self.json("GET", f"/api/history/{prompt_id}")
            if status == 200 and prompt_id in history:
                entry = history[prompt_id]
                if entry.get("status", {}).get("completed") or entry.get("status", {}).get("status_str") == "error":
                    return entry
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited:\n{self.log()[-4000:]}")
            time.sleep(0.5)
        raise RuntimeError(f"prompt {prompt_id} did not finish within {timeout:.0f} s:\n{self.log()[-4000:]}")


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
