"""A few requests through benchmarks/quality.py with the shipped demo weights: the script's plumbing
(methods, summary, JSON) and its reference cache, which must give the numbers a fresh run gives."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_runs_and_its_reference_cache_reproduces_a_fresh_run(tmp_path):
    quality = _script("quality")
    common = ["--stream", "3", "--restart-every", "3", "--pairs", "1", "--steps", "8", "--probe-steps", "2",
              "--methods", "no_reuse,carnator", "--reference-cache", str(tmp_path / "reference.pt")]
    assert quality.main(common + ["--out", str(tmp_path / "first.json")]) == 0
    assert (tmp_path / "reference.pt").exists()
    assert quality.main(common + ["--out", str(tmp_path / "second.json")]) == 0
    reports = _script("reports")
    first, second = (reports.read(str(tmp_path / name)) for name in ("first.json", "second.json"))
    timeless = lambda report: {kind: {method: {k: v for k, v in summary.items() if k != "seconds_per_request"}  # noqa: E731
                                      for method, summary in table.items()}
                               for kind, table in report["results"].items()}
    assert timeless(first) == timeless(second)
    stream = first["results"]["iteration_stream"]
    assert stream["no_reuse"]["model_calls_saved"] == 0 and stream["no_reuse"]["psnr"] == 100.0
    assert set(first["rows"]["carnator"]["stream"][0]) >= {"reused", "model_calls", "read", "psnr"}
    assert stream["carnator"]["made_wrong"] + stream["carnator"]["made_right"] <= 3

    suite = _script("quality")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "quality_never_refuse_12.json").write_text((tmp_path / "first.json").read_text())
    assert "rows" not in json.loads((tmp_path / "first.json").read_text())   # the summary alone, rows gzipped
    assert first["rows_file"] == "first.rows.json.gz" and (tmp_path / "first.rows.json.gz").exists()
    markdown = suite.tables(str(tmp_path / "suite"))
    assert "| main | fresh | Carnator, refine off | " in markdown


def test_a_stale_reference_cache_is_regenerated(tmp_path, capsys):
    quality = _script("quality")
    common = ["--stream", "2", "--restart-every", "2", "--pairs", "1", "--steps", "6", "--probe-steps", "2",
              "--methods", "no_reuse", "--reference-cache", str(tmp_path / "reference.pt")]
    assert quality.main(common + ["--out", str(tmp_path / "a.json")]) == 0
    assert quality.main(common + ["--guidance", "1.5", "--out", str(tmp_path / "b.json")]) == 0
    assert "holds generations of other weights or requests: regenerating" in capsys.readouterr().err
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["args"]["guidance"] == 1.5 and b["results"]["iteration_stream"]["no_reuse"]["requests"] == 2


def test_text_baseline_embeddings_are_kept_by_prompt_and_the_encoder_loads_only_for_new_ones(tmp_path, monkeypatch):
    import pytest
    import torch
    quality = _script("quality")
    path = str(tmp_path / "embeddings.pt")
    loads = []

    class Encoder:
        def encode(self, prompts, normalize_embeddings):
            return torch.nn.functional.normalize(torch.arange(1.0, 4.0).repeat(len(prompts), 1) + len(prompts[0]), dim=-1).numpy()

    monkeypatch.setattr(quality, "load_sentence_encoder", lambda: loads.append(1) or Encoder())
    first = quality.CachedSentenceEncoder(path).encode(["a red circle", "a blue square"])
    assert loads == [1] and first.shape == (2, 3)
    again = quality.CachedSentenceEncoder(path).encode(["a blue square"])        # from the file: no load
    assert loads == [1] and torch.equal(again[0], first[1])
    torch.save({"encoder": "another model", "embeddings": {}}, path)
    with pytest.raises(ValueError, match="holds embeddings of 'another model'"):
        quality.CachedSentenceEncoder(path)


def test_sign_test_of_flips():
    quality = _script("quality")
    assert quality.sign_test(0, 0) == 1.0
    assert quality.sign_test(2, 2) == 1.0
    assert abs(quality.sign_test(5, 0) - 2 / 32) < 1e-12          # 5 flips, all one way
    assert abs(quality.sign_test(1, 4) - quality.sign_test(4, 1)) < 1e-12


def test_gate_ceiling_takes_the_furthest_safe_resume_of_each_request(tmp_path):
    ceiling = _script("quality")
    out = tmp_path / "ceiling.json"
    assert ceiling.main(["ceiling", "--stream", "3", "--restart-every", "3", "--steps", "8", "--probe-steps", "2",
                         "--candidates", "2", "--out", str(out)]) == 0
    report = _script("reports").read(str(out))
    cold, *warm = report["rows"]
    assert cold["trials"] == [] and cold["oracle_resume_step"] == 2
    for row in warm:
        steps = {t["resume_step"] for t in row["trials"]}
        assert steps and min(steps) > 3      # a resume must save at least one call past the probe
        safe = [t["resume_step"] for t in row["trials"] if not t["made_wrong"]]
        assert row["oracle_resume_step"] == max(safe, default=2)
    saved = sum(row["oracle_resume_step"] - 2 for row in report["rows"]) / (8 * 3)
    assert abs(report["summary"]["oracle_calls_saved"] - saved) < 1e-12

    suite = _script("quality")
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "gate_ceiling.json").write_text(out.read_text())
    table = suite.ceiling_table(str(tmp_path / "suite"))
    steps = report["summary"]["nearest_entry_at_fixed_step"]
    assert table[1].startswith("| resume step | calls saved | main, fresh (no reuse ")
    assert len(table) == 3 + len(steps) + 1 and table[-1].startswith("| oracle (hindsight) |")
    assert suite.ceiling_table(str(tmp_path / "nothing")) == []


def test_pooled_sets_add_up_with_a_paired_interval(tmp_path, capsys):
    import math

    import pytest
    suite = _script("quality")
    assert suite.request_set("pooled3_aggressive") == "pooled3"
    assert suite.request_set("replication_seed1") == "replication" and suite.request_set("own_jump_11") == "main"
    assert set(suite.GROUPS["pooled"]) == {f"pooled{s}_{c}" for s in suite.POOLED_SEEDS for c in suite.POOLED_RUNS}
    assert not set(suite.GROUPS["pooled"]) & set(suite.GROUPS["cpu"])
    with pytest.raises(SystemExit):
        suite.main(["suite", "--only", "pooled1_balanced"])
    assert "pooled<seed>_<configuration> (seeds 2-9" in capsys.readouterr().err

    one = {"requests": 100, "hit_rate": 0.5, "model_calls_saved": 0.1, "attribute_accuracy": 0.9,
           "wrong_accepts": 2, "made_wrong": 3, "made_right": 1, "exact_repeats": 2}
    pooled = suite.pool([one, {**one, "made_wrong": 1, "made_right": 1, "exact_repeats": 0}])
    assert (pooled["requests"], pooled["made_wrong"], pooled["made_right"], pooled["exact_repeats"]) == (200, 4, 2, 2)
    assert pooled["change"] == pytest.approx(-0.01)
    half_width = 1.96 * math.sqrt((6 / 200 - 0.01 ** 2) / 200)   # per-request flips of -1, 0, +1
    assert pooled["change_high"] - pooled["change"] == pytest.approx(half_width)
    assert pooled["change"] - pooled["change_low"] == pytest.approx(half_width)
    older = {k: v for k, v in one.items() if k != "exact_repeats"}
    assert suite.pool([one, older])["exact_repeats"] == "not replayed"

    reference = {**one, "hit_rate": 0.0, "model_calls_saved": 0.0, "made_wrong": 0, "made_right": 0, "exact_repeats": 0}
    for seed in (2, 3):
        table = {"no_reuse": reference, "carnator": one}
        report = {"results": {"iteration_stream": table, "adversarial_pairs": table}}
        (tmp_path / f"quality_pooled{seed}_balanced.json").write_text(json.dumps(report))
    markdown = suite.tables(str(tmp_path))
    assert "| balanced | fresh | 2 | Carnator, refine off | 200 | 50% (4) | 10% | 90.0% (90.0%) | -2.0 (" in markdown


def test_one_run_of_each_request_set_goes_first_to_write_its_reference_cache():
    suite = _script("quality")
    leaders, rest = suite.stages(["never_refuse_12", "pooled2_balanced_refine", "pooled2_aggressive_refine",
                                  "pooled3_aggressive_refine", "replication_seed1_never_refuse_12", "pooled3_balanced"])
    assert leaders == ["pooled3_balanced", "never_refuse_12", "pooled2_balanced_refine",
                       "replication_seed1_never_refuse_12"]
    assert rest == ["pooled2_aggressive_refine", "pooled3_aggressive_refine"]
    assert all(suite.request_set(name) == name[:7] for name in suite.GROUPS["pooled"])
    assert suite.GROUPS["cpu"] == ["never_refuse_12", "replication_seed1_never_refuse_12"]


def test_each_carnator_method_names_its_refine_switch_whatever_the_default():
    import argparse
    quality = _script("quality")
    args = argparse.Namespace(probe_steps=3, risk="balanced", max_density=1.0, gate_overrides={}, region_max_share=0.5,
                              region_sparse_keys=False)
    assert quality.carnator_config("carnator_refine", args).policy().refine_target
    for region in ("carnator_region", "carnator_region_refresh0", "carnator_region_8bit"):   # on top of carnator_refine
        config = quality.carnator_config(region, args)
        assert config.region_only and config.policy().refine_target
        assert config.region_kv_8bit == (region == "carnator_region_8bit")
    assert quality.carnator_config("carnator_region_refresh0", args).region_refresh_steps == 0
    assert not quality.carnator_config("carnator_refine", args).region_only
    for plain in ("carnator", "carnator_no_localize", "carnator_dense"):
        assert not quality.carnator_config(plain, args).policy().refine_target
    assert not quality.carnator_config("carnator_dense", args).sparse_attention
    assert not quality.carnator_config("carnator_no_localize", args).localize
    assert not quality.carnator_config("carnator_region", args).region_sparse_keys
    args.region_sparse_keys = True                                     # --region-sparse-keys
    assert quality.carnator_config("carnator_region", args).region_sparse_keys
    args.gate_overrides = {"refine_target": True}                      # --gate still decides when given
    assert quality.carnator_config("carnator", args).policy().refine_target


RESULTS = os.path.join(ROOT, "benchmarks", "results")
GROUPS = {"quality", "gpu", "kernels", "store", "demo_model", "screenshots"}


def test_results_are_grouped_by_benchmark_and_every_report_keeps_its_rows():
    import gzip
    flat = [name for name in os.listdir(RESULTS) if not os.path.isdir(os.path.join(RESULTS, name))]
    assert flat == [], "benchmarks/results/ holds only one folder per benchmark"
    assert set(os.listdir(RESULTS)) <= GROUPS
    for folder in os.listdir(RESULTS):
        for name in os.listdir(os.path.join(RESULTS, folder)):
            if not name.endswith(".json"):
                continue
            with open(os.path.join(RESULTS, folder, name)) as handle:
                report = json.load(handle)
            if folder == "quality":   # store_scale's "rows" are its few table rows, kept readable
                assert "rows" not in report, f"{folder}/{name}: per-request rows belong in its .rows.json.gz"
            if "rows_file" in report:
                with gzip.open(os.path.join(RESULTS, folder, report["rows_file"]), "rt") as handle:
                    rows = json.load(handle)
                assert rows, f"{folder}/{report['rows_file']} is empty"


def test_every_file_results_md_names_exists():
    import re
    with open(os.path.join(ROOT, "benchmarks", "RESULTS.md")) as handle:
        text = handle.read()
    linked = re.findall(r"\]\((results/[^)\s]+)\)", text)
    assert linked, "RESULTS.md links its tables' files"
    missing = [path for path in linked if not os.path.exists(os.path.join(ROOT, "benchmarks", path))]
    assert missing == []
    named = re.findall(r"`(results/[^`*{]+)`", text)          # plain mentions (no wildcard) must exist too
    assert [p for p in named if not os.path.exists(os.path.join(ROOT, "benchmarks", p))] == []


def _summary(requests, wrong, right, saved):
    return {"requests": requests, "hit_rate": 0.5, "model_calls_saved": saved, "exact_repeats": 0,
            "attribute_accuracy": 0.9, "wrong_accepts": wrong, "made_wrong": wrong, "made_right": right}


def test_tradeoff_joins_the_runs_of_one_request_set_and_counts_its_requests_once(tmp_path):
    # A pooled set's methods run split over two files (the suite's per_request_alone / per_request_on_top), each
    # with the set's no_reuse reference: pooled, every set's requests count once, every method of both files shows.
    def write(name, seed, methods):
        args = {"seed": seed, "stream": 4, "pairs": 2, "fixed_seed": False, "restart_every": 10}
        results = {kind: {m: _summary(n, *methods[m]) for m in methods}
                   for kind, n in (("iteration_stream", 4), ("adversarial_pairs", 2))}
        (tmp_path / name).write_text(json.dumps({"args": args, "results": results}))
        return str(tmp_path / name)
    paths = [write("a2.json", 2, {"no_reuse": (0, 0, 0.0), "steps_12": (1, 0, 0.4)}),
             write("b2.json", 2, {"no_reuse": (0, 0, 0.0), "carnator_refine+steps_14": (0, 1, 0.5)}),
             write("a3.json", 3, {"no_reuse": (0, 0, 0.0), "steps_12": (1, 0, 0.4)})]
    tradeoff = _script("quality")
    sets = tradeoff.request_sets(tradeoff.load_runs(paths))
    totals = tradeoff.pooled(sets)["iteration_stream"]
    assert len(sets) == 2 and totals["no_reuse"]["requests"] == 8
    assert totals["steps_12"]["requests"] == 8 and totals["steps_12"]["made_wrong"] == 2
    assert totals["carnator_refine+steps_14"]["requests"] == 4 and totals["carnator_refine+steps_14"]["made_right"] == 1


def test_tradeoff_pairs_carnator_on_top_with_the_method_alone_on_the_same_scored_requests(tmp_path):
    # The goal is "equal or better accuracy than the method alone": two intervals against no reuse cannot resolve
    # that, the per-request flips between the two can. Only the second request of an adversarial pair is scored.
    reports = _script("reports")
    from carnator_engine.demo.world import ATTRIBUTES
    expected = {name: "x" for name in ATTRIBUTES}

    def row(prompt, right):
        return {"prompt": prompt, "seed": 1, "read": {**expected, "color": "x" if right else "y"}, "expected": expected}

    def write(name, methods):
        args = {"seed": 2, "stream": 3, "pairs": 1, "fixed_seed": False, "restart_every": 10}
        results = {kind: {m: _summary(n, 0, 0, 0.3) for m in methods} for kind, n in
                   (("iteration_stream", 3), ("adversarial_pairs", 1))}
        rows = {m: {"stream": [row(f"s{i}", r) for i, r in enumerate(stream)],
                    "pairs": [row(f"p{i}", r) for i, r in enumerate(pairs)]} for m, (stream, pairs) in methods.items()}
        reports.write(str(tmp_path / name), {"args": args, "results": results, "rows": rows})
        return str(tmp_path / name)
    paths = [write("alone.json", {"no_reuse": ([1, 1, 1], [1, 1]), "steps_14": ([1, 0, 1], [0, 1])}),
             write("on_top.json", {"no_reuse": ([1, 1, 1], [1, 1]), "carnator_refine+steps_14": ([0, 1, 0], [1, 0])})]
    tradeoff = _script("quality")
    flips = tradeoff.on_top_flips(tradeoff.load_runs(paths))
    assert flips["iteration_stream"] == {("carnator_refine+steps_14", "steps_14"): [2, 1, 3]}
    assert flips["adversarial_pairs"] == {("carnator_refine+steps_14", "steps_14"): [1, 0, 1]}   # the first not scored
    table = tradeoff.on_top_table(flips, tradeoff.pooled(tradeoff.request_sets(tradeoff.load_runs(paths))))
    assert "| iteration stream (3) | steps_14 | 30% / 30% | -33.3" in table
    # the same two runs committed as one pack read the same, rows included, and a pack names each run once
    reports.pack(str(tmp_path / "pack.json"), paths)
    assert not (tmp_path / "pack.json").read_text().count('"rows": {')      # the rows sit in the pack's rows file
    assert tradeoff.on_top_flips(tradeoff.load_runs([str(tmp_path / "pack.json")])) == flips
    assert list(reports.read_all(str(tmp_path / "pack.json"))) == ["alone", "on_top"]
    assert list(reports.read_all(paths[0])) == ["alone"]
    with pytest.raises(ValueError, match="named alone is packed already"):
        reports.pack(str(tmp_path / "twice.json"), [paths[0], paths[0]])


def test_quality_runs_on_world_v2_and_scores_whole_scenes(tmp_path):
    from carnator_engine.backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT
    from carnator_engine.demo import world2
    weights = tmp_path / "v2.safetensors"   # an untrained model of world v2's words: the plumbing, not its accuracy
    TinyVideoDiT(TinyDiTConfig(vocabulary=world2.VOCABULARY, text_len=world2.TEXT_LEN, dim=32, layers=1,
                               heads=2)).save(str(weights))
    quality = _script("quality")
    assert quality.main(["--world", "v2", "--weights", str(weights), "--stream", "3", "--restart-every", "3",
                         "--pairs", "2", "--steps", "6", "--probe-steps", "2", "--methods", "no_reuse,carnator",
                         "--out", str(tmp_path / "v2.json")]) == 0
    report = _script("reports").read(str(tmp_path / "v2.json"))
    stream = report["results"]["iteration_stream"]
    assert set(stream["no_reuse"]["per_attribute"]) == set(world2.SCORES)
    assert stream["no_reuse"]["model_calls_saved"] == 0 and report["args"]["world"] == "v2"
    pairs = world2.adversarial_pairs(2, seed=1)
    assert [r["expected"] for r in report["rows"]["no_reuse"]["pairs"]] == [r.attributes for p in pairs for r in p]


def test_quality_names_missing_world_weights_and_the_training_command(tmp_path, capsys):
    import pytest
    quality = _script("quality")
    with pytest.raises(SystemExit):
        quality.main(["--world", "v2", "--weights", str(tmp_path / "none.safetensors"), "--out", str(tmp_path / "x")])
    assert "carnator_engine.demo.train --world v2" in capsys.readouterr().err


def test_the_easycache_rule_skips_model_calls_alone_and_under_carnator(tmp_path):
    quality = _script("quality")
    out = tmp_path / "easycache.json"
    assert quality.main(["--stream", "2", "--restart-every", "2", "--pairs", "1", "--steps", "8", "--probe-steps", "2",
                         "--methods", "no_reuse,easycache,carnator_refine+easycache", "--step-cache-threshold", "0.3",
                         "--out", str(out)]) == 0
    stream = _script("reports").read(str(out))["results"]["iteration_stream"]
    assert stream["easycache"]["model_calls_saved"] > 0 and stream["easycache"]["hit_rate"] == 0
    assert stream["carnator_refine+easycache"]["model_calls_saved"] > 0
    with pytest.raises(ValueError, match="threshold=-1.0 must be >= 0"):
        quality.StepSkippingRunner(None, "a prompt", threshold=-1.0)


def test_packing_names_a_missing_report_before_writing_anything(tmp_path, capsys):
    reports = _script("reports")
    with pytest.raises(SystemExit):
        reports.main(["pack", str(tmp_path / "pack.json"), str(tmp_path / "missing.json")])
    assert f"no report at {tmp_path / 'missing.json'}" in capsys.readouterr().err
    assert not (tmp_path / "pack.json").exists()


def test_every_hit_reports_the_fidelity_of_the_part_outside_its_region(tmp_path):
    """Beside the attributes, a hit's row says how close the clip outside its region (ring excluded) is to the same
    request without reuse: what a region-only hit keeps from the cached generation."""
    quality, reports = _script("quality"), _script("reports")
    assert quality.main(["--stream", "6", "--restart-every", "6", "--pairs", "1", "--steps", "8", "--probe-steps", "2",
                         "--methods", "no_reuse,carnator_region", "--region-max-share", "1.0",
                         "--out", str(tmp_path / "run.json")]) == 0
    report = reports.read(str(tmp_path / "run.json"))
    rows = report["rows"]["carnator_region"]["stream"]
    hits = [row for row in rows if row["reused"] and not row["exact_repeat"]]
    assert hits and all(row["outside_psnr"] is not None for row in hits)
    assert all(row["outside_psnr"] is None for row in rows if not row["reused"])
    summary = report["results"]["iteration_stream"]["carnator_region"]
    assert summary["outside_psnr_on_hits"] == pytest.approx(sum(r["outside_psnr"] for r in hits) / len(hits))
