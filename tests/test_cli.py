"""The command line (python -m carnator_engine): stats and clear on missing and existing caches, confirmation,
help for every flag, the one default size limit, the demo table's legend."""
import argparse

import pytest

from carnator_engine import __main__ as cli
from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore
from test_store import _put as put_entry


@pytest.fixture
def filled(tmp_path):
    directory = tmp_path / "cache"
    store = CarnatorStore(str(directory), 64 << 20)
    put_entry(store)
    store.close()
    return directory


def entries(directory) -> int:
    store = CarnatorStore(str(directory), 64 << 20)
    try:
        return store.stats()["entries"]
    finally:
        store.close()


@pytest.mark.parametrize("command", [["stats"], ["clear", "--yes"]])
def test_missing_cache_is_reported_and_nothing_is_created(tmp_path, capsys, command):
    missing = tmp_path / "no" / "cache"
    assert cli.main(command + ["--cache", str(missing)]) == 1
    assert f"no Carnator cache at {missing} (nothing created)" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_stats_of_an_existing_cache(filled, capsys):
    assert cli.main(["stats", "--cache", str(filled)]) == 0
    assert '"entries": 1' in capsys.readouterr().out


def test_clear_asks_first_and_keeps_everything_without_a_yes(filled, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)        # CI, a pipe: nobody to ask
    assert cli.main(["clear", "--cache", str(filled)]) == 1
    assert "nothing deleted: confirm at the prompt, or pass --yes" in capsys.readouterr().err
    assert entries(filled) == 1
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    answers = iter(["n", "y"])
    asked = []
    monkeypatch.setattr("builtins.input", lambda question: asked.append(question) or next(answers))
    assert cli.main(["clear", "--cache", str(filled)]) == 1 and entries(filled) == 1
    assert cli.main(["clear", "--cache", str(filled)]) == 0 and entries(filled) == 0
    assert asked[0].startswith("delete all 1 entries of the cache at ") and asked[0].endswith("[y/N] ")


def test_clear_with_yes_deletes_without_asking(filled, monkeypatch, capsys):
    monkeypatch.setattr("builtins.input", lambda question: pytest.fail("asked although --yes was given"))
    assert cli.main(["clear", "--cache", str(filled), "--yes"]) == 0
    assert entries(filled) == 0 and "removed 1 entries" in capsys.readouterr().out


def test_every_flag_has_help_and_the_default_size_limit_is_the_engines():
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"demo", "stats", "clear"}
    for name, sub in commands.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings} has no help text"
            if action.dest == "size_limit_mb":
                assert action.default << 20 == DEFAULT_SIZE_LIMIT == 8 << 30


def test_demo_legend_explains_the_columns():
    legend = cli.demo_legend(20, 3, 6, "colour, shape, direction, background, size, speed")
    assert "miss: its own probe's end (k = probe steps = 3)" in legend
    assert "repeat: k = 20, the stored result of an earlier full generation" in legend
    assert "HIT: a cached trajectory's step k, after the 3 probe steps (calls = 3 + 20 - k, one more" in legend
    assert "how many of the prompt's 6 attributes" in legend and "read back from its pixels (6/6: all" in legend
    assert "The first request also pays one-time start-up costs" in legend


@pytest.mark.parametrize("command", [["demo", "--cache", "/etc"], ["stats", "--cache", "/"],
                                     ["clear", "--yes", "--cache", "unix://:s3cret@/run/redis.sock"]])
def test_a_system_folder_or_a_foreign_url_is_a_one_line_error(command, capsys, monkeypatch):
    import os

    import diskcache

    def no_writes(*args, **kwargs):   # so that a regression fails here instead of writing into a system folder
        raise AssertionError(f"{command}: a store was being created in a system folder")
    monkeypatch.setattr(os, "makedirs", no_writes)
    monkeypatch.setattr(diskcache, "Cache", no_writes)
    code = cli.main(command)
    printed = capsys.readouterr()
    assert code == 2 or (code != 0 and "no Carnator cache" in printed.err), printed
    assert "s3cret" not in printed.out + printed.err and printed.err.count("\n") <= 1


def test_a_foreign_folder_is_refused_by_the_demo_and_left_alone(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("user data")
    assert cli.main(["demo", "--cache", str(tmp_path)]) == 2
    assert "not a Carnator store" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
