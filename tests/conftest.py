"""Shared fixtures, and the CI switch CARNATOR_REQUIRE_ALL_TESTS.

Tests skip with a reason when a prerequisite is missing (the ComfyUI host, Chromium, node's packages, Redis, a
Python package). With CARNATOR_REQUIRE_ALL_TESTS=1 (what .ci/run sets) every such skip is a failure instead, so
a CI run that silently lost its host or browser cannot pass. The one exception is a test marked `gpu`: it needs
a CUDA GPU, skips on a machine without one, and is the only test allowed to skip under the switch.
"""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the engine, and this folder's helper modules (run_temp, redis_server, ...) for a suite that loads this file
sys.path[:0] = [folder for folder in (ROOT, os.path.join(ROOT, "tests")) if folder not in sys.path]

from carnator_engine.backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT  # noqa: E402

# one temporary folder per run, removed at its end; a file a test leaves in it fails the run (tests/run_temp.py)
pytest_plugins = ("run_temp",)

WORDS = "a red green blue circle square moving left right up down on black white background".split()


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return TinyVideoDiT(TinyDiTConfig(vocabulary=WORDS, dim=64, heads=2, layers=2, text_layers=1)).eval()


@pytest.fixture(scope="session")
def live_tiny_model():
    """tiny_model's architecture with its zero-initialised gates and head random too: a fresh TinyVideoDiT predicts
    zero whatever its blocks compute, so only this one shows what a change to the attention does to a result."""
    torch.manual_seed(0)
    model = TinyVideoDiT(TinyDiTConfig(vocabulary=WORDS, dim=64, heads=2, layers=2, text_layers=1)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("head.") or ".modulation." in name:
                param.normal_(0.0, 0.05)
    return model


@pytest.fixture
def store(tmp_path):
    from carnator_engine.store import CarnatorStore
    opened = CarnatorStore(str(tmp_path / "cache"), size_limit_bytes=64 << 20)
    yield opened
    opened.close()


@pytest.fixture
def held_writes(monkeypatch):
    """Store writes held until a thread has to wait for them (tests/held_writes.py); let go at teardown."""
    from held_writes import hold_writes
    release = hold_writes(monkeypatch)
    yield release
    release.set()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test (AOF on, so a restart keeps what was acknowledged)."""
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis"), appendonly=True).start()
    yield server
    server.stop()


REQUIRE_ALL_TESTS = os.environ.get("CARNATOR_REQUIRE_ALL_TESTS", "") == "1"
GPU_SKIP_REASON = "needs a CUDA GPU (marked gpu: the only tests allowed to skip under CARNATOR_REQUIRE_ALL_TESTS=1)"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skips without one (allowed under "
                                       "CARNATOR_REQUIRE_ALL_TESTS=1, unlike every other skip)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason=GPU_SKIP_REASON))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def _as_failure(report, what: str) -> None:
    reason = _skip_reason(report)
    report.outcome = "failed"
    report.longrepr = (f"CARNATOR_REQUIRE_ALL_TESTS=1: {what} was skipped ({reason}); only tests marked gpu may "
                       "skip here: install what the reason names")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL_TESTS and report.skipped and not hasattr(report, "wasxfail") \
            and item.get_closest_marker("gpu") is None:
        _as_failure(report, item.nodeid)


_SKIPPED_MODULES: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at import (pytest.importorskip at module level) fails the run too. It is not made a
    collection error, which would stop the session before any test ran; the run's exit status says it instead."""
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_ALL_TESTS and report.skipped:
        _SKIPPED_MODULES.append(f"{collector.nodeid}: {_skip_reason(report)}")


ENABLE_SKIPPED = ("COMFYUI_PATH=/path/to/ComfyUI python -m pytest -q tests (README, Tests: the host, Chromium, Redis and "
                  "the browser packages; .ci/run installs them all)")


def pytest_terminal_summary(terminalreporter):
    for line in _SKIPPED_MODULES:
        terminalreporter.write_line(f"FAILED (CARNATOR_REQUIRE_ALL_TESTS=1, module skipped) {line}", red=True)
    skipped = terminalreporter.stats.get("skipped", [])
    gpu = sum(GPU_SKIP_REASON in _skip_reason(r) for r in skipped)
    parts = ([f"{len(skipped) - gpu} for a missing host, browser, Redis or package (to run them: {ENABLE_SKIPPED})"]
             if len(skipped) > gpu else []) + ([f"{gpu} that need a CUDA GPU"] if gpu else [])
    if skipped:
        terminalreporter.write_line(f"{len(skipped)} tests skipped: {', '.join(parts)}", yellow=True)


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED_MODULES and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
