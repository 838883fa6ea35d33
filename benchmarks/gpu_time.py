#!/usr/bin/env python3
"""The creator trace in GPU time: calls saved undercount a hit whose steps are cheaper than a plain step (a sparse
step, a region step on part of the tokens). A cost model prices every request of a trace run (benchmarks/trace.py's
per-request rows: each method's own decisions) with per-step costs measured on one GPU (benchmarks/gpu_compose.py's
JSON: Wan 2.1 1.3B at 480p x 81 frames, N=50) and reports, per trace method, the share of GPU time it saves against
no reuse, next to its calls saved and its accuracy change.

Costs, in units of a plain (dense) step, from the GPU run:
  dense     plain sampling's seconds / N: every call of no reuse, fewer steps, EasyCache, the text baseline, a probe
  miss      a Carnator miss's calls: its seconds / plain's (the connectivity it records)
  sparse    a hit's resumed steps (the refine step included), with the entry's sparse attention: its resume seconds
            / (N - k)
  region(s) a region-only step on share s of the tokens: a + b s, fitted to the region-only hits at the run's shares
            (their resume seconds less the two full steps, over their region steps)
A request's cost: its calls priced by what they are (an exact repeat costs its calls, usually none). The trace's
schedule (20 steps) and the GPU run's (50) differ; the model prices steps, so only the share of each kind matters.

The net figure a creator cares about, with --compiled-costs (a gpu_compose.py --compile run on the same card): the
expected seconds of one request over the trace's decisions (hits, misses, exact repeats) for plain sampling, plain
compiled, Carnator (its default, carnator_balanced) and Carnator compiled, each request at the GPU run's schedule
(its plain steps scaled from the trace's N to the GPU run's).

    python3 benchmarks/gpu_time.py                     # the committed trace runs and H100 costs
    python3 benchmarks/gpu_time.py --costs benchmarks/results/gpu/gpu_compose_h100.json \
        --trace benchmarks/results/quality/trace_1000_randomize.json --out /tmp/gpu_time.json
    python3 benchmarks/gpu_time.py --compiled-costs benchmarks/results/gpu/gpu_compose_compile_h100.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import reports  # noqa: E402

RESULTS = os.path.join(HERE, "results")
DEFAULT_COSTS = os.path.join(RESULTS, "gpu", "gpu_compose_h100.json")
DEFAULT_TRACES = [os.path.join(RESULTS, "quality", f"trace_1000_{name}.json")
                  for name in ("randomize", "fixed", "alternatives")]


def step_costs(compose: dict) -> dict:
    """Per-step costs, in plain steps, from a gpu_compose.py report."""
    cases, config = compose["cases"], compose["config"]
    steps, resume = config["steps"], config["resume"]
    dense = cases["plain"]["seconds"] / steps
    sparse = cases["hit"]["resume_s"] / (steps - resume) / dense
    points = []
    for name, case in cases.items():
        if name.startswith("region hit") and name.endswith("%") and case.get("region_only"):
            region_steps = case["region_steps"]
            full = steps - resume - region_steps
            per_step = (case["resume_and_write_s"] / dense - full * sparse) / region_steps
            points.append((case["region_share"], per_step))
    costs = {"device": compose["device"], "steps": steps, "dense_s": dense, "miss": cases["miss"]["seconds"] / cases["plain"]["seconds"],
             "sparse": sparse, "region_points": points}
    if len(points) >= 2:
        mean_s = sum(s for s, _ in points) / len(points)
        mean_c = sum(c for _, c in points) / len(points)
        slope = sum((s - mean_s) * (c - mean_c) for s, c in points) / sum((s - mean_s) ** 2 for s, _ in points)
        costs.update(region_a=mean_c - slope * mean_s, region_b=slope)
    return costs


def request_cost(row: dict, carnator: bool, probe: int, costs: dict) -> float:
    """One request's GPU time in plain steps."""
    calls = row["model_calls"]
    if not carnator or row["exact_repeat"]:
        return float(calls)
    if not row["reused"]:
        return calls * costs["miss"]
    numbers = row.get("gate") or {}
    region_steps = numbers.get("region_steps", 0) if numbers.get("region_only") else 0
    region = 0.0
    if region_steps:
        if "region_a" not in costs:
            raise SystemExit("the trace holds region-only hits but the costs have no region-only step fit")
        region = region_steps * (costs["region_a"] + costs["region_b"] * numbers["region_share"])
    return probe + (calls - probe - region_steps) * costs["sparse"] + region


