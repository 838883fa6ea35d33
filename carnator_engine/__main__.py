"""Command line: `python -m carnator_engine demo | stats | clear`.

`demo` replays a short creative-iteration session on the embedded demo model (the project's tiny
DiT trained on the evaluation world) and prints, for each request, the gate's decision, the model
calls it cost and the attributes read back from the generated pixels. At 8 steps or fewer (`demo --steps 4`) it
replays the session on the demo model's 4-step, guidance-1 student, as a step-distilled LoRA runs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

from .demo import DEMO_GUIDANCE, DEMO_STEPS
from .gate import RISK_LEVELS
from .store import DEFAULT_SIZE_LIMIT

def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _open_store(args, path: str):
    from .store import CarnatorStore
    return CarnatorStore(path, args.size_limit_mb << 20, blob_dir=args.blob_dir)


def demo_legend(steps: int, probe_steps: int, attributes: int, names: str) -> str:
    """What the demo table's columns mean (printed under it)."""
    return "\n".join([
        f"k: the step this request's trajectory continued from. miss: its own probe's end (k = probe steps = "
        f"{probe_steps}), then every step to {steps}; HIT: a cached trajectory's step k, after the {probe_steps} "
        f"probe steps (calls = {probe_steps} + {steps} - k, one more when the gate re-estimates the region that "
        f"differs); repeat: k = {steps}, the stored result of an earlier "
        "full generation of exactly this request, no step run.",
        f"calls: model calls (denoising steps run) of the {steps} a plain sampler would run.",
        "sec: wall time; vs miss: how many times faster than the first request, the cold miss (a warm-up call ran "
        "before it, so it pays no start-up cost).",
        f"attributes: how many of the prompt's {attributes} attributes ({names}) the generated clip shows, as read "
        f"back from its pixels ({attributes}/{attributes}: all of them).",
    ])


def _writable_folder(path: str, flag: str) -> str:
    """`path` as an absolute folder that exists or can be made, checked before any work (ValueError if not)."""
    folder = os.path.abspath(path)
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {existing} is not a folder this user can write into: pass another path")
    return folder


def _json_path(path: str) -> str:
    if not path:
        return ""
    target = os.path.abspath(path)
    if os.path.isdir(target) or not os.path.isdir(os.path.dirname(target)):
        raise ValueError(f"--json {path}: its folder {os.path.dirname(target)} does not exist (or the path is a "
                         "folder): create the folder or pass another file name")
    if not os.access(os.path.dirname(target), os.W_OK):
        raise ValueError(f"--json {path}: its folder is not writable: pass another file name")
    return target


def _load_demo_model(path: str):
    from .backbones.tiny_dit import load_tiny_dit
    if not os.path.exists(path):
        raise ValueError(f"demo weights not found at {path}: pass --weights PATH to a Carnator tiny DiT checkpoint "
                         "(`python -m carnator_engine.demo.train --help` says how to train one)")
    try:
        return load_tiny_dit(path)
    except Exception as error:  # noqa: BLE001 - any damage to the file: one line that names it, not a traceback
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--weights {path} is not a readable Carnator tiny DiT checkpoint ({first_line}): pass "
                         "an intact file, or leave --weights out for the embedded demo model") from None


def demo_model_settings(args) -> None:
    """Fills the demo's unset --weights, --guidance and --probe-steps for its schedule: at few-step schedules (8 steps
    or fewer) the demo model's 4-step student at guidance 1 and a one-step probe, as a distilled LoRA runs; otherwise
    the demo model at the guidance it samples best at and a three-step probe."""
    from .demo import DEMO_GUIDANCE, DEMO_WEIGHTS, FEW_STEP_GUIDANCE, FEW_STEP_WEIGHTS
    from .gate import default_probe_steps, few_step

    few = few_step(args.steps)
    args.weights = args.weights or (FEW_STEP_WEIGHTS if few else DEMO_WEIGHTS)
    args.guidance = args.guidance if args.guidance is not None else FEW_STEP_GUIDANCE if few else DEMO_GUIDANCE
    args.probe_steps = args.probe_steps or default_probe_steps(args.steps)


