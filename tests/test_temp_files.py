"""A test run leaves nothing in the system's temporary folder: pytest's folders, torch's compile cache and what the
tests put in TMPDIR live under one folder of the run, removed at its end, and a file left in TMPDIR fails the run.

A throwaway test folder uses the suite's plugin (tests/run_temp.py); pytest runs it in a subprocess whose TMPDIR
stands for /tmp.
"""
import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

TESTS = """
    import os
    import tempfile

    def test_cleans_up(tmp_path):
        (tmp_path / "kept-by-pytest").write_text("x")
        with tempfile.TemporaryDirectory() as scratch:
            open(os.path.join(scratch, "f"), "w").close()

    def test_leaves_a_folder():
        assert tempfile.gettempdir() == os.environ["TMPDIR"]      # subprocesses get the same folder
        tempfile.mkdtemp(prefix="left-behind-")
"""


def test_a_folder_left_in_the_temporary_folder_fails_the_run_is_named_and_nothing_stays(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {HERE!r})\npytest_plugins = ('run_temp',)\n")
    (suite / "test_cases.py").write_text(textwrap.dedent(TESTS))
    system_temp = tmp_path / "system-temp"
    system_temp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(TMPDIR=str(system_temp))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite)], cwd=suite,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "2 passed" in run.stdout, run.stdout
    # only the folder the second test left is named: pytest's folders and a removed TemporaryDirectory are not
    left = [line for line in run.stdout.splitlines() if "FAILED: the run left" in line]
    assert len(left) == 1 and left[0].count("left-behind-") == 1 and "," not in left[0].split(" in the ")[0], left
    assert os.listdir(system_temp) == []                     # and nothing stays in the "/tmp" of the run


def test_this_run_keeps_its_temporary_files_in_its_own_folder():
    import tempfile
    assert tempfile.gettempdir() == os.environ["TMPDIR"] and os.path.basename(tempfile.gettempdir()) == "tmp"
    assert os.path.basename(os.path.dirname(tempfile.gettempdir())).startswith("carnator-tests-")
    assert os.path.dirname(HERE) not in tempfile.gettempdir()


def test_compilers_keep_their_caches_in_the_runs_folder_not_in_tmpdir():
    """Torch's inductor, the CuTe DSL and FlashAttention-4 would make TMPDIR/<user>/... (on a GPU with FA4 the run
    failed for the folder they left); under the run's folder (or where the user set them), never in TMPDIR."""
    import tempfile
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"):
        folder = os.path.abspath(os.environ[variable])
        assert os.path.commonpath([folder, tempfile.gettempdir()]) != tempfile.gettempdir(), variable


def test_a_passing_tests_folder_goes_when_it_ends_so_a_run_needs_the_disk_of_one_test(request):
    """The suite's pytest settings (pyproject.toml, read by the README's test command from the repository's root)
    remove each passing test's tmp_path as it ends: together the tests' folders reach 1.3 GB."""
    assert str(request.config.inipath) == os.path.join(os.path.dirname(HERE), "pyproject.toml")
    assert request.config.getini("tmp_path_retention_policy") == "failed"
