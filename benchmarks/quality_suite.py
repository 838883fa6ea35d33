"""Every quality run that benchmarks/RESULTS.md reports, in parallel: `quality.py` once per configuration
and seed habit, writing benchmarks/results/quality/quality_<name>[_fixed_seed].json (or --out-dir), each with its
per-request rows gzipped beside it (.rows.json.gz, benchmarks/reports.py).

Two request sets: the main one (60 stream requests, 16 adversarial pairs, seed 0) and a replication on new
requests (120 and 48, seed 1) that checks what the main set suggests. The first run of each set (`balanced`,
`replication_seed1`) goes first: it generates the set's no-reuse references (and the text baseline), which the
set's other runs read from a reference cache instead of generating them again.

The pooled replication (`--only pooled`: eight more sets of 120 and 48, seeds 2-9, `POOLED_RUNS` on each) is
read as one: its table adds the sets up and gives each accuracy change against no reuse a 95 % interval.

    python benchmarks/quality_suite.py --jobs 2                      # CPU: about two hours on 2 cores
    python benchmarks/quality_suite.py --device cuda --jobs 16 --only pooled --out-dir $OUT   # H200: ~10 min
    python benchmarks/quality_suite.py --tables                      # the tables RESULTS.md shows
"""
from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import reports  # noqa: E402
from quality import sign_test  # noqa: E402
# request set -> (quality.py arguments, the file stem of its no-reuse reference cache)
REQUEST_SETS = {"main": (["--stream", "60", "--pairs", "16"], "quality_reference"),
                "replication": (["--stream", "120", "--pairs", "48", "--seed", "1"], "replication_reference")}
# The pooled replication: eight more sets like the replication's, new requests each, run on the GPU and read
# together, so that an accuracy change of one or two points is resolved rather than lost in re-roll noise.
POOLED_SEEDS = tuple(range(2, 10))
REQUEST_SETS.update({f"pooled{seed}": (["--stream", "120", "--pairs", "48", "--seed", str(seed)],
                                       f"pooled{seed}_reference") for seed in POOLED_SEEDS})
LOOSE = "max_target_fraction=1.0,max_resume_fraction=0.6"
# the product's pipeline with the refine call off and on, side by side
PLAIN_AND_REFINE = ["--methods", "no_reuse,carnator,carnator_refine"]
# a gate that accepts every candidate and resumes at step 12 of 20, the step that saves 40 % of the calls
NEVER_REFUSE_12 = ["--gate", "max_hidden=2.0,max_attention=1.0,max_context=10.0,max_target_fraction=1.0,"
                   "max_resume_fraction=0.6,shrink_with_risk=false,min_saved_steps=1", *PLAIN_AND_REFINE]
# any target share, resume up to 0.65 N, plain and refine
LOOSE_REFINE = ["--gate", "max_target_fraction=1.0,max_resume_fraction=0.65", *PLAIN_AND_REFINE]

# name -> quality.py arguments (on the main set unless the name says replication); each runs with a fresh
# seed per request and with one seed per session.
RUNS = {
    "balanced": ["--methods", "no_reuse,text_similarity,carnator,carnator_no_localize,carnator_dense"],
    "safe": ["--risk", "safe", "--methods", "no_reuse,carnator"],
    "aggressive": ["--risk", "aggressive", "--methods", "no_reuse,carnator"],
    "loose_gate": ["--gate", LOOSE, "--methods", "no_reuse,carnator"],
    "refine": PLAIN_AND_REFINE,
    "refine_loose_gate": LOOSE_REFINE,
    "budget03": ["--max-density", "0.3", "--methods", "no_reuse,carnator,carnator_dense"],
    "fixed_k7": ["--gate", "max_target_fraction=1.0,max_resume_fraction=0.35,shrink_with_risk=false",
                 "--methods", "no_reuse,carnator"],
    "never_refuse_12": NEVER_REFUSE_12,
    "own_jump_11": ["--methods", "no_reuse,own_jump", "--jump-path", "11"],
    "own_jump_7_11": ["--methods", "no_reuse,own_jump", "--jump-path", "7,11"],
    "own_jump_7_13": ["--methods", "no_reuse,own_jump", "--jump-path", "7,13"],
    "replication_seed1": ["--methods", "no_reuse,text_similarity,carnator"],
    "replication_seed1_loose_refine": LOOSE_REFINE,
    "replication_seed1_never_refuse_12": NEVER_REFUSE_12,
}
# what a user would pick instead, per request (a plain 12- or 14-step schedule, the EasyCache rule at about 2x),
# and Carnator (refine on, the product's default) on top of each
STEP_CACHE = ["--step-cache-threshold", "0.05"]
PER_REQUEST = [*STEP_CACHE, "--methods", "no_reuse,steps_12,steps_14,easycache,carnator_refine,"
               "carnator_refine+easycache,carnator_refine+steps_14"]