def run_demo(args) -> int:
    from .pipeline import CarnatorConfig

    demo_model_settings(args)
    config = CarnatorConfig(probe_steps=args.probe_steps, risk=args.risk, block_size=64)
    config.validate(args.steps)
    out_dir = _writable_folder(args.out, "--out")
    json_path = _json_path(args.json)
    model = _load_demo_model(args.weights)
    cache_dir = args.cache or tempfile.mkdtemp(prefix="carnator-demo-")
    cache_text = cache_dir if args.cache else "temporary, removed at the end (--cache DIR keeps one)"
    try:
        store = _open_store(args, cache_dir)
        try:
            return _demo_session(args, model, store, config, out_dir, json_path, cache_text)
        finally:
            store.close()
    finally:
        if not args.cache:
            shutil.rmtree(cache_dir, ignore_errors=True)


def _demo_session(args, model, store, config, out_dir: str, json_path: str, cache_text: str) -> int:
    import torch

    from .demo import frames, session, world
    from .observer import GenerationObserver
    from .pipeline import generate
    from .schedule import flow_sigmas

    torch.set_num_threads(max(1, torch.get_num_threads()))
    sigmas = flow_sigmas(args.steps)
    policy = config.policy()
    progress = session.Progress(sys.stderr, live=sys.stderr.isatty())
    print(f"Carnator demo: {args.steps} steps, probe {args.probe_steps}, risk {args.risk}, guidance {args.guidance:g}, "
          f"model {os.path.basename(args.weights)}; cache: {cache_text}; "
          f"frames: {out_dir}")
    warm_up = session.ProgressRunner(model, world.prompt(session.DEMO_SESSION[0][1]), args.guidance, lambda: None)
    warm_up.run(world.initial_noise([0]), sigmas, 0, 1, GenerationObserver())   # PyTorch's first-call costs
    header = f"{'request':30} {'decision':8} {'k':>3} {'calls':>5} {'sec':>6} {'vs miss':>7}  attributes"
    print(header + "\n" + "-" * len(header), flush=True)
    rows, clips = [], []
    for number, (label, attributes, seed) in enumerate(session.DEMO_SESSION, 1):
        text = world.prompt(attributes)
        runner = session.ProgressRunner(model, text, args.guidance, progress.call)
        progress.start(f"[{number}/{len(session.DEMO_SESSION)}] {label}")
        started = time.perf_counter()
        result = generate(runner, world.initial_noise([seed]), sigmas, store, config, text, seed)
        seconds = time.perf_counter() - started
        progress.clear()
        clip = result.latent[0].clamp(-1, 1)
        read = world.analyze(clip)
        decision = result.decision
        row = {"request": label, "prompt": text, "seed": seed, "decision": session.decision_name(decision),
               "reuse": decision.reuse, "exact_repeat": decision.exact_repeat, "resume_step": decision.resume_step,
               "model_calls": result.model_calls, "seconds": round(seconds, 3),
               "attributes_correct": f"{sum(read[n] == attributes[n] for n in world.ATTRIBUTES)}/"
                                     f"{len(world.ATTRIBUTES)}",
               "read_back": read, "reasons": decision.reasons}
        cold = rows[0]["seconds"] if rows else seconds
        row["speedup_vs_cold_miss"] = session.speedup(cold, seconds) if decision.reuse else None
        if not decision.reuse:
            row["why_miss"] = session.miss_in_plain_words(decision, policy)
        row["frames"] = os.path.join(out_dir, f"{number:02d}-{session.slug(label)}.png")
        rows.append(row)
        clips.append(clip)
        print(f"{label:30} {row['decision']:8} {row['resume_step']:>3} {row['model_calls']:>5} {seconds:>6.2f} "
              f"{row['speedup_vs_cold_miss'] or '':>7}  {row['attributes_correct']}", flush=True)
        if not decision.reuse:
            print(f"{'':4}miss: {row['why_miss']}", flush=True)
    total = sum(r["model_calls"] for r in rows)
    print(f"model calls: {total} of {args.steps * len(rows)} "
          f"({100 * (1 - total / (args.steps * len(rows))):.0f}% saved)")
    os.makedirs(out_dir, exist_ok=True)
    for row, clip in zip(rows, clips):
        frames.write_png(row["frames"], frames.picture([(f"{row['request']}: {row['decision']}, {row['model_calls']} "
                                                         f"calls, {row['seconds']:.2f} s", clip)]))
    compared = _hit_against_fresh(args, model, sigmas, rows, clips, out_dir)
    print(f"frames: one strip per request in {out_dir}"
          + (f"; the hit next to a fresh generation: {compared['picture']}" if compared else ""))
    print(demo_legend(args.steps, args.probe_steps, len(world.ATTRIBUTES), ", ".join(world.ATTRIBUTES)))
    store.writer.settle()   # the stats count the last requests' entries, written in the background
    if json_path:
        with open(json_path, "w") as handle:
            json.dump({"weights": args.weights, "steps": args.steps, "guidance": args.guidance,
                       "probe_steps": args.probe_steps, "rows": rows, "hit_vs_fresh": compared,
                       "store": store.stats()}, handle, indent=2)
    return 0


