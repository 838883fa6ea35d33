"""Fixtures for tests that run Carnator inside the real ComfyUI host.

The host is found at COMFYUI_PATH (default /opt/ComfyUI); without one every test here is skipped. ComfyUI
is imported only by these fixtures, forced onto the CPU.
"""
from __future__ import annotations

import pytest

import hostsetup


@pytest.fixture(scope="session")
def comfy_path() -> str:
    path = hostsetup.comfyui_path()
    if not hostsetup.host_present(path):
        pytest.skip(f"ComfyUI host not found at {path}: set COMFYUI_PATH to a ComfyUI checkout to run host tests")
    return path


@pytest.fixture(scope="session")
def comfy(comfy_path):
    """ComfyUI's `nodes` module (core and extra nodes registered), with the host imported on the CPU."""
    try:
        return hostsetup.import_host(comfy_path)
    except ModuleNotFoundError as error:
        pytest.skip(f"ComfyUI at {comfy_path} cannot be imported by this Python (missing {error.name!r}): "
                    "install its requirements.txt here to run host tests")


@pytest.fixture(autouse=True)
def _host_nodes(request):
    """`import nodes` means ComfyUI's nodes.py during host tests (see hostsetup.host_nodes_module)."""
    path = hostsetup.comfyui_path()
    if not hostsetup.host_present(path):
        yield
        return
    with hostsetup.host_nodes_module(path):
        yield


@pytest.fixture(scope="session")
def host_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("carnator-host")
    return {"models": str(root / "diffusion_models"), "custom_nodes": str(root / "custom_nodes"), "root": root}


@pytest.fixture(scope="session")
def plugin(comfy, host_dirs):
    """This repository loaded by ComfyUI's own custom-node loader; returns (package module, install path)."""
    with hostsetup.host_nodes_module(hostsetup.comfyui_path()):
        return hostsetup.load_plugin(comfy, host_dirs["custom_nodes"])


@pytest.fixture(scope="session")
def model_name(comfy, host_dirs) -> str:
    return hostsetup.build_tiny_wan(host_dirs["models"])


@pytest.fixture(scope="session")
def tiny_model(comfy, model_name):
    """The tiny Wan 2.1 T2V model, loaded through the core UNETLoader node."""
    return comfy.NODE_CLASS_MAPPINGS["UNETLoader"]().load_unet(model_name, "default")[0]


class CallCounter:
    """Counts real forward calls of the diffusion model (a DIFFUSION_MODEL wrapper on a clone)."""

    def __init__(self, model):
        from comfy.patcher_extension import WrappersMP
        self.calls = 0
        self.model = model.clone()

        def count(executor, *args, **kwargs):
            self.calls += 1
            return executor(*args, **kwargs)
        count.carnator_fingerprint = ""      # observes only: declared, so Carnator's model key can include it
        self.model.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "carnator_test_counter", count)

    def take(self) -> int:
        calls, self.calls = self.calls, 0
        return calls


@pytest.fixture
def counted(tiny_model):
    return CallCounter(tiny_model)


@pytest.fixture
def conds():
    """(positive, negative) CONDITIONING shaped as Wan's umT5 gives it."""
    return hostsetup.conditioning(1), hostsetup.conditioning(2)


@pytest.fixture
def latent(comfy):
    return hostsetup.empty_video_latent(comfy)          # [1, 16, 5, 16, 16]: 320 tokens