RUNS["per_request"] = PER_REQUEST
# the same methods split in two runs that go side by side (each about half the time: a pooled set's seven methods
# take longer than one device call); benchmarks/tradeoff.py joins a set's runs
PER_REQUEST_ALONE = [*STEP_CACHE, "--methods", "no_reuse,steps_12,steps_14,easycache,carnator_refine"]
PER_REQUEST_ON_TOP = [*STEP_CACHE, "--methods", "no_reuse,carnator_refine+easycache,carnator_refine+steps_14"]
# pooled configuration -> quality.py arguments, run on every pooled set
# the check every change to the gate, signature, localization or resume re-runs: the product default against no reuse
POOLED_RUNS = {"default": ["--methods", "no_reuse,carnator_refine"],
               # the default with the gate's subject rule on (off by default until this check has run with it)
               "subject_rule": ["--gate", "refuse_subject_change=true", "--methods", "no_reuse,carnator_refine"],
               # region-only resume (off by default until this check has run with it), beside the default's hits
               "region": ["--region-max-share", "0.8", "--methods", "no_reuse,carnator_refine,carnator_region"],
               "balanced": ["--methods", "no_reuse,text_similarity,carnator"],
               "aggressive": ["--risk", "aggressive", "--methods", "no_reuse,carnator"],
               "loose_gate": ["--gate", LOOSE, "--methods", "no_reuse,carnator"],
               "balanced_refine": PLAIN_AND_REFINE,
               "aggressive_refine": ["--risk", "aggressive", *PLAIN_AND_REFINE],
               "never_refuse_12": NEVER_REFUSE_12,
               "per_request": PER_REQUEST, "per_request_alone": PER_REQUEST_ALONE,
               "per_request_on_top": PER_REQUEST_ON_TOP}
RUNS.update({f"pooled{seed}_{config}": arguments for config, arguments in POOLED_RUNS.items() for seed in POOLED_SEEDS})
FIRST = ("balanced", "replication_seed1", *(f"pooled{seed}_balanced" for seed in POOLED_SEEDS))
# --only takes run names or these groups; with no --only the suite runs "cpu", what RESULTS.md's CPU tables need
GROUPS = {"pooled": [name for name in RUNS if name.startswith("pooled")],
          "cpu": [name for name in RUNS if not name.startswith("pooled")]}


def request_set(name: str) -> str:
    """A run's request set: the one its name starts with ("replication_seed1", "pooled3_aggressive"), else main."""
    prefix = name.split("_")[0]
    return prefix if prefix in REQUEST_SETS else "main"


def stages(names: list) -> list:
    """[leaders, the rest]: one run of each request set (a FIRST one where chosen) goes first and writes the set's
    no-reuse reference cache, which the set's other runs then read instead of generating it again."""
    leaders = {}
    for name in sorted(names, key=lambda n: n not in FIRST):
        leaders.setdefault(request_set(name), name)
    return [list(leaders.values()), [n for n in names if n not in leaders.values()]]


def command(name: str, fixed_seed: bool, args) -> tuple:
    label = name + ("_fixed_seed" if fixed_seed else "")
    set_arguments, reference_stem = REQUEST_SETS[request_set(name)]
    reference = os.path.join(args.reference_dir, f"{reference_stem}{'_fixed_seed' if fixed_seed else ''}.pt")
    argv = [sys.executable, os.path.join(HERE, "quality.py"), *set_arguments, *RUNS[name],
            "--device", args.device, "--reference-cache", reference,
            "--text-embedding-cache", os.path.join(args.reference_dir, "quality_text_embeddings.pt"),
            "--out", os.path.join(args.out_dir, f"quality_{label}.json")]
    return label, argv + (["--fixed-seed"] if fixed_seed else [])