def _hit_against_fresh(args, model, sigmas, rows: list, clips: list, out_dir: str):
    """The session's first hit generated again without Carnator (a plain sampler), timed, and both clips in one
    picture; None (said) when no request was a hit."""
    from .demo import frames, session, world
    from .observer import GenerationObserver

    hit = session.first_hit(rows)
    if hit is None:
        print("no request was a hit at this risk level: no hit-versus-fresh picture")
        return None
    runner = session.ProgressRunner(model, hit["prompt"], args.guidance, lambda: None)
    started = time.perf_counter()
    fresh = runner.run(world.initial_noise([hit["seed"]]) * float(sigmas[0]), sigmas, 0, args.steps,
                       GenerationObserver())[0].clamp(-1, 1)
    seconds = time.perf_counter() - started
    hit_clip = clips[rows.index(hit)]
    mse = float(((hit_clip - fresh) / 2).pow(2).mean())
    psnr = round(10 * math.log10(1 / mse), 2) if mse > 0 else None
    path = os.path.join(out_dir, "hit-vs-fresh.png")
    frames.write_png(path, frames.picture([
        (hit["prompt"], None),
        (f"fresh generation: {args.steps} model calls, {seconds:.2f} s", fresh),
        (f"Carnator hit: {hit['model_calls']} model calls, {hit['seconds']:.2f} s "
         f"({session.speedup(seconds, hit['seconds'])} faster)", hit_clip)]))
    print(f"hit vs fresh ({hit['request']}): {hit['seconds']:.2f} s against {seconds:.2f} s for the plain sampler "
          f"({session.speedup(seconds, hit['seconds'])}), "
          + (f"PSNR {psnr:.1f} dB" if psnr is not None else "identical frames"))
    return {"request": hit["request"], "fresh_seconds": round(seconds, 3), "hit_seconds": hit["seconds"],
            "psnr_db": psnr, "picture": path}


def _existing_store(args, path: str):
    """The cache at `path`, or None (after saying so) when there is none: nothing is created."""
    from .store.backends import holds_store
    if not holds_store(path):
        print(f"no Carnator cache at {path} (nothing created): pass --cache the folder of an existing cache",
              file=sys.stderr)
        return None
    return _open_store(args, path)


def run_stats(args) -> int:
    store = _existing_store(args, args.cache)
    if store is None:
        return 1
    try:
        corrupt = _verified_entries(store) if args.verify else None
        report = store.stats()
        if corrupt is not None:
            report["corrupt_entries"] = corrupt
        print(json.dumps({**report, "problems": store.drain_problems()}, indent=2))
    finally:
        store.close()
    return 1 if corrupt else 0


