"""CARNATOR_REQUIRE_ALL_TESTS=1 (set by .ci/run) turns every skip but a GPU test's into a failure.

A throwaway test folder uses this suite's conftest.py; pytest runs it in a subprocess with and without the switch.
"""
import os
import subprocess
import sys
import textwrap

import torch

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = {
    "conftest.py": f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("carnator_suite_conftest", {os.path.join(HERE, "conftest.py")!r})
        suite = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(suite)
        globals().update({{k: v for k, v in vars(suite).items() if k.startswith("pytest_")}})
    """,
    "test_cases.py": """
        import pytest

        def test_runs():
            pass

        def test_host_absent():
            pytest.skip("no ComfyUI here")

        @pytest.mark.skipif(True, reason="no Chromium here")
        def test_browser_absent():
            pass

        @pytest.mark.gpu
        def test_needs_a_gpu():
            pass
    """,
    "test_module_skip.py": """
        import pytest
        pytest.importorskip("carnator_no_such_package")

        def test_never_collected():
            pass
    """,
}


def run_pytest(tmp_path, switch: str) -> subprocess.CompletedProcess:
    for name, text in CASES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {k: v for k, v in os.environ.items() if k != "CARNATOR_REQUIRE_ALL_TESTS"}
    env["CARNATOR_REQUIRE_ALL_TESTS"] = switch
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_without_the_switch_skips_stay_skips(tmp_path):
    run = run_pytest(tmp_path, "")
    assert run.returncode == 0, run.stdout
    assert "1 passed" in run.stdout and "skipped" in run.stdout and "failed" not in run.stdout
    # The run says how many skipped, how many of them for a missing prerequisite and how to run those, and how many
    # need a GPU: every skip is counted.
    gpu = 0 if torch.cuda.is_available() else 1
    assert (f"{3 + gpu} tests skipped: 3 for a missing host, browser, Redis or package (to run them: COMFYUI_PATH="
            in run.stdout), run.stdout
    assert ("), 1 that need a CUDA GPU" in run.stdout) == bool(gpu)


def test_with_the_switch_only_gpu_tests_may_skip(tmp_path):
    run = run_pytest(tmp_path, "1")
    assert run.returncode != 0, run.stdout
    out = run.stdout
    for name in ("test_host_absent", "test_browser_absent", "test_module_skip.py"):
        line = next((line for line in out.splitlines() if name in line and line.startswith(("FAILED", "ERROR"))), None)
        assert line, f"{name} was not turned into a failure:\n{out}"
    assert "no ComfyUI here" in out and "no Chromium here" in out      # the reason travels with the failure
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED") and "test_cases.py" in line]
    if not torch.cuda.is_available():
        assert len(skipped) == 1 and "needs a CUDA GPU" in skipped[0], out
    assert "PASSED test_cases.py::test_runs" in out