def run(label: str, argv: list, log_dir: str) -> tuple:
    started = time.perf_counter()
    with open(os.path.join(log_dir, f"quality_{label}.log"), "w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              cwd=os.path.dirname(HERE)).returncode
    print(f"{label}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
    return label, code


LABELS = {"no_reuse": "no reuse", "text_similarity": "text similarity (MiniLM cosine >= 0.90, resume at step 10)",
          "carnator": "Carnator, refine off", "carnator_no_localize": "Carnator, no localization",
          "carnator_dense": "Carnator, dense attention", "carnator_refine": "Carnator, refine on",
          "own_jump": "own jump, no cache"}
SEEDS = (("fresh", ""), ("fixed", "_fixed_seed"))


def label(method: str) -> str:
    """A method's name in the tables; per-request methods (steps_N, easycache, "<carnator>+<per-request>") as
    quality.py names them."""
    base, _, per_request = method.partition("+")
    if per_request:
        return f"{LABELS.get(base, base)} + {per_request}"
    return LABELS.get(method, method)


@functools.lru_cache(maxsize=4)
def _reports(out_dir: str) -> dict:
    """{name: report} of every report in out_dir, packed (benchmarks/reports.py pack) or one to a file."""
    return {name: report for path in sorted(glob.glob(os.path.join(out_dir, "*.json")))
            for name, report in reports.read_all(path, rows=False).items()}


def _load(out_dir: str, label: str):
    report = _reports(out_dir).get(f"quality_{label}")
    return None if report is None else report["results"]


def _runs(out_dir: str, names):
    """(label, seeds, iteration table, adversarial table) of each (name, label) run found, both seed habits."""
    for name, label in names:
        for seeds, suffix in SEEDS:
            results = _load(out_dir, name + suffix)
            if results is not None:
                yield label, seeds, results["iteration_stream"], results["adversarial_pairs"]


def _accuracy(method_row: dict, table: dict) -> str:
    return f"{method_row['attribute_accuracy']:.1%} ({table['no_reuse']['attribute_accuracy']:.1%})"


def _flips(s: dict) -> str:
    return f"{s['made_wrong']} / {s['made_right']} (p {s['sign_test_p']:.2f})"


def tables(out_dir: str) -> str:
    """The markdown tables of benchmarks/RESULTS.md, from the suite's JSON files."""
    lines = []
    head = "| set | method | hits | calls saved | PSNR | SSIM | attr acc | wrong acc | made wrong / right (sign p) |"
    for seeds, suffix in SEEDS:
        results, own = _load(out_dir, "balanced" + suffix), _load(out_dir, "own_jump_11" + suffix)
        if results is None:
            continue
        lines += ["", f"balanced, {seeds} seeds (`quality_balanced{suffix}.json`, own jump from `quality_own_jump_11{suffix}.json`):",
                  "", head, "| --- " * 9 + "|"]
        for kind, table in results.items():
            rows = dict(table)
            if own is not None:
                rows["own_jump"] = own[kind]["own_jump"]
            for method, s in rows.items():
                lines.append(f"| {kind.split('_')[0]} | {label(method)} | {s['hit_rate']:.0%} | {s['model_calls_saved']:.0%} "
                             f"| {s['psnr']:.1f} | {s['ssim']:.3f} | {s['attribute_accuracy']:.1%} | {s['wrong_accepts']} "
                             f"| {_flips(s)} |")
    lines += ["", "| gate | seeds | hits | calls saved | attr acc (no reuse) | wrong acc | made wrong / right (sign p) "
              "| adversarial hits | adversarial acc (no reuse) | adversarial wrong acc |", "| --- " * 10 + "|"]
    for gate, seeds, it, adv in _runs(out_dir, (("safe", "safe"), ("balanced", "balanced"), ("aggressive", "aggressive"),
                                                ("loose_gate", "balanced + any target share, resume 0.6"),
                                                ("budget03", "balanced, connectivity budget 0.3"),
                                                ("fixed_k7", "balanced + any target share, always resume at 7"))):
        s, a = it["carnator"], adv["carnator"]
        lines.append(f"| {gate} | {seeds} | {s['hit_rate']:.0%} | {s['model_calls_saved']:.0%} | {_accuracy(s, it)} | "
                     f"{s['wrong_accepts']} | {_flips(s)} | {a['hit_rate']:.0%} | {_accuracy(a, adv)} | "
                     f"{a['wrong_accepts']} |")
    lines += ["", "| no cache: stops | seeds | calls saved | attr acc (no reuse) | made wrong / right (sign p) "
              "| adversarial acc (no reuse) | PSNR |", "| --- " * 7 + "|"]
    for stops, seeds, it, adv in _runs(out_dir, (("own_jump_11", "11"), ("own_jump_7_11", "7, 11"),
                                                 ("own_jump_7_13", "7, 13"))):
        s = it["own_jump"]
        lines.append(f"| {stops} | {seeds} | {s['model_calls_saved']:.0%} | {_accuracy(s, it)} | {_flips(s)} | "
                     f"{_accuracy(adv['own_jump'], adv)} | {s['psnr']:.1f} |")
    lines += ["", "| gate | seeds | variant | hits | calls saved | PSNR | attr acc (no reuse) | wrong acc "
              "| made wrong / right (sign p) | adversarial wrong acc |", "| --- " * 10 + "|"]
    for gate, seeds, it, adv in _runs(out_dir, (("refine", "balanced"),
                                                ("refine_loose_gate", "balanced + any target share, resume 0.65"),
                                                ("never_refuse_12", "never refusing, always resume at 12"))):
        for method, variant in (("carnator", "plain"), ("carnator_refine", "refine")):
            s = it[method]
            lines.append(f"| {gate} | {seeds} | {variant} | {s['hit_rate']:.0%} | {s['model_calls_saved']:.0%} | "
                         f"{s['psnr']:.1f} | {_accuracy(s, it)} | {s['wrong_accepts']} | {_flips(s)} | "
                         f"{adv[method]['wrong_accepts']} |")
    lines += ["", "| replication run | seeds | method | hits | calls saved | attr acc (no reuse) | wrong acc "
              "| made wrong / right (sign p) | adversarial acc (no reuse) | adversarial wrong acc |", "| --- " * 10 + "|"]
    for gate, seeds, it, adv in _runs(out_dir, (("replication_seed1", "balanced"),
                                                ("replication_seed1_loose_refine",
                                                 "balanced + any target share, resume 0.65"),
                                                ("replication_seed1_never_refuse_12",
                                                 "never refusing, always resume at 12"))):
        for method, s in it.items():
            if method != "no_reuse":
                lines.append(f"| {gate} | {seeds} | {label(method)} | {s['hit_rate']:.0%} | {s['model_calls_saved']:.0%} "
                             f"| {_accuracy(s, it)} | {s['wrong_accepts']} | {_flips(s)} | "
                             f"{_accuracy(adv[method], adv)} | {adv[method]['wrong_accepts']} |")
    lines += ceiling_table(out_dir)
    lines += pooled_table(out_dir)
    return "\n".join(lines)


def pool(summaries: list) -> dict:
    """Request-weighted totals of several quality.py summaries of one method, and the paired accuracy change
    against no reuse with its 95 % interval (normal approximation over the per-request flips)."""
    n = sum(s["requests"] for s in summaries)
    mean = lambda key: sum(s[key] * s["requests"] for s in summaries) / n  # noqa: E731
    worse, better = sum(s["made_wrong"] for s in summaries), sum(s["made_right"] for s in summaries)
    change, low, high = paired_change(worse, better, n)
    return {"requests": n, "hit_rate": mean("hit_rate"), "model_calls_saved": mean("model_calls_saved"),
            # runs made before exact repeats existed have no count (their fresh-seed results are the same)
            "exact_repeats": sum(s["exact_repeats"] for s in summaries)
            if all("exact_repeats" in s for s in summaries) else "not replayed",
            "attribute_accuracy": mean("attribute_accuracy"), "wrong_accepts": sum(s["wrong_accepts"] for s in summaries),
            "made_wrong": worse, "made_right": better, "sign_test_p": sign_test(worse, better),
            "change": change, "change_low": low, "change_high": high}


def paired_change(worse: int, better: int, n: int) -> tuple:
    """(change, low, high): the accuracy change over n paired requests of which `worse` flipped to wrong and
    `better` to right, with its 95 % interval (normal approximation over the per-request flips)."""
    change = (better - worse) / n
    spread = 1.96 * math.sqrt(max((worse + better) / n - change ** 2, 0.0) / n)
    return change, change - spread, change + spread


def pooled_table(out_dir: str) -> list:
    """The pooled replication: every pooled set's run of one configuration and seed habit added up."""
    lines = []
    for config in POOLED_RUNS:
        for seeds, suffix in SEEDS:
            found = [r for r in (_load(out_dir, f"pooled{seed}_{config}{suffix}") for seed in POOLED_SEEDS) if r]
            if not found:
                continue
            if not lines:
                lines = ["", "| configuration | seeds | sets | method | requests | hits (exact repeats) | calls saved | attr acc "
                         "(no reuse) | change (95 % interval) | made wrong / right (sign p) | adversarial acc (no reuse) "
                         "| adversarial change (95 % interval) | adversarial wrong acc |", "| --- " * 13 + "|"]
            totals = {kind: {method: pool([r[kind][method] for r in found]) for method in found[0][kind]}
                      for kind in ("iteration_stream", "adversarial_pairs")}
            it, adv = totals["iteration_stream"], totals["adversarial_pairs"]
            for method in it:
                if method == "no_reuse":
                    continue
                s, a = it[method], adv[method]
                lines.append(f"| {config} | {seeds} | {len(found)} | {label(method)} | {s['requests']} | "
                             f"{s['hit_rate']:.0%} ({s['exact_repeats']}) | {s['model_calls_saved']:.0%} | {_accuracy(s, it)} | "
                             f"{_change(s)} | {_flips(s)} | {_accuracy(a, adv)} | {_change(a)} | {a['wrong_accepts']} |")
    return lines


def _change(s: dict) -> str:
    return f"{s['change'] * 100:+.1f} ({s['change_low'] * 100:+.1f} to {s['change_high'] * 100:+.1f}) pts"


CEILING_RUNS = (("main, fresh", "gate_ceiling"), ("main, fixed", "gate_ceiling_fixed_seed"),
                ("replication, fresh", "gate_ceiling_replication_seed1"),
                ("replication, fixed", "gate_ceiling_replication_seed1_fixed_seed"))


def ceiling_table(out_dir: str) -> list:
    """benchmarks/gate_ceiling.py's runs side by side: accuracy if every warm request resumed at one step."""
    found = []
    for label, stem in CEILING_RUNS:
        if stem in _reports(out_dir):
            found.append((label, _reports(out_dir)[stem]["summary"]))
    if not found:
        return []
    lines = ["", "| resume step | calls saved | " + " | ".join(f"{label} (no reuse {s['reference_accuracy']:.1%})"
                                                          for label, s in found) + " |",
             "| --- " * (2 + len(found)) + "|"]
    for step in found[0][1]["nearest_entry_at_fixed_step"]:
        cells = [s["nearest_entry_at_fixed_step"][step] for _, s in found]
        lines.append(f"| {step} | {cells[0]['calls_saved']:.0%} | " + " | ".join(
            f"{c['attribute_accuracy']:.1%} ({c['made_wrong']} / {c['made_right']})" for c in cells) + " |")
    lines.append("| oracle (hindsight) | " + " / ".join(f"{s['oracle_calls_saved']:.0%}" for _, s in found) + " | "
                 + " | ".join("no request made wrong" for _ in found) + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results", "quality"))
    parser.add_argument("--reference-dir", default=os.path.join(HERE, "out"),
                        help="where the no-reuse generations are kept between runs (quality.py --reference-cache), "
                             "with each run's log")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", help="comma-separated run names or groups (" + ", ".join(GROUPS)
                        + "; default: cpu, every run but the pooled replication)")
    parser.add_argument("--tables", action="store_true", help="print the markdown tables from --out-dir and exit")
    args = parser.parse_args(argv)
    if args.tables:
        print(tables(args.out_dir))
        return 0
    names = [name for item in (args.only or "cpu").split(",") for name in GROUPS.get(item, [item])]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown run(s) {', '.join(unknown)}: choose from the groups {', '.join(GROUPS)}, the runs "
                     f"{', '.join(GROUPS['cpu'])} or pooled<seed>_<configuration> (seeds {POOLED_SEEDS[0]}-"
                     f"{POOLED_SEEDS[-1]}, configurations {', '.join(POOLED_RUNS)})")
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.reference_dir, exist_ok=True)
    failed = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for stage in stages(names):
            jobs = [command(name, fixed, args) for name in stage for fixed in (False, True)]
            for label, code in pool.map(lambda job: run(*job, args.reference_dir), jobs):
                if code:
                    failed.append(label)
    if failed:
        print(f"failed: {', '.join(failed)} (see quality_<name>.log in {args.reference_dir})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