def _verified_entries(store) -> list:
    """Reads every entry's signature and trajectory against their checksums: [{entry, why}] of the corrupt ones
    (now marked so, which lookups skip). An entry deleted or evicted meanwhile is not counted."""
    from .store.errors import CorruptEntryError, StoreError
    corrupt = []
    for record in store.records(include_corrupt=True):
        why = record.corrupt
        if why is None:
            try:
                store.signature(record)
                store.trajectory(record)
            except CorruptEntryError as error:
                why = str(error)
            except StoreError:
                continue
        if why is not None:
            corrupt.append({"entry": record.entry_id, "why": why})
    return corrupt


def _confirmed(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    try:
        return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def run_clear(args) -> int:
    store = _existing_store(args, args.cache)
    if store is None:
        return 1
    count = store.stats()["entries"]
    if not args.yes and not _confirmed(f"delete all {count} entries of the cache at {store.location}?"):
        print("nothing deleted: confirm at the prompt, or pass --yes", file=sys.stderr)
        store.close()
        return 1
    print(f"removed {store.clear()} entries from {store.location}")
    store.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m carnator_engine", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay a short iteration session on the embedded demo model")
    demo.add_argument("--cache", default="", help="cache directory or redis:// URL, kept after the run (default: a "
                                                  "temporary directory, removed at the end)")
    demo.add_argument("--weights", default="", help="tiny DiT checkpoint (default: the embedded demo model; at 8 "
                                                    "steps or fewer its embedded 4-step student)")
    demo.add_argument("--steps", type=_positive_int, default=DEMO_STEPS,
                      help=f"denoising steps N of each request (default {DEMO_STEPS})")
    demo.add_argument("--probe-steps", type=_positive_int, default=None,
                      help="steps run before the cache is consulted, the Early Signature's (default 3; 1 at 8 steps "
                           "or fewer)")
    demo.add_argument("--risk", choices=RISK_LEVELS, default="balanced",
                      help="the gate's risk level: safe reuses only close matches and resumes early, aggressive "
                           "reuses more and resumes later (default balanced)")
    demo.add_argument("--guidance", type=float, default=None,
                      help=f"classifier-free guidance scale (default {DEMO_GUIDANCE:g}, what the demo model was "
                           "trained for; 1 at 8 steps or fewer, what its distilled student runs at)")
    demo.add_argument("--out", default="carnator-demo-frames",
                      help="folder for the frames: a PNG strip per request and hit-vs-fresh.png (default "
                           "./carnator-demo-frames; made if missing, files of the same names are replaced)")
    demo.add_argument("--json", default="", help="also write the results to this JSON file (its folder must exist)")
    stats = commands.add_parser("stats", help="print a cache's statistics (creates nothing)")
    stats.add_argument("--verify", action="store_true",
                       help="also read every entry's data against its checksums and list the corrupt ones (exit "
                            "status 1 if any)")
    clear = commands.add_parser("clear", help="delete every entry of a cache (asks first, unless --yes)")
    clear.add_argument("--yes", action="store_true", help="delete without asking")
    for sub in (stats, clear):
        sub.add_argument("--cache", required=True, help="the cache's directory, or redis://[:password@]host:port/db "
                                                        "(the password may come from CARNATOR_REDIS_PASSWORD)")
    for sub in (demo, stats, clear):
        sub.add_argument("--size-limit-mb", type=_positive_int, default=DEFAULT_SIZE_LIMIT >> 20,
                         help=f"cache size limit in MiB; least useful entries are evicted beyond it "
                              f"(default {DEFAULT_SIZE_LIMIT >> 20}, as on the Carnator Cache node)")
        sub.add_argument("--blob-dir", default="", help="farm layout, with a redis:// --cache: the shared folder "
                                                        "(absolute path, mounted by every worker) that keeps the "
                                                        "trajectories; empty = everything in Redis")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"demo": run_demo, "stats": run_stats, "clear": run_clear}[args.command](args)
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
