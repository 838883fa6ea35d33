"""benchmarks/trace.py on a few requests of the trace with the shipped demo weights: its methods, figures, JSON and
plot (the figures themselves come from the full run, benchmarks/RESULTS.md)."""
from __future__ import annotations

import pytest

from test_quality_smoke import _script


def test_trace_runs_its_methods_against_no_reuse_and_writes_json_and_plot(tmp_path):
    trace = _script("trace")
    out = tmp_path / "trace.json"
    assert trace.main(["--requests", "4", "--pairs", "1", "--steps", "6", "--probe-steps", "2", "--fewer-steps", "4",
                       "--text-resume-step", "3", "--habits", "fixed", "--methods", "carnator_balanced,steps_4",
                       "--out", str(out)]) == 0
    report = _script("reports").read(str(out))
    table = report["results"]["fixed"]
    assert list(table) == ["no_reuse", "carnator_balanced", "steps_4"]
    base, fewer = table["no_reuse"], table["steps_4"]
    assert base["model_calls_saved"] == 0 and base["change"] == 0 and base["speedup_calls"] == 1
    assert fewer["model_calls_saved"] == pytest.approx(2 / 6) and fewer["speedup_calls"] == pytest.approx(1.5)
    carnator = table["carnator_balanced"]
    assert carnator["change_low"] <= carnator["change"] <= carnator["change_high"]
    assert set(carnator["per_operation"]) <= {"new_idea", "reroll", "repeat", "nudge", "edit", "paraphrase", "return"}
    assert carnator["look_alike_pairs"]["requests"] == 1
    assert len(report["rows"]["fixed"]["carnator_balanced"]["trace"]) == 4
    assert report["trace"]["fixed"]["requests"] == 4
    assert (tmp_path / "trace.png").stat().st_size > 0
    assert trace.main(["--from-json", str(out), "--png", str(tmp_path / "again.png"), "--md", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0          # tables and plot again, from the JSON alone
    assert "| fixed | steps_4 | 0% (0) | 33.3% | 1.50x / " in (tmp_path / "t.md").read_text()
    # a long run goes one seed habit at a time: their JSON join into one table and plot
    other = dict(report, results={"randomize": table}, trace={"randomize": report["trace"]["fixed"]})
    _script("reports").write(str(tmp_path / "other.json"), other)
    both = f"{out},{tmp_path / 'other.json'}"
    assert trace.main(["--from-json", both, "--png", str(tmp_path / "both.png"), "--md", str(tmp_path / "b.md")]) == 0
    assert [line.split(" | ")[0] for line in (tmp_path / "b.md").read_text().splitlines()[2:]] == \
        ["| fixed"] * 3 + ["| randomize"] * 3
    with pytest.raises(SystemExit):
        trace.main(["--from-json", f"{out},{out}", "--png", str(tmp_path / "twice.png")])
    _script("reports").write(str(tmp_path / "seed1.json"), dict(other, args={**report["args"], "seed": 1}))
    with pytest.raises(SystemExit):         # another seed: another trace
        trace.main(["--from-json", f"{out},{tmp_path / 'seed1.json'}", "--png", str(tmp_path / "seed1.png")])


def test_trace_refuses_bad_options_naming_them(capsys):
    trace = _script("trace")
    for argv, named in ((["--habits", "increment"], "--habits increment"), (["--methods", "magic"], "magic"),
                        (["--fewer-steps", "30"], "--fewer-steps (30)"), (["--requests", "0"], "--requests (0)")):
        with pytest.raises(SystemExit):
            trace.main(argv)
        assert named in capsys.readouterr().err


def test_jobs_in_processes_give_the_figures_of_one_process(tmp_path):
    # The GPU run splits no_reuse's requests over processes and runs each method in its own: the same figures.
    trace, reports = _script("trace"), _script("reports")
    common = ["--requests", "3", "--pairs", "0", "--steps", "4", "--probe-steps", "1", "--fewer-steps", "2",
              "--text-resume-step", "2", "--habits", "randomize", "--methods", "carnator_balanced"]
    for jobs in ("1", "2"):
        assert trace.main(common + ["--jobs", jobs, "--out", str(tmp_path / f"jobs{jobs}.json")]) == 0
    one, two = (reports.read(str(tmp_path / f"jobs{jobs}.json")) for jobs in ("1", "2"))
    timeless = lambda report: {name: {k: v for k, v in s.items() if "seconds" not in k}  # noqa: E731
                               for name, s in report["results"]["randomize"].items()}
    assert timeless(one) == timeless(two)
    assert [r["prompt"] for r in one["rows"]["randomize"]["no_reuse"]["trace"]] == \
        [r["prompt"] for r in two["rows"]["randomize"]["no_reuse"]["trace"]]


def test_a_kept_work_dir_runs_only_what_it_lacks_and_refuses_other_settings(tmp_path, capsys):
    # a long CPU run goes in parts: what an earlier part finished is read, not run again
    trace, reports = _script("trace"), _script("reports")
    common = ["--requests", "3", "--pairs", "0", "--steps", "4", "--probe-steps", "1", "--fewer-steps", "2",
              "--text-resume-step", "2", "--habits", "randomize", "--work-dir", str(tmp_path / "work")]
    assert trace.main(common + ["--methods", "steps_2", "--out", str(tmp_path / "a.json")]) == 0
    capsys.readouterr()
    assert trace.main(common + ["--methods", "steps_2,carnator_balanced", "--out", str(tmp_path / "b.json")]) == 0
    said = capsys.readouterr().err
    assert "randomize steps_2: read from" in said and "carnator_balanced: read" not in said
    first, both = (reports.read(str(tmp_path / name))["results"]["randomize"] for name in ("a.json", "b.json"))
    assert list(both) == ["no_reuse", "steps_2", "carnator_balanced"] and both["steps_2"] == first["steps_2"]
    with pytest.raises(SystemExit):
        trace.main(common[:-4] + ["--work-dir", str(tmp_path / "work"), "--requests", "4", "--out",
                                  str(tmp_path / "c.json")])
    error = capsys.readouterr().err
    assert "holds a run with other settings (requests)" in error


def test_every_region_method_of_quality_is_a_trace_method_with_the_default_gate():
    """The trace prices region-only resume as the product runs it, in 16 and in 8 bits (region_kv_8bit)."""
    trace, quality = _script("trace"), _script("quality")
    table = trace.methods(14)
    for name in ("carnator_region", "carnator_region_8bit"):
        assert name in quality.REGION_METHODS and table[name] == (name, trace.DEFAULT_RISK, {}, {})
