"""Train several distillation recipes at once on one GPU and compare their students with the teacher.

    python3 -m carnator_engine.demo.distill_sweep OUT_DIR --minutes 5          # one H200, ~7 minutes in all
    python3 -m carnator_engine.demo.distill_sweep /tmp/sweep --smoke            # a CPU check

Each variant is one `carnator_engine.demo.distill` process (the models are tiny, so they share the GPU),
all with the same evaluation requests (same --seed), so their reports compare directly. OUT_DIR gets, per
variant, NAME.safetensors (fp16 EMA student) and NAME.json (its report), plus sweep.json (every variant's
all-six-right at 4, 6 and 8 steps against the teacher at 20 steps, the best named) and sweep_log.txt (the
processes' output). A process still running `--grace` seconds after the budget is stopped and reported.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from . import FEW_STEP_WEIGHTS

# name -> distill.py arguments: the shipped student (demo/tiny_dit_4step.safetensors: one H200, 1.5 min of reflow then
# 4 min of onpolicy-x0 on 4-step rollouts, with two other recipes and another job on the GPU:
# benchmarks/results/demo_model/distill_sweep_h200.json) trained further on its own rollouts, at a lower learning rate
# (from the teacher, the switch from reflow to on-policy targets first costs accuracy, then passes the reflow student).
_FROM_SHIPPED = ["--init", FEW_STEP_WEIGHTS, "--reflow-minutes", "0", "--lr", "1e-4", "--warmup", "20"]
VARIANTS = {
    "x0_4step": ["--target", "onpolicy-x0", "--rollout-steps", "4", *_FROM_SHIPPED],
    "segment_4step": ["--target", "onpolicy-segment", "--rollout-steps", "4", *_FROM_SHIPPED],
    "segment_mixed": ["--target", "onpolicy-segment", "--rollout-steps", "4,4,6,8", *_FROM_SHIPPED],
}


def summary_row(report: dict) -> dict:
    """A variant's all-six-right (random / held-out prompts) by student steps, and its gap to the teacher at 4."""
    evaluation = report["evaluation"]
    setting = next(iter(evaluation["teacher"]), None)   # the first: how the teacher samples best
    teacher = evaluation["teacher"][setting] if setting else {}
    row = {"target": report["recipe"]["target"], "optimiser_steps": report["training"]["steps"],
           "teacher": setting, "teacher_all_six": {k: teacher[k]["all"] for k in teacher}}
    for steps, scores in evaluation["student_by_steps"].items():
        row[f"student_{steps}_steps"] = {k: scores[k]["all"] for k in scores}
        row[f"student_{steps}_steps_shape"] = {k: scores[k]["shape"] for k in scores}
    if "4" in evaluation["student_by_steps"] and teacher:
        row["heldout_gap_points_at_4"] = round(
            100 * (teacher["heldout"]["all"] - evaluation["student_by_steps"]["4"]["heldout"]["all"]), 2)
    return row


def variant_arguments(name: str, args: argparse.Namespace) -> list:
    """distill.py's arguments for one variant of this sweep."""
    arguments = [*VARIANTS[name], "--out", os.path.join(args.out_dir, f"{name}.safetensors"),
                 "--minutes", str(args.minutes)]
    return arguments + (["--smoke"] if args.smoke else []) + (["--device", args.device] if args.device else [])


def variant_command(name: str, args: argparse.Namespace) -> list:
    return [sys.executable, "-m", "carnator_engine.demo.distill", *variant_arguments(name, args)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--minutes", type=float, default=5.0, help="each variant's training budget")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--grace", type=float, default=150.0, help="seconds after the budget for start-up and evaluation")
    parser.add_argument("--smoke", action="store_true", help="each variant's --smoke run, on the CPU")
    parser.add_argument("--device", default=None, help="passed to each variant (default: its own choice)")
    args = parser.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        parser.error(f"--variants {args.variants!r}: unknown {unknown or 'empty'}; choose from {', '.join(VARIANTS)}")
    if args.minutes <= 0:
        parser.error(f"--minutes {args.minutes}: must be > 0 (try 5 on one H200)")
    os.makedirs(args.out_dir, exist_ok=True)
    log_path = os.path.join(args.out_dir, "sweep_log.txt")
    processes = {}
    logs = {}
    for name in names:
        command = variant_command(name, args)
        logs[name] = open(os.path.join(args.out_dir, f".{name}.log"), "w")
        logs[name].write(" ".join(command) + "\n")
        logs[name].flush()
        processes[name] = subprocess.Popen(command, stdout=logs[name], stderr=subprocess.STDOUT)
        print(f"started {name}: {' '.join(command)}", flush=True)
    deadline = time.time() + args.minutes * 60.0 + args.grace
    codes = {}
    for name, process in processes.items():
        try:
            codes[name] = process.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            process.kill()
            codes[name] = f"stopped after {args.minutes:g} min + {args.grace:g} s"
            process.wait()
    rows = {}
    with open(log_path, "w") as combined:
        for name in names:
            logs[name].close()
            hidden = os.path.join(args.out_dir, f".{name}.log")
            with open(hidden) as handle:
                combined.write(f"===== {name} (exit {codes[name]})\n{handle.read()}\n")
            os.remove(hidden)
            report_path = os.path.join(args.out_dir, f"{name}.json")
            if codes[name] == 0 and os.path.exists(report_path):
                with open(report_path) as handle:
                    rows[name] = summary_row(json.load(handle))
            else:
                rows[name] = {"failed": codes[name]}
    scored = {n: r for n, r in rows.items() if "heldout_gap_points_at_4" in r}
    best = min(scored, key=lambda n: scored[n]["heldout_gap_points_at_4"]) if scored else None
    summary = {"minutes_each": args.minutes, "variants": {n: VARIANTS[n] for n in names}, "results": rows,
               "best_at_4_steps_heldout": best,
               "goal": "student at 4 steps within 2 points of the teacher at 20 steps (all six right, held-out)"}
    with open(os.path.join(args.out_dir, "sweep.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    for name, row in rows.items():
        print(f"{name}: {json.dumps(row)}", flush=True)
    print(f"best at 4 steps (held-out): {best}", flush=True)
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
