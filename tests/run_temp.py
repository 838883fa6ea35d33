"""Every temporary file of a test run lives under one folder of that run, removed at its end (a pytest plugin).

pytest's tmp_path folders, torch's compile cache, and whatever the tests, the benchmarks they run and the processes
they start put in the temporary folder (TMPDIR points there) all go under it. What a test or benchmark leaves in
TMPDIR fails the run and is named: in /tmp it would pile up run after run.
"""
import os
import shutil
import tempfile

import pytest

_RUN: dict = {}
_LEFT: list = []


# compilers' caches that would otherwise go under TMPDIR/<user>: torch's inductor, and on a GPU with FlashAttention-4
# the CuTe DSL's (made when it is imported) and FA4's own; the run folder takes them
COMPILE_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "CUTE_DSL_CACHE_DIR": "cute_dsl",
                  "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attention_cute_dsl"}


@pytest.hookimpl(tryfirst=True)   # before pytest's own tmp_path plugin reads --basetemp
def pytest_configure(config):
    run = tempfile.mkdtemp(prefix="carnator-tests-")
    temp = os.path.join(run, "tmp")
    os.mkdir(temp)
    _RUN.update(run=run, temp=temp, environ={name: os.environ.get(name) for name in ("TMPDIR", *COMPILE_CACHES)})
    if config.option.basetemp is None:
        config.option.basetemp = os.path.join(run, "pytest")
    os.environ["TMPDIR"] = tempfile.tempdir = temp
    for variable, folder in COMPILE_CACHES.items():
        os.environ.setdefault(variable, os.path.join(run, folder))


# inductor keeps its C++ headers in TMPDIR for the life of the process and remembers having made them: removed by a
# test, a later compile in the same run fails ("precompiled header ... No such file"); the run folder takes them
INDUCTOR_HEADERS = "torchinductor_"


def pytest_sessionfinish(session, exitstatus):
    _LEFT[:] = sorted(name for name in os.listdir(_RUN["temp"]) if not name.startswith(INDUCTOR_HEADERS)) \
        if _RUN else []
    if _LEFT and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _LEFT:
        terminalreporter.write_line(f"FAILED: the run left {', '.join(_LEFT)} in the temporary folder: the test or "
                                    "benchmark that made it must remove it", red=True)


def pytest_unconfigure(config):
    if not _RUN:
        return
    for name, value in _RUN["environ"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None
    shutil.rmtree(_RUN["run"], ignore_errors=True)
    _RUN.clear()
