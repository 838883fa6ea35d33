#!/usr/bin/env python3
"""Accuracy against model calls saved, per method: what a user would pick instead of Carnator (fewer steps, a
step-skipping cache) and Carnator on top of each. Reads quality.py JSON files or packs of them (several are
pooled, request-weighted, with the paired change of requests read all six right against no reuse and its 95 %
interval, quality_suite.pool); writes a markdown table and a PNG plot (one panel per request set: the iteration stream and the adversarial pairs). Where the files
hold their per-request rows, a second table compares each "Carnator on top of X" with X alone on the same requests
(paired flips of all six right, 95 % interval): the difference the goal "equal or better accuracy" is about, which
two intervals against no reuse cannot resolve.

    python benchmarks/tradeoff.py benchmarks/results/quality/pooled_per_request_h200.json \\
        --png /tmp/tradeoff.png --md /tmp/tradeoff.md
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import reports  # noqa: E402
from quality import adversaries  # noqa: E402
from quality_suite import label, paired_change, pool  # noqa: E402

KINDS = (("iteration_stream", "iteration stream"), ("adversarial_pairs", "adversarial pairs"))
# quality.py's name of each kind in its rows, and the rows it scores
ROW_KINDS = {"iteration_stream": ("stream", lambda rows: rows), "adversarial_pairs": ("pairs", adversaries)}


def load(paths: list) -> list:
    """The quality.py reports at `paths` (packs too: each of their reports), read once with their rows."""
    return [report for path in paths for report in reports.read_all(path).values()]


def _set_key(args: dict) -> tuple:
    """What makes a request set: its seed, sizes and seed habit."""
    return args["seed"], args["stream"], args["pairs"], args["fixed_seed"], args["restart_every"]


def request_sets(loaded: list) -> list:
    """One results dict per request set of the reports (reports.read): files of the same set (each holds that
    set's no_reuse reference) are joined, so a set split over several runs counts its requests once."""
    sets = {}
    for report in loaded:
        joined = sets.setdefault(_set_key(report["args"]), {kind: {} for kind, _ in KINDS})
        for kind, _ in KINDS:
            joined[kind].update(report["results"][kind])
    return list(sets.values())


def on_top_flips(loaded: list) -> dict:
    """kind -> (on-top method, the method alone) -> [worse, better, requests]: per request of every set, whether
    Carnator on top of a method reads all six right where that method alone did not (better) or the reverse."""
    from carnator_engine.demo.world import all_right
    rows_by_set = {}
    for report in loaded:
        rows_by_set.setdefault(_set_key(report["args"]), {}).update(report.get("rows", {}))
    flips = {kind: {} for kind, _ in KINDS}
    for rows in rows_by_set.values():
        for method in rows:
            alone = method.partition("+")[2]
            if not alone or alone not in rows:
                continue
            for kind, _ in KINDS:
                counts = flips[kind].setdefault((method, alone), [0, 0, 0])
                name, scored = ROW_KINDS[kind]
                for top, base in zip(scored(rows[method][name]), scored(rows[alone][name]), strict=True):
                    if (top["prompt"], top["seed"]) != (base["prompt"], base["seed"]):
                        raise ValueError(f"{method} and {alone} were not run on the same requests")
                    top_right, base_right = all_right(top["read"], top["expected"]), all_right(base["read"],
                                                                                              base["expected"])
                    counts[0] += base_right and not top_right
                    counts[1] += top_right and not base_right
                    counts[2] += 1
    return flips


def on_top_table(flips: dict, totals: dict) -> str:
    lines = ["| requests | Carnator on top of | calls saved alone / on top | accuracy change vs the method alone "
             "(95 % interval) | made wrong / right |", "| --- " * 5 + "|"]
    for kind, title in KINDS:
        for (method, alone), (worse, better, n) in flips[kind].items():
            change, low, high = paired_change(worse, better, n)
            lines.append(f"| {title} ({n}) | {label(alone)} | {totals[kind][alone]['model_calls_saved']:.0%} / "
                         f"{totals[kind][method]['model_calls_saved']:.0%} | {change * 100:+.1f} ({low * 100:+.1f} to "
                         f"{high * 100:+.1f}) pts | {worse} / {better} |")
    return "\n".join(lines)


def pooled(results: list) -> dict:
    """kind -> method -> pooled summary over the request sets, methods in the order the runs list them."""
    return {kind: {method: pool([r[kind][method] for r in results if method in r[kind]])
                   for method in dict.fromkeys(m for r in results for m in r[kind])} for kind, _ in KINDS}


def table(totals: dict, sets: int) -> str:
    lines = ["| requests | method | calls saved | attr acc (no reuse) | change (95 % interval) | made wrong / right |",
             "| --- " * 6 + "|"]
    for kind, title in KINDS:
        rows = totals[kind]
        base = rows["no_reuse"]["attribute_accuracy"]
        for method, s in sorted(rows.items(), key=lambda item: item[1]["model_calls_saved"]):
            change = (f"{s['change'] * 100:+.1f} ({s['change_low'] * 100:+.1f} to {s['change_high'] * 100:+.1f}) pts"
                      if method != "no_reuse" else "")
            lines.append(f"| {title} ({s['requests']}, {sets} set{'s' if sets > 1 else ''}) | {label(method)} | "
                         f"{s['model_calls_saved']:.0%} | {s['attribute_accuracy']:.1%} ({base:.1%}) | {change} | "
                         f"{s['made_wrong']} / {s['made_right']} |")
    return "\n".join(lines)


def plot(totals: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(KINDS), figsize=(12, 5), sharey=True)
    for axis, (kind, name) in zip(axes, KINDS):
        for method, s in totals[kind].items():
            on_top = "+" in method
            marker = "o" if method.startswith("carnator") else "s"
            axis.errorbar(100 * s["model_calls_saved"], 100 * s["change"],
                          yerr=[[100 * (s["change"] - s["change_low"])], [100 * (s["change_high"] - s["change"])]],
                          fmt=marker, color="tab:green" if on_top else "tab:blue" if marker == "o" else "tab:gray",
                          capsize=3)
            axis.annotate(label(method), (100 * s["model_calls_saved"], 100 * s["change"]), fontsize=7,
                          xytext=(4, 4), textcoords="offset points")
        axis.axhline(0, color="black", linewidth=0.5)
        axis.axhline(-1, color="tab:red", linewidth=0.5, linestyle="--")
        axis.set_xlabel("model calls saved (%)")
        axis.set_title(name)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("requests all six right, change vs no reuse (points, 95 % interval)")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="quality.py JSON files, pooled together")
    parser.add_argument("--png", help="plot to write")
    parser.add_argument("--md", help="markdown table to write")
    args = parser.parse_args(argv)
    loaded = load(args.results)
    sets = request_sets(loaded)
    totals = pooled(sets)
    text = table(totals, len(sets))
    flips = on_top_flips(loaded)
    if any(flips[kind] for kind, _ in KINDS):
        text += "\n\n" + on_top_table(flips, totals)
    print(text)
    if args.md:
        with open(args.md, "w") as handle:
            handle.write(text + "\n")
    if args.png:
        habits = {report["args"]["fixed_seed"] for report in loaded}
        habit = {frozenset([True]): "one seed per session", frozenset([False]): "fresh seeds"}.get(frozenset(habits),
                                                                                              "both seed habits")
        plot(totals, args.png, f"Evaluation world: accuracy vs calls saved ({len(sets)} request set"
                               f"{'s' if len(sets) > 1 else ''}, {habit}, {len(loaded)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
