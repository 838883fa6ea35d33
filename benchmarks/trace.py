#!/usr/bin/env python3
"""Every reuse method on a creator's iteration trace (benchmarks/creator_trace.py), both seed habits.

Each method replays the trace with its own cache, cold at the start, through benchmarks/quality.py's runner; no reuse
generates every request in full and is the reference of every other method: PSNR and SSIM of each hit against it,
and each request's all-six-right reading paired with it (the change and its 95 % interval). Look-alike pairs
(direction reversed, colour or shape swapped, same seed, a fresh cache per pair) check wrong accepts where a gate is
most tempted. Per method: hit rate, exact repeats, model calls saved, amortized speedup (every request's cost: hits,
misses with their probe, repeats; in model calls and in seconds on this machine), accuracy, wrong accepts.

Methods: no_reuse, text_similarity (NIRVANA-style: MiniLM cosine picks the entry, fixed resume step), steps_<N>
(fewer steps: --fewer-steps), easycache (the EasyCache rule, benchmarks/quality.py), carnator_<risk> (the
product's pipeline, refine on, whole-clip resume, at each risk level), carnator+steps_<N> and carnator+easycache
(the default risk on top of the per-request method), carnator_subject_rule (the default with the gate's
refuse_subject_change on), carnator_region (carnator_balanced with region-only resume, its kept keys and values
in 16 bits; benchmarks/gpu_time.py prices its region steps) and carnator_region_8bit (the same in 8 bits: the
product's default); the cross-request caches a creator could pick instead
(benchmarks/prior_caches.py): cacheseek (CacheSeek's rule: the nearest prompt at cosine >= --cacheseek-threshold
skips the first 10 % of the steps), redi (ReDi's rule: the nearest trajectory after the probe steps within
--redi-threshold resumes at a later step) and comfyui_cache (ComfyUI's execution cache: the previous request again,
within one session, costs nothing).

    python benchmarks/trace.py --requests 50 --out /tmp/trace.json                      # quick CPU run
    python benchmarks/trace.py --device cuda --jobs 16 --out $OUT/trace.json             # 1,000 requests per habit
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import creator_trace  # noqa: E402
import prior_caches  # noqa: E402
import quality  # noqa: E402
import reports  # noqa: E402
from carnator_engine.demo import DEMO_STEPS, DEMO_WORLDS  # noqa: E402
from carnator_engine.demo.train import WORLDS  # noqa: E402
from quality import paired_change  # noqa: E402

RISKS = ("safe", "balanced", "aggressive")
DEFAULT_RISK = "balanced"
# look-alike pairs: what reads alike but must not be reused (world.adversarial_pairs kinds)
LOOK_ALIKE = ("direction", "color", "shape")
# evaluation world (quality.py --world) -> its TraceWorld; a world joins the trace by adding its adapter here
TRACE_WORLDS = {"v1": creator_trace.demo_world, "v2": creator_trace.SceneWorld}
# the sentence embeddings of every prompt of the committed runs (1,000 requests of seed 0, 48 look-alike pairs)
TEXT_EMBEDDINGS = os.path.join(HERE, "results", "quality", "trace_text_embeddings.pt")


def methods(fewer_steps: int, cacheseek_sweep=()) -> dict:
    """Trace method -> (quality.py method, risk level or None, gate settings over --gate's, run settings over the
    command line's). cacheseek_<T>: CacheSeek's rule at threshold T, one per value of --cacheseek-sweep."""
    steps = f"steps_{fewer_steps}"
    table = {"no_reuse": ("no_reuse", None, {}, {}), "text_similarity": ("text_similarity", None, {}, {}),
             steps: (steps, None, {}, {}), "easycache": ("easycache", None, {}, {}),
             **{name: (name, None, {}, {}) for name in ("cacheseek", "redi", "comfyui_cache")},
             **{f"cacheseek_{t:g}": ("cacheseek", None, {}, {"cacheseek_threshold": t}) for t in cacheseek_sweep}}
    table.update({f"carnator_{risk}": ("carnator_refine", risk, {}, {}) for risk in RISKS})
    table.update({f"carnator+{steps}": (f"carnator_refine+{steps}", DEFAULT_RISK, {}, {}),
                  "carnator+easycache": ("carnator_refine+easycache", DEFAULT_RISK, {}, {}),
                  # the default with the gate's subject rule on (off by default until measured)
                  "carnator_subject_rule": ("carnator_refine", DEFAULT_RISK, {"refuse_subject_change": True}, {}),
                  # region-only resume, its kept keys and values in 16 bits (gpu_time.py prices it)
                  "carnator_region": ("carnator_region", DEFAULT_RISK, {}, {}),
                  # the same in 8 bits (CarnatorConfig.region_kv_8bit): the product's default
                  "carnator_region_8bit": ("carnator_region_8bit", DEFAULT_RISK, {}, {})})
    return table


def requests_of(args, habit: str) -> tuple:
    """(trace requests, look-alike pairs) of one seed habit."""
    trace = creator_trace.generate_trace(TRACE_WORLDS[args.world](), args.requests, args.seed, habit)
    pairs = WORLDS[args.world].adversarial_pairs(args.pairs, seed=args.seed + 1, kinds=LOOK_ALIKE) if args.pairs else []
    return trace, pairs


def run_one(args, habit: str, name: str, reference: dict, chunk=None) -> dict:
    """One method on one habit's trace and pairs: {"trace": rows, "pairs": rows}; fills `reference` for no_reuse.
    chunk (i, n): no_reuse on every n-th request from the i-th only (it keeps no cache, so its requests split)."""
    from carnator_engine.backbones.tiny_dit import load_tiny_dit
    from carnator_engine.schedule import flow_sigmas
    method, risk, gate, settings = methods(args.fewer_steps, args.cacheseek_sweep)[name]
    run_args = copy.copy(args)
    vars(run_args).update(settings)
    run_args.risk = risk or DEFAULT_RISK
    run_args.gate_overrides = {**args.gate_overrides, **gate}
    model = load_tiny_dit(args.weights, args.device)
    sigmas = flow_sigmas(args.steps)
    encoder = (quality.CachedSentenceEncoder(args.text_embedding_cache) if prior_caches.needs_text_encoder(method)
               else None)
    trace, pairs = requests_of(args, habit)
    flat = [r for pair in pairs for r in pair]
    if chunk is not None:
        if method != "no_reuse":
            raise ValueError(f"only no_reuse splits its requests, not {name}")
        i, n = chunk
        return {"trace": quality.run_method(method, trace[i::n], model, sigmas, run_args, encoder, reference),
                "pairs": quality.run_method(method, flat[i::n], model, sigmas, run_args, encoder, reference)}
    rows = {"trace": quality.run_method(method, trace, model, sigmas, run_args, encoder, reference)}
    rows["pairs"] = quality.run_method(method, flat, model, sigmas, run_args, encoder, reference,
                                       fresh_cache_each=[list(pair) for pair in pairs])
    return rows


def summary(rows: dict, reference_rows: dict, steps: int, world) -> dict:
    """A method's figures on one habit: quality.summarize's, the paired change with its interval, amortized speedups,
    hit quality, and per operation of the trace its hits and wrong accepts."""
    trace, ref = rows["trace"], reference_rows["trace"]
    s = quality.summarize(trace, steps, ref, world)
    change, low, high = paired_change(s["made_wrong"], s["made_right"], s["requests"])
    calls = sum(r["model_calls"] for r in trace)
    s.update(change=change, change_low=low, change_high=high,
             speedup_calls=steps * len(trace) / calls if calls else float("inf"),
             speedup_seconds=sum(r["seconds"] for r in ref) / sum(r["seconds"] for r in trace))
    per_op = {}
    for row, reference in zip(trace, ref):
        op = per_op.setdefault(row["tags"]["op"], {"requests": 0, "hits": 0, "wrong_accepts": 0})
        op["requests"] += 1
        op["hits"] += bool(row["reused"])
        op["wrong_accepts"] += bool(row["reused"]) and bool(world.made_wrong(row["read"], reference["read"],
                                                                             row["expected"]))
    s["per_operation"] = per_op
    if rows["pairs"]:
        pairs = quality.summarize(quality.adversaries(rows["pairs"]), steps, quality.adversaries(reference_rows["pairs"]),
                                  world)
        s["look_alike_pairs"] = {k: pairs[k] for k in ("requests", "hit_rate", "attribute_accuracy", "wrong_accepts",
                                                       "made_wrong", "made_right")}
    return s


def save_reference(path: str, rows: dict, clips: dict) -> None:
    torch.save({"rows": rows, "clips": dict(clips)}, path + ".partial")
    os.replace(path + ".partial", path)     # whole or absent: a kept --work-dir never reads half a file


def save_rows(path: str, rows: dict) -> None:
    with open(path + ".partial", "w") as handle:
        json.dump(rows, handle, default=str)
    os.replace(path + ".partial", path)


def load_reference(path: str) -> tuple:
    saved = torch.load(path, weights_only=True)
    return saved["rows"], {(prompt, int(seed)): clip for (prompt, seed), clip in saved["clips"].items()}


def worker(args) -> int:
    """--worker HABIT:METHOD (reading no_reuse's clips, writing its rows as JSON) or HABIT:no_reuse:I/N (one chunk of
    no_reuse, writing its rows and clips)."""
    habit, name, *chunk = args.worker.split(":")
    if chunk:
        i, n = (int(part) for part in chunk[0].split("/"))
        clips = {}
        rows = run_one(args, habit, name, clips, (i, n))
        save_reference(args.rows_out, rows, clips)
        return 0
    _, clips = load_reference(args.reference)
    save_rows(args.rows_out, run_one(args, habit, name, clips))
    return 0


def child_command(args, job: str, reference: str, rows_out: str) -> list:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", job, "--reference", reference,
            "--rows-out", rows_out]
    for option in ("world", "requests", "seed", "pairs", "steps", "probe_steps", "guidance", "fewer_steps",
                   "step_cache_threshold", "step_cache_start", "text_threshold", "text_resume_step",
                   "cacheseek_threshold", "redi_threshold", "device", "weights", "max_density", "region_max_share"):
        argv += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    if args.cacheseek_sweep:
        argv += ["--cacheseek-sweep", ",".join(map(str, args.cacheseek_sweep))]
    if args.text_embedding_cache:
        argv += ["--text-embedding-cache", args.text_embedding_cache]
    if args.redi_resume_step:
        argv += ["--redi-resume-step", str(args.redi_resume_step)]
    if args.region_sparse_keys:
        argv += ["--region-sparse-keys"]
    if args.gate_overrides:
        argv += ["--gate", ",".join(f"{k}={v}" for k, v in args.gate_overrides.items())]
    return argv


def run_child(args, job: str, reference: str, out: str) -> None:
    """One worker process; its output (stdout and stderr) is shown when it fails."""
    log = out + ".log"
    with open(log, "w") as handle:
        code = subprocess.run(child_command(args, job, reference, out), stdout=handle, stderr=subprocess.STDOUT,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    if code:
        with open(log) as handle:
            raise RuntimeError(f"{job} failed (exit {code}):\n{handle.read()[-3000:]}")


# the settings a work folder's rows depend on: a folder kept with --work-dir serves only runs with the same ones
RUN_SETTINGS = ("world", "requests", "seed", "pairs", "steps", "probe_steps", "guidance", "fewer_steps",
                "step_cache_threshold", "step_cache_start", "text_threshold", "text_resume_step",
                "cacheseek_threshold", "redi_threshold", "redi_resume_step", "max_density", "region_max_share",
                "gate_overrides", "weights", "device")


def work_folder(args) -> str:
    """The folder of a run's reference clips and rows: --work-dir (kept, so that a later run with the same settings
    reads what this one finished) or a temporary one."""
    if not args.work_dir:
        return tempfile.mkdtemp(prefix="carnator-trace-")
    os.makedirs(args.work_dir, exist_ok=True)
    settings = json.loads(json.dumps({k: getattr(args, k) for k in RUN_SETTINGS}, default=str))
    if args.region_sparse_keys:     # counted only when on: a folder kept from before the setting still serves
        settings["region_sparse_keys"] = True
    stamp = os.path.join(args.work_dir, "settings.json")
    if os.path.exists(stamp):
        with open(stamp) as handle:
            kept = json.load(handle)
        if kept != settings:
            differ = ", ".join(sorted(k for k in settings if kept.get(k) != settings[k]))
            raise ValueError(f"--work-dir {args.work_dir} holds a run with other settings ({differ}): give another "
                             "folder, or the same settings")
    else:
        with open(stamp, "w") as handle:
            json.dump(settings, handle)
    return args.work_dir


def reference_file(work: str, habit: str) -> str:
    return os.path.join(work, f"reference_{habit}.pt")


def references_of(args, work: str, pool) -> dict:
    """habit -> (no_reuse rows, reference file), read from the work folder where an earlier run left it. With
    --jobs > 1, no_reuse's requests are split over the jobs."""
    found = {}
    for habit in args.habits:
        path = reference_file(work, habit)
        if os.path.exists(path):
            found[habit] = (load_reference(path)[0], path)
    missing = [habit for habit in args.habits if habit not in found]
    if args.jobs == 1:
        for habit in missing:
            clips = {}
            rows = run_one(args, habit, "no_reuse", clips)
            found[habit] = (rows, reference_file(work, habit))
            save_reference(found[habit][1], rows, clips)
        return found
    n = max(1, args.jobs // max(1, len(missing)))
    chunks = [(habit, i) for habit in missing for i in range(n)]

    def run(chunk):
        habit, i = chunk
        out = os.path.join(work, f"no_reuse_{habit}_{i}.pt")
        run_child(args, f"{habit}:no_reuse:{i}/{n}", "", out)
        return chunk, load_reference(out)

    parts = dict(pool.map(run, chunks))
    for habit in missing:
        rows, clips = {}, {}
        for kind in ("trace", "pairs"):
            size = sum(len(parts[(habit, i)][0][kind]) for i in range(n))
            joined = [None] * size
            for i in range(n):
                joined[i::n] = parts[(habit, i)][0][kind]
            rows[kind] = joined
        for i in range(n):
            clips.update(parts[(habit, i)][1])
        found[habit] = (rows, reference_file(work, habit))
        save_reference(found[habit][1], rows, clips)
    return found


def run_all(args, names: list, work: str) -> dict:
    """habit -> method -> rows: no_reuse first (the reference), then the other methods, --jobs processes at a time;
    what the work folder already holds is read instead."""
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        started = time.perf_counter()
        references = references_of(args, work, pool)
        print(f"no_reuse: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        rows = {habit: {"no_reuse": references[habit][0]} for habit in args.habits}

        def run(job):
            habit, name = job
            started = time.perf_counter()
            out = os.path.join(work, f"rows_{habit}_{name}.json")
            if os.path.exists(out):
                print(f"{habit} {name}: read from {out}", file=sys.stderr, flush=True)
            elif args.jobs == 1:
                save_rows(out, run_one(args, habit, name, load_reference(references[habit][1])[1]))
            else:
                run_child(args, f"{habit}:{name}", references[habit][1], out)
            with open(out) as handle:
                result = json.load(handle)
            print(f"{habit} {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            return job, result

        jobs = [(habit, name) for habit in args.habits for name in names if name != "no_reuse"]
        for (habit, name), result in pool.map(run, jobs):
            rows[habit][name] = result
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return rows


HEAD = (f"{'method':22} {'hits':>5} {'repeats':>7} {'calls saved':>11} {'speedup':>7} {'wall':>6} {'all six':>7} "
        f"{'change (95 % interval)':>24} {'wrong acc':>9} {'PSNR hits':>9} {'SSIM hits':>9} {'PSNR rest':>9} "
        f"{'look-alike wrong':>16}")


def _decibels(value) -> str:
    return f"{value:.1f}" if value is not None else "-"


def table_line(name: str, s: dict) -> str:
    look = s.get("look_alike_pairs")
    hit_psnr = f"{s['psnr_on_hits']:.1f}" if s["psnr_on_hits"] is not None else "-"
    hit_ssim = f"{s['ssim_on_hits']:.3f}" if s["ssim_on_hits"] is not None else "-"
    change = (f"{s['change'] * 100:+.1f} ({s['change_low'] * 100:+.1f} to {s['change_high'] * 100:+.1f})"
              if name != "no_reuse" else "")
    return (f"{name:22} {s['hit_rate']:>5.0%} {s['exact_repeats']:>7d} {s['model_calls_saved']:>11.1%} "
            f"{s['speedup_calls']:>6.2f}x {s['speedup_seconds']:>5.2f}x {s['attribute_accuracy']:>7.1%} {change:>24} "
            f"{s['wrong_accepts']:>9d} {hit_psnr:>9} {hit_ssim:>9} {_decibels(s.get('outside_psnr_on_hits')):>9} "
            f"{(str(look['wrong_accepts']) + ' / ' + str(look['requests'])) if look else '-':>16}")


def markdown(report: dict) -> str:
    """The run's table for benchmarks/RESULTS.md: one row per seed habit and method."""
    lines = ["| seeds | method | hits (exact repeats) | calls saved | speedup (calls / wall) | all six right "
             "(change vs no reuse, 95 % interval) | wrong accepts | PSNR / SSIM of hits | PSNR outside the region | "
             "look-alike wrong accepts |",
             "| --- " * 10 + "|"]
    for habit, table in report["results"].items():
        for name, s in table.items():
            hits = (f"{s['psnr_on_hits']:.1f} / {s['ssim_on_hits']:.3f}" if s["psnr_on_hits"] is not None else "-")
            change = (f" ({s['change'] * 100:+.1f}, {s['change_low'] * 100:+.1f} to {s['change_high'] * 100:+.1f})"
                      if name != "no_reuse" else "")
            look = s.get("look_alike_pairs")
            lines.append(f"| {habit} | {name} | {s['hit_rate']:.0%} ({s['exact_repeats']}) | {s['model_calls_saved']:.1%} "
                         f"| {s['speedup_calls']:.2f}x / {s['speedup_seconds']:.2f}x | {s['attribute_accuracy']:.1%}{change} "
                         f"| {s['wrong_accepts']} | {hits} | {_decibels(s.get('outside_psnr_on_hits'))} | "
                         f"{str(look['wrong_accepts']) + ' of ' + str(look['requests']) if look else '-'} |")
    return "\n".join(lines)


def plot(results: dict, path: str, title: str) -> None:
    """Accuracy change against calls saved, one panel per seed habit."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 5), sharey=True, squeeze=False)
    for axis, (habit, table) in zip(axes[0], results.items()):
        for name, s in table.items():
            color = "tab:green" if "+" in name else "tab:blue" if name.startswith("carnator") else "tab:gray"
            axis.errorbar(100 * s["model_calls_saved"], 100 * s["change"],
                          yerr=[[100 * (s["change"] - s["change_low"])], [100 * (s["change_high"] - s["change"])]],
                          fmt="o" if name.startswith("carnator") else "s", color=color, capsize=3)
            axis.annotate(name, (100 * s["model_calls_saved"], 100 * s["change"]), fontsize=7, xytext=(4, 4),
                          textcoords="offset points")
        axis.axhline(0, color="black", linewidth=0.5)
        axis.axhline(-1, color="tab:red", linewidth=0.5, linestyle="--")
        axis.axvline(30, color="tab:red", linewidth=0.5, linestyle=":")
        axis.set_xlabel("model calls saved (%)")
        axis.set_title(f"seed habit: {habit}")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("requests all six right, change vs no reuse (points, 95 % interval)")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=tuple(TRACE_WORLDS), default="v1", help="evaluation world")
    parser.add_argument("--requests", type=int, default=1000, help="trace requests per seed habit")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (sessions, edits, noise seeds)")
    parser.add_argument("--habits", default="fixed,randomize", help="seed habits: fixed, randomize or both")
    parser.add_argument("--pairs", type=int, default=48, help="look-alike pairs (same seed), a fresh cache each")
    parser.add_argument("--methods", help="comma-separated trace methods (default: all; no_reuse always runs)")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: the demo model's)")
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--guidance", type=float, default=None, help="default: the demo model's")
    parser.add_argument("--fewer-steps", type=int, default=14, help="the fewer-steps method's step count")
    parser.add_argument("--step-cache-threshold", type=float, default=0.05, help="the EasyCache rule's threshold")
    parser.add_argument("--step-cache-start", type=float, default=0.15)
    prior_caches.add_arguments(parser)
    parser.add_argument("--cacheseek-sweep", type=lambda text: [float(t) for t in text.split(",")], default=[],
                        help="more CacheSeek thresholds, comma-separated: each adds the method cacheseek_<T> "
                        "(e.g. 0.95,0.99,0.999: the trace's prompts of one edit score 0.80-0.99)")
    parser.add_argument("--text-embedding-cache", default=TEXT_EMBEDDINGS,
                        help="file of the prompt embeddings of text_similarity and cacheseek (quality.py); default: "
                        "the trace's, committed for a machine without the sentence encoder (a prompt it lacks is "
                        "encoded and added, where the encoder is installed)")
    parser.add_argument("--max-density", type=float, default=1.0)
    parser.add_argument("--region-max-share", type=float, default=quality.CarnatorConfig.region_max_share,
                        help="largest target share resumed region-only (the region methods)")
    parser.add_argument("--region-sparse-keys", action="store_true",
                        help="the region methods' target attends only to the keys it reaches in the cached sparse "
                             "attention (CarnatorConfig.region_sparse_keys)")
    parser.add_argument("--gate", dest="gate_overrides", type=quality.gate_overrides, default={},
                        help="gate settings over every Carnator method's preset, e.g. refuse_subject_change=true")
    parser.add_argument("--device", default="cpu", help="where the demo model runs (cpu, cuda)")
    parser.add_argument("--weights", default=None, help="demo model weights (default: the shipped ones)")
    parser.add_argument("--jobs", type=int, default=1, help="methods run side by side (processes)")
    parser.add_argument("--work-dir", help="keep the reference clips and each method's rows here: a later run with "
                        "the same settings reads them instead of running them again (a long run in parts)")
    parser.add_argument("--out", default="benchmarks/out/trace.json")
    parser.add_argument("--png", help="accuracy-vs-calls plot (default: beside --out, .png)")
    parser.add_argument("--from-json", help="print the tables and write the plot of an earlier run's JSON, run nothing; "
                        "several runs' JSON, comma-separated (one seed habit each), make one table and plot")
    parser.add_argument("--md", help="also write the table as markdown (benchmarks/RESULTS.md's form) to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or DEMO_STEPS
    args.guidance = args.guidance or DEMO_WORLDS[args.world]["guidance"]
    args.weights = args.weights or DEMO_WORLDS[args.world]["weights"]
    args.jump_path = [11]      # quality.py's runner reads it
    args.habits = args.habits.split(",")
    if args.requests < 1 or args.pairs < 0 or args.jobs < 1:
        parser.error(f"--requests ({args.requests}) and --jobs ({args.jobs}) must be >= 1, --pairs ({args.pairs}) >= 0")
    if not set(args.habits) <= set(creator_trace.SEED_HABITS):
        parser.error(f"--habits {','.join(args.habits)}: choose from {', '.join(creator_trace.SEED_HABITS)}")
    if not 1 <= args.fewer_steps < args.steps or not 1 <= args.probe_steps < args.steps:
        parser.error(f"--fewer-steps ({args.fewer_steps}) and --probe-steps ({args.probe_steps}) must be between 1 and "
                     f"--steps - 1 ({args.steps - 1})")
    known = methods(args.fewer_steps, args.cacheseek_sweep)
    names = ["no_reuse", *[n for n in (args.methods.split(",") if args.methods else known) if n != "no_reuse"]]
    if unknown := [n for n in names if n not in known]:
        parser.error(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    # a worker runs one method: only its settings are checked (the parent checked the run's)
    prior_caches.check_arguments(args, args.worker.split(":")[1:2] if args.worker else names, parser.error)
    if args.worker:
        return worker(args)

    if args.from_json:
        paths = args.from_json.split(",")
        try:
            report = joined([reports.read(path, rows=False) for path in paths])
        except ValueError as error:
            parser.error(f"--from-json {args.from_json}: {error}")
        return show(report, args.png or os.path.splitext(paths[0])[0] + ".png", args.md)

    torch.manual_seed(args.seed)
    started = time.perf_counter()
    try:
        work = work_folder(args)
    except ValueError as error:     # a --work-dir of another run's settings
        parser.error(str(error))
    rows = run_all(args, names, work)
    results = {habit: {name: summary(rows[habit][name], rows[habit]["no_reuse"], args.steps, WORLDS[args.world])
                       for name in names}
               for habit in args.habits}
    machine = f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"
    if args.device.startswith("cuda"):
        machine = f"{torch.cuda.get_device_name(0)}, {machine}"
    traces = {habit: creator_trace.trace_stats(requests_of(args, habit)[0]) for habit in args.habits}
    report = {"machine": machine, "args": {k: v for k, v in vars(args).items() if k not in ("worker", "reference",
                                                                                           "rows_out", "from_json",
                                                                                           "work_dir")},
              "seconds": round(time.perf_counter() - started, 1), "trace": traces,
              "mix": creator_trace.TraceMix().probabilities(), "results": results, "rows": rows}
    reports.write(args.out, report)
    print(f"wrote {args.out}")
    return show(report, args.png or os.path.splitext(args.out)[0] + ".png", args.md)


TRACE_IDENTITY = ("world", "requests", "seed")    # what makes two runs replay the same sessions


def joined(runs: list) -> dict:
    """One report of runs that each measured other seed habits of the same trace (a long CPU run goes one habit at a
    time): their tables side by side, the first run's arguments and machine."""
    report = copy.deepcopy(runs[0])
    for run in runs[1:]:
        if twice := set(report["results"]) & set(run["results"]):
            raise ValueError(f"seed habit {', '.join(sorted(twice))} is in more than one run: give each habit once")
        if any(run["args"][key] != report["args"][key] for key in TRACE_IDENTITY):
            raise ValueError("the runs replay different traces (--world, --requests or --seed differ): join runs of "
                             "one trace")
        report["results"].update(run["results"])
        report["trace"].update(run["trace"])
    return report


def show(report: dict, png: str, md=None) -> int:
    """Prints a run's tables and writes its plot (where matplotlib is installed: else the JSON's --from-json later) and,
    given `md`, its markdown table."""
    args, machine = report["args"], report["machine"]
    if md:
        with open(md, "w") as handle:
            handle.write(markdown(report) + "\n")
    for habit, table in report["results"].items():
        trace = report["trace"][habit]
        print(f"\nseed habit {habit}: {trace['requests']} requests in {trace['sessions']} sessions, "
              f"{trace['exact_repeats']} exact repeats in the trace; {args['steps']} steps, probe "
              f"{args['probe_steps']}, guidance {args['guidance']}; {machine}")
        print(HEAD)
        for name, s in table.items():
            print(table_line(name, s))
    try:
        plot(report["results"], png, f"Creator trace, demo world: accuracy vs calls saved ({args['requests']} "
                                     f"requests per habit, {args['steps']} steps; {machine})")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -r benchmarks/requirements.txt, then --from-json)")
        return 0
    print(f"\nwrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
