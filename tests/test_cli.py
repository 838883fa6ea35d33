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
    assert "how many times faster than the first request, the cold miss (a warm-up call ran before it" in legend


def test_demo_checks_its_outputs_before_any_work_and_leaves_no_cache_behind(tmp_path, capsys, monkeypatch):
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temporary))
    monkeypatch.setattr("carnator_engine.__main__._load_demo_model", lambda path: pytest.fail("loaded the model"))
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    cases = [(["--json", str(tmp_path / "missing" / "out.json")], "--json"),
             (["--out", str(a_file / "frames")], "--out"),
             (["--steps", "2", "--probe-steps", "3"], "probe_steps=3 must be between 1 and steps-1")]
    for flags, named in cases:
        assert cli.main(["demo", "--out", str(tmp_path / "frames")] + flags) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and named in err and err.count("\n") == 1
    assert list(temporary.iterdir()) == [] and not (tmp_path / "missing").exists()
    assert a_file.read_text() == "mine" and not (tmp_path / "frames").exists()


def test_progress_line_is_rewritten_on_a_terminal_and_absent_elsewhere():
    import io
    from carnator_engine.demo.session import Progress
    for live in (True, False):
        stream = io.StringIO()
        progress = Progress(stream, live)
        progress.start("[3/6] size edit")
        progress.call()
        progress.call()
        progress.clear()
        shown = stream.getvalue()
        if live:
            assert "\r[3/6] size edit: model call 2" in shown and shown.endswith("\r")
            assert shown.rsplit("\r", 2)[1].strip() == ""        # the line is blanked before the row is printed
        else:
            assert shown == ""


def test_each_miss_is_explained_in_plain_words():
    from types import SimpleNamespace
    from carnator_engine.demo.session import miss_in_plain_words
    from carnator_engine.gate import policy_for
    policy = policy_for("balanced")
    within = {"hidden": 0.001, "attention": 0.01, "context": 0.01, "context_share": 0.1, "target_fraction": 0.2}
    assert miss_in_plain_words(SimpleNamespace(numbers={}), policy).startswith("nothing comparable in the cache")
    assert "covers 66% of the clip, more than the 50%" in miss_in_plain_words(
        SimpleNamespace(numbers={**within, "target_fraction": 0.66}), policy)
    assert "reads this prompt differently" in miss_in_plain_words(
        SimpleNamespace(numbers={**within, "hidden": 0.5}), policy)
    assert "early picture differs" in miss_in_plain_words(
        SimpleNamespace(numbers={**within, "context_share": 0.9}), policy)
    assert "would save too little" in miss_in_plain_words(SimpleNamespace(numbers=within), policy)


def test_frames_are_valid_pngs_of_the_clip():
    import struct
    import zlib

    import torch
    from carnator_engine.demo import frames
    clip = -torch.ones(3, 2, 4, 4)
    clip[0] = 1.0                                                 # red frames
    image = frames.picture([("HIT 1.5X", clip)])
    data = frames.png_bytes(image)
    width, height = struct.unpack(">II", data[16:24])
    assert (height, width) == tuple(image.shape[:2])
    pixels = zlib.decompress(data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8])
    assert len(pixels) == height * (1 + 3 * width)
    strip = frames.clip_strip(clip)
    assert strip.shape == (4 * frames.FRAME_SCALE, 2 * 4 * frames.FRAME_SCALE + frames.GAP, 3)
    assert strip[0, 0].tolist() == [255, 0, 0]
    assert frames.caption("1.5X").any() and not frames.caption("   ").any()


def test_stats_tells_exact_repeats_from_hits(tmp_path, capsys, tiny_model):
    import json

    from carnator_engine.euler import TinyDiTRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.schedule import flow_sigmas
    import torch
    directory = tmp_path / "cache"
    store = CarnatorStore(str(directory), 64 << 20)
    noise, sigmas = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(0)), flow_sigmas(8)
    for _ in range(2):       # a miss, then its exact repeat
        generate(TinyDiTRunner(tiny_model, "a red circle"), noise, sigmas, store, CarnatorConfig(probe_steps=2))
    store.close()
    assert cli.main(["stats", "--cache", str(directory)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 1 and stats["exact_repeats"] == 1 and stats["hits"] == 0


def test_stats_verify_reports_entries_whose_blobs_were_overwritten(filled, capsys):
    import json

    from store_damage import get_raw, set_raw
    store = CarnatorStore(str(filled), 64 << 20)
    entry = store.records()[0].entry_id
    set_raw(store, entry, "blob", bytes(len(get_raw(store, entry, "blob"))))   # same size, other bytes
    store.close()
    assert cli.main(["stats", "--cache", str(filled)]) == 0
    assert json.loads(capsys.readouterr().out)["corrupt"] == 0                # not read, not known
    assert cli.main(["stats", "--cache", str(filled), "--verify"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["corrupt"] == 1 and [c["entry"] for c in report["corrupt_entries"]] == [entry]
    assert "does not match its checksum" in report["corrupt_entries"][0]["why"]


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


def test_a_nul_byte_in_the_cache_path_is_named_not_a_bare_value_error(tmp_path, capsys):
    assert cli.main(["demo", "--cache", str(tmp_path / "ca\x00che"), "--steps", "2", "--probe-steps", "1"]) == 2
    assert "holds a NUL character" in capsys.readouterr().err and not list(tmp_path.iterdir())