def trace_gpu_time(trace: dict, rows: dict, costs: dict) -> dict:
    """{habit: {method: figures}} of a trace.py report and its rows."""
    probe = trace["args"]["probe_steps"]
    out = {}
    for habit, methods in rows.items():
        base = sum(request_cost(r, False, probe, costs) for r in methods["no_reuse"]["trace"])
        out[habit] = {}
        for method, found in methods.items():
            cost = sum(request_cost(r, method.startswith("carnator"), probe, costs) for r in found["trace"])
            summary = trace["results"][habit][method]
            out[habit][method] = {"gpu_time_saved": round(1 - cost / base, 4),
                                  "calls_saved": summary["model_calls_saved"],
                                  "change": summary["change"], "change_low": summary["change_low"],
                                  "change_high": summary["change_high"], "hit_rate": summary["hit_rate"]}
    return out


def seconds_per_request(trace: dict, rows: dict, setups: dict) -> dict:
    """{habit: {setup: seconds}}: one request's expected seconds over a trace run's decisions, for plain sampling
    ("plain ...", the trace's no_reuse requests) and Carnator's default ("Carnator ...", carnator_balanced) under each
    setup's costs ({"plain": costs, "plain compiled": costs, "Carnator": costs, ...})."""
    probe, steps = trace["args"]["probe_steps"], trace["args"]["steps"]
    out = {}
    for habit, methods in rows.items():
        if "carnator_balanced" not in methods:      # a run of another risk level only
            continue
        out[habit] = {}
        for setup, costs in setups.items():
            carnator = setup.startswith("Carnator")
            found = methods["carnator_balanced" if carnator else "no_reuse"]["trace"]
            mean = sum(request_cost(r, carnator, probe, costs) for r in found) / len(found)
            out[habit][setup] = round(mean * costs["dense_s"] * costs["steps"] / steps, 3)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", default=DEFAULT_COSTS, help="a gpu_compose.py JSON (per-step costs)")
    parser.add_argument("--trace", action="append", help="trace.py JSON(s), their rows beside them "
                        "(default: the committed 1,000-request runs of both seed habits)")
    parser.add_argument("--compiled-costs", help="a gpu_compose.py --compile JSON of the same card: the expected "
                        "seconds per request compiled too")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "benchmarks", "out", "trace_gpu_time.json"))
    args = parser.parse_args(argv)
    with open(args.costs) as handle:
        costs = step_costs(json.load(handle))
    setups = {"plain": costs, "Carnator": costs}
    report = {"costs": {**costs, "source": os.path.relpath(args.costs, os.path.dirname(HERE))}, "habits": {},
              "seconds_per_request": {}}
    if args.compiled_costs:
        with open(args.compiled_costs) as handle:
            compiled = step_costs(json.load(handle))
        if compiled["device"] != costs["device"]:
            raise SystemExit(f"--compiled-costs ran on {compiled['device']}, --costs on {costs['device']}: "
                             "give runs of one card")
        setups = {"plain": costs, "plain compiled": compiled, "Carnator": costs, "Carnator compiled": compiled}
        report["compiled_costs"] = {**compiled, "source": os.path.relpath(args.compiled_costs, os.path.dirname(HERE))}
    for path in args.trace or DEFAULT_TRACES:
        for trace in reports.read_all(path).values():      # a trace run, or a pack of them
            rows = trace.pop("rows")
            for habit, methods in trace_gpu_time(trace, rows, costs).items():
                report["habits"].setdefault(habit, {}).update(methods)
            report["seconds_per_request"].update(seconds_per_request(trace, rows, setups))
        report.setdefault("traces", []).append(os.path.relpath(path, os.path.dirname(HERE)))
    reports.write(args.out, report)
    print(f"GPU time per step ({costs['device']}): plain {costs['dense_s'] * 1e3:.0f} ms; a miss's step "
          f"{costs['miss']:.3f}, a sparse step {costs['sparse']:.3f} of it"
          + (f", a region step {costs['region_a']:.3f} + {costs['region_b']:.3f} x share" if "region_a" in costs else ""))
    print("| seed habit | method | GPU time saved | calls saved | vs no reuse (95 % interval) |")
    print("| --- | --- | --- | --- | --- |")
    for habit, methods in report["habits"].items():
        for method, f in methods.items():
            print(f"| {habit} | {method} | {f['gpu_time_saved']:.1%} | {f['calls_saved']:.1%} | "
                  f"{100 * f['change']:+.1f} ({100 * f['change_low']:+.1f} to {100 * f['change_high']:+.1f}) |")
    print(f"\nExpected seconds per request over the trace's decisions, at the GPU run's {costs['steps']} steps:")
    print("| seed habit | " + " | ".join(setups) + " |")
    print("| --- |" + " --- |" * len(setups))
    for habit, seconds in report["seconds_per_request"].items():
        print(f"| {habit} | " + " | ".join(f"{seconds[setup]:.2f}" for setup in setups) + " |")
    return report


if __name__ == "__main__":
    main()
