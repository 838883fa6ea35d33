"""The web extension's pure formatting (web/lib/format.js) under `node --test`; skipped without node."""
import os
import shutil
import subprocess

import pytest

NODE = shutil.which("node")
TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "browser", "format.test.mjs")


@pytest.mark.skipif(NODE is None, reason="node is not installed")
def test_format_module():
    run = subprocess.run([NODE, "--test", TESTS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
