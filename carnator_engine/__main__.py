"""Command line: `python -m carnator_engine demo | stats | clear`.

`demo` replays a short creative-iteration session on the embedded demo model (the project's tiny
DiT trained on the evaluation world) and prints, for each request, the gate's decision, the model
calls it cost and the attributes read back from the generated pixels. At 8 steps or fewer (`demo --steps 4`) it
replays the session on the demo model's 4-step, guidance-1 student, as a step-distilled LoRA runs.
"""
from __future__ import annotations

import signal
import sys

EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_BROKEN_PIPE = 130, 143, 141


def _stop_at_once(signum, frame):
    """Ctrl-C outside main()'s own handling (while Python imports this module, or once main() has returned): one
    line and the usual exit status, never a traceback. Nothing of the command's is half-done then."""
    sys.stderr.write("\ninterrupted (Ctrl-C)\n" if sys.stderr.isatty() else "interrupted (Ctrl-C)\n")
    sys.stderr.flush()
    import os
    os._exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _stop_at_once)

import argparse  # noqa: E402 - after the Ctrl-C guard above
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402

# torch-free: --help and argument errors answer before torch is imported (seconds on a small machine); every
# module that needs torch is imported inside the command that uses it
from .demo import DEMO_GUIDANCE, DEMO_STEPS  # noqa: E402
from .settings import DEFAULT_SIZE_LIMIT, RISK_LEVELS  # noqa: E402
from .typed_paths import control_character  # noqa: E402

# The demo's bounds: its model samples best at 20 steps and guidance 2; beyond these a request takes minutes
# on a CPU (and a huge step count would exhaust memory) or the guidance turns the clip to noise.
STEPS_RANGE = (2, 100)
GUIDANCE_RANGE = (0.0, 20.0)
SIZE_LIMIT_MB_RANGE = (1, 1 << 24)      # 16 TiB
# The demo model's operations are too small to share among threads (carnator_engine/threads.py): one thread keeps
# the demo at its quiet speed on a busy machine. (Setting torch's count to its own current value changed nothing.)
DEMO_THREADS = 1
COMMANDS = ("demo", "stats", "clear", "reattach")


PROG = "python -m carnator_engine"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the flag, the bad value, what is allowed), like the command's own."""

    command = ""        # the subcommand being parsed, once known (its own options are listed by its --help)

    def error(self, message):
        if self.prog == PROG and message.startswith("the following arguments are required: command"):
            self.exit(2, f"error: no command given: {PROG} demo runs the demo; the commands are "
                         f"{', '.join(COMMANDS)} ({PROG} --help says what each does)\n")
        command = self.prog.split()[-1] if self.prog != PROG else _Parser.command
        self.exit(2, f"error: {message} ({PROG}{' ' + command if command else ''} --help lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):
        if self.prog != PROG:
            _Parser.command = self.prog.split()[-1]
        return super().parse_known_args(args, namespace)


def _int_in(low: int, high: int, why: str = ""):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number from {low} to {high}, got {text!r}{why}")
        return value
    return parse


def _finite_float_in(low: float, high: float, why: str = ""):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"must be a number from {low:g} to {high:g}, got {text!r}{why}")
        return value
    return parse


def _typed_path(text: str) -> str:
    """A path or URL argument as typed, refused (before torch loads) when it holds a control character."""
    refused = control_character(text)
    if refused:
        raise argparse.ArgumentTypeError(refused)
    return text


def _open_store(args, path: str):
    """The demo's cache with its --size-limit-mb (recorded with it); stats and clear open a cache with the limit
    recorded there, so looking at a cache neither changes its limit nor evicts anything."""
    from .store import CarnatorStore
    limit = args.size_limit_mb << 20 if args.command == "demo" else None
    return CarnatorStore(path, limit, blob_dir=args.blob_dir)


def demo_legend(steps: int, probe_steps: int, attributes: int, names: str) -> str:
    """What the demo table's columns mean (printed under it)."""
    return "\n".join([
        f"k: the step this request's trajectory continued from. miss: its own probe's end (k = probe steps = "
        f"{probe_steps}), then every step to {steps}; HIT: a cached trajectory's step k, after the {probe_steps} "
        f"probe steps (calls = {probe_steps} + {steps} - k, one more when the gate re-estimates the region that "
        f"differs); repeat: k = {steps}, the stored result of an earlier "
        "full generation of exactly this request, no step run.",
        f"calls: model calls (denoising steps run) of the {steps} a plain sampler runs.",
        "sec: the request's wall time through Carnator; plain s: the same request generated by a plain sampler "
        "(no cache), timed right after it; speedup: plain s / sec, the one baseline of every speedup shown (below "
        "1x: slower than plain, what a miss's probe and lookup cost); busy: other programs were using the CPU "
        "during one of the two runs (its wall time exceeded its CPU time by more than "
        f"{round(100 * (session_steady_factor() - 1))}%), so the ratio of the two times would be noise.",
        f"attributes: how many of the prompt's {attributes} attributes ({names}) the generated clip shows, as read "
        f"back from its pixels ({attributes}/{attributes}: all of them).",
    ])


def session_steady_factor() -> float:
    from .demo.session import STEADY_WALL_OVER_CPU
    return STEADY_WALL_OVER_CPU


def _os_reason(error: OSError) -> str:
    return error.strerror or str(error)


def _refused(flag: str, path: str, error: OSError, wanted: str) -> ValueError:
    """One line for a path the system refused: what it said, and the fix for that cause."""
    import errno
    fix = "pass a shorter path" if error.errno == errno.ENAMETOOLONG else f"pass {wanted} this user can write into"
    return ValueError(f"{flag} {path}: cannot write there ({_os_reason(error)}): {fix}")


def _writable_folder(path, flag: str) -> str:
    """`path` as an absolute folder that exists or can be made, tried before any work: the missing levels are made,
    a folder of our own is made and removed in it, then the levels we made are removed again. A place that cannot
    be written (/proc, a name too long for the filesystem) fails now and not after the session (ValueError)."""
    if not path:
        raise ValueError(f"{flag} is empty: pass a folder (it is made if missing), or omit {flag} for the "
                         "default")
    folder = os.path.abspath(path)
    missing = []
    existing = folder
    while not os.path.exists(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    made = []
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, f"{existing} is a file, not a folder")
        for level in reversed(missing):
            os.mkdir(level)
            made.append(level)
        os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".carnator-write-check-"))
    except OSError as error:
        raise _refused(flag, path, error, "a folder") from None
    finally:
        for level in reversed(made):
            try:
                os.rmdir(level)
            except OSError:
                pass
    return folder


def _json_path(path) -> str:
    """--json's file as an absolute path ("" for none), checked before the run: a regular file that can be written,
    or a new one that can be made in an existing folder (tried by making it and removing it again)."""
    if path is None:
        return ""
    if not path:
        raise ValueError("--json is empty: pass a file name for the results, or leave --json out")
    target = os.path.abspath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise ValueError(f"--json {path} is a folder: pass a file name, such as {os.path.join(path, 'demo.json')}")
    if not os.path.isdir(folder):
        raise ValueError(f"--json {path}: its folder {folder} does not exist: create the folder or pass another "
                         "file name")
    if os.path.exists(target):
        if not os.path.isfile(target):
            raise ValueError(f"--json {path} is not a regular file (a device or a pipe): pass a file name")
        if not os.access(target, os.W_OK):
            raise ValueError(f"--json {path} cannot be written (permission denied): pass another file name")
        return target
    try:
        with open(target, "x"):
            pass
        os.remove(target)
    except OSError as error:
        raise _refused("--json", path, error, "a file name in a folder") from None
    return target


def _write_json(path: str, value: dict) -> None:
    """The results into `path`, whole or not at all: written beside it and renamed over it, so a full disk leaves an
    earlier file of that name as it was (ValueError, one line)."""
    folder, name = os.path.split(path)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name[:100]}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as stream:
            json.dump(value, stream, indent=2)
        os.replace(temporary, path)
    except OSError as error:
        os.unlink(temporary)
        raise ValueError(f"--json {path} could not be written ({_os_reason(error)}); the results are printed "
                         "above") from None


def _check_weights(path: str) -> None:
    """--weights names a file (torch-free; its content is read by _load_demo_model)."""
    if not os.path.exists(path):
        raise ValueError(f"demo weights not found at {path}: pass --weights PATH to a Carnator tiny DiT checkpoint "
                         "(`python -m carnator_engine.demo.train --help` says how to train one)")
    if not os.path.isfile(path):
        raise ValueError(f"--weights {path} is a folder, not a checkpoint file: pass the .safetensors file, or leave "
                         "--weights out for the embedded demo model")


def _load_demo_model(path: str):
    from .backbones.tiny_dit import load_tiny_dit
    _check_weights(path)
    try:
        return load_tiny_dit(path)
    except Exception as error:  # noqa: BLE001 - any damage to the file: one line that names it, not a traceback
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--weights {path} is not a readable Carnator tiny DiT checkpoint ({first_line}): pass "
                         "an intact file, or leave --weights out for the embedded demo model") from None


def _check_demo_arguments(args) -> tuple:
    """Every demo argument that can be checked without torch, before anything runs: (out folder, json path)."""
    if args.probe_steps is not None and args.probe_steps >= args.steps:
        raise ValueError(f"--probe-steps {args.probe_steps} must be below --steps ({args.steps}): the probe runs the "
                         "first steps of the request, and at least one must remain for the cache to save")
    if args.cache is not None and not args.cache:
        raise ValueError("--cache is empty: pass a folder or a redis:// URL to keep the cache, or leave --cache out "
                         "for a temporary one")
    if args.weights is not None:
        if not args.weights:
            raise ValueError("--weights is empty: pass a checkpoint file, or leave --weights out for the embedded "
                             "demo model")
        _check_weights(args.weights)
    return _writable_folder(args.out, "--out"), _json_path(args.json)


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


def _import_torch() -> None:
    """Imports torch (seconds on a small machine). Run as a program, Ctrl-C meanwhile ends the process at once with
    one line (_stop_at_once): libraries imported on the way swallow a KeyboardInterrupt in places, and nothing of the
    command's needs cleaning up yet. From here on Ctrl-C is a KeyboardInterrupt, which main() handles after the
    command's own clean-up."""
    import torch  # noqa: F401
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _stop_at_once:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def run_demo(args) -> int:
    out_dir, json_path = _check_demo_arguments(args)
    _import_torch()
    from .pipeline import CarnatorConfig
    from .threads import cpu_threads

    demo_model_settings(args)
    config = CarnatorConfig(probe_steps=args.probe_steps, risk=args.risk, block_size=64)
    config.validate(args.steps)
    # torch's thread count from before the first model call (restored for a caller in-process)
    with cpu_threads(DEMO_THREADS), _EngineWarnings() as warnings:
        model = _load_demo_model(args.weights)
        cache_dir = args.cache or tempfile.mkdtemp(prefix="carnator-demo-")
        cache_text = cache_dir if args.cache else "temporary, removed at the end (--cache DIR keeps one)"
        try:
            warnings.quiet = True       # a cache that cannot be reached is said once, by the error below
            store = _open_store(args, cache_dir)
            try:
                _check_reachable(store)
                warnings.quiet = False
                return _demo_session(args, model, store, config, out_dir, json_path, cache_text)
            finally:
                store.close()
        finally:
            if not args.cache:
                shutil.rmtree(cache_dir, ignore_errors=True)


def _check_reachable(store) -> None:
    """A cache the demo cannot read now (a Redis server down, a folder not mounted) is refused before the first
    model call: every request would be generated in full, and the session would show nothing of the cache."""
    from .store import StoreError
    try:
        store.stats()
    except StoreError as error:
        raise ValueError(f"--cache {store.location} cannot be used now ({error}); or omit --cache for a temporary "
                         "cache") from None


class _EngineWarnings:
    """Inside: the engine's warnings reach stderr as `warning: ...` lines, each distinct message once (a store that
    fails warns at every request; the demo's rows say it in their own words), none while `quiet`."""

    def __init__(self):
        self.quiet, self.seen = False, set()

    def filter(self, record) -> bool:
        message = record.getMessage()
        if self.quiet or message in self.seen:
            return False
        self.seen.add(message)
        return True

    def __enter__(self):
        import logging
        self.logger = logging.getLogger("carnator")
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter("warning: %(message)s"))
        self.handler.setLevel(logging.WARNING)
        self.handler.addFilter(self)
        self.propagate = self.logger.propagate
        self.logger.addHandler(self.handler)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.propagate = self.propagate
        return False


def _cache_trouble(result, stored: list, failed: list, store, size_limit_mb: int) -> str:
    """Why the cache offered nothing to compare with this request when the store is the cause, in a user's words
    ("" otherwise): a fault now (the request's warnings), earlier generations that could not be stored, or earlier
    generations evicted to stay under the size limit."""
    from .store import StoreError
    if result.warnings:
        return f"the cache could not be used: {result.warnings[0]}"
    if failed:
        return f"the earlier generations could not be stored ({failed[-1]})"
    gone = 0
    for entry_id in stored:
        try:
            store.record(entry_id)
        except StoreError:
            gone += 1
    if gone:
        return (f"{gone} earlier generation{'s' if gone != 1 else ''} of this session "
                f"{'were' if gone != 1 else 'was'} evicted to keep the cache under its size limit "
                f"(--size-limit-mb {size_limit_mb}): raise it")
    return ""


def _demo_session(args, model, store, config, out_dir: str, json_path: str, cache_text: str) -> int:
    from .demo import frames, session, world
    from .observer import GenerationObserver
    from .pipeline import generate
    from .schedule import flow_sigmas

    sigmas = flow_sigmas(args.steps)
    policy = config.policy()
    progress = session.Progress(sys.stderr, live=sys.stderr.isatty())
    print(f"Carnator demo: {args.steps} steps, probe {args.probe_steps}, risk {args.risk}, guidance {args.guidance:g}, "
          f"model {os.path.basename(args.weights)}; cache: {cache_text}; frames: {out_dir}", flush=True)
    warm_up = session.ProgressRunner(model, world.prompt(session.DEMO_SESSION[0][1]), args.guidance, lambda: None)
    warm_up.run(world.initial_noise([0]), sigmas, 0, 1, GenerationObserver())   # PyTorch's first-call costs
    cold = _entries_or_none(store) == 0
    header = (f"{'request':34} {'decision':8} {'k':>3} {'calls':>5} {'sec':>6} {'plain s':>7} {'speedup':>7}  "
              "attributes")
    print(header + "\n" + "-" * len(header), flush=True)
    rows, clips, fresh_clips, stored, failed = [], [], [], [], []

    def plain_run(text: str, seed: int):
        plain = session.ProgressRunner(model, text, args.guidance, progress.call)
        return plain.run(world.initial_noise([seed]) * float(sigmas[0]), sigmas, 0, args.steps,
                         GenerationObserver())[0].clamp(-1, 1)

    for number, (label, attributes, seed) in enumerate(session.DEMO_SESSION, 1):
        label = f"{label}: cold cache" if number == 1 and cold else label
        text = world.prompt(attributes)
        step = f"[{number}/{len(session.DEMO_SESSION)}] {label}"
        progress.start(step)
        runner = session.ProgressRunner(model, text, args.guidance, progress.call)
        result, carnator = session.timed(lambda: generate(runner, world.initial_noise([seed]), sigmas, store, config,
                                                          text, seed))
        # the one baseline every speedup is against: the same request generated by a plain sampler, right after,
        # once the request's entry is written (the write-back would otherwise run during the plain generation)
        store.writer.settle()
        progress.start(f"{step}, plain sampler")
        fresh, plain = session.timed(lambda: plain_run(text, seed))
        progress.clear()
        clip = result.latent[0].clamp(-1, 1)
        read = world.analyze(clip)
        decision = result.decision
        row = {"request": label, "prompt": text, "seed": seed, "decision": session.decision_name(decision),
               "reuse": decision.reuse, "exact_repeat": decision.exact_repeat, "resume_step": decision.resume_step,
               "model_calls": result.model_calls, "seconds": carnator.wall,
               "cpu_seconds": carnator.cpu, "plain_seconds": plain.wall, "plain_cpu_seconds": plain.cpu, "speedup_vs_plain": session.row_speedup(plain, carnator),
               "psnr_vs_plain_db": session.psnr(clip, fresh),
               "attributes_correct": f"{sum(read[n] == attributes[n] for n in world.ATTRIBUTES)}/"
                                     f"{len(world.ATTRIBUTES)}",
               "read_back": read, "reasons": decision.reasons, "gate_numbers": decision.numbers,
               "warnings": result.warnings}
        if not decision.reuse:
            row["why_miss"] = session.miss_in_plain_words(
                decision, policy, _cache_trouble(result, stored, failed, store, args.size_limit_mb))
        if result.storing is not None:     # written by now (settled above)
            entry = result.storing.wait()
            stored.append(entry) if entry is not None else failed.append(result.storing.failure)
        row["entry"] = result.storing.entry_id if result.storing is not None else None
        row["source_entry"] = decision.entry_id if decision.reuse else None
        row["frames"] = os.path.join(out_dir, f"{number:02d}-{session.slug(label)}.png")
        rows.append(row)
        clips.append(clip)
        fresh_clips.append(fresh)
        print(f"{label:34} {row['decision']:8} {row['resume_step']:>3} {row['model_calls']:>5} {carnator.wall:>6.2f} "
              f"{plain.wall:>7.2f} {row['speedup_vs_plain']:>7}  {row['attributes_correct']}", flush=True)
        if not decision.reuse:
            print(f"{'':4}miss: {row['why_miss']}", flush=True)
    total = sum(r["model_calls"] for r in rows)
    print(f"model calls: {total} of {args.steps * len(rows)} "
          f"({100 * (1 - total / (args.steps * len(rows))):.0f}% saved)")
    os.makedirs(out_dir, exist_ok=True)
    for row, clip in zip(rows, clips):
        frames.write_png(row["frames"], frames.picture([(f"{row['request']}: {row['decision']}, {row['model_calls']} "
                                                         f"calls, {row['seconds']:.2f} s", clip)]))
    compared = _hit_against_fresh(args, model, rows, clips, fresh_clips, out_dir, config, plain_run, progress)
    print(f"frames: one strip per request in {out_dir}"
          + (f"; the hit next to its plain generation: {compared['picture']}" if compared else ""))
    print(demo_legend(args.steps, args.probe_steps, len(world.ATTRIBUTES), ", ".join(world.ATTRIBUTES)))
    store.writer.settle()   # the stats count the last requests' entries, written in the background
    if json_path:
        _write_json(json_path, {"weights": args.weights, "steps": args.steps, "guidance": args.guidance,
                                "probe_steps": args.probe_steps, "rows": rows, "hit_vs_fresh": compared,
                                "store": _stats_or_fault(store)})
    return 0


def _load() -> str:
    """The machine's load, for a timing that says it was disturbed."""
    try:
        return f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    except (AttributeError, OSError):
        return "other programs were running"


def _entries_or_none(store):
    """The store's entry count, or None when it cannot be read."""
    from .store import StoreError
    try:
        return store.stats()["entries"]
    except StoreError:
        return None


def _stats_or_fault(store) -> dict:
    from .store import StoreError
    try:
        return store.stats()
    except StoreError as error:
        return {"unreadable": str(error)}


# The hit shown beside its plain generation is timed this many times each way, alternating (its row's run is the
# first): the demo states their ratio only when each side's runs agree (session.steady_ratio).
TIMING_RUNS = 3


def _hit_against_fresh(args, model, rows: list, clips: list, fresh_clips: list, out_dir: str, config, plain_run,
                       progress):
    """The session's hit that saved the most model calls beside the plain generation of the same request, in one
    picture, with the two timed TIMING_RUNS times each, alternating; None (said) when nothing was resumed."""
    from .demo import frames, session

    hit = session.best_hit(rows)
    if hit is None:
        print(session.no_hit_in_plain_words(rows, args.risk))
        return None
    index = rows.index(hit)
    plain_runs, hit_runs = _time_hit_again(args, model, rows, hit, config, plain_run, progress)
    ratio = session.steady_ratio(plain_runs, hit_runs)
    said, captions = session.hit_timing_words(plain_runs, hit_runs, ratio, hit["model_calls"], args.steps,
                                              TIMING_RUNS, _load())
    path = os.path.join(out_dir, "hit-vs-fresh.png")
    frames.write_png(path, frames.picture([(hit["prompt"], None), (captions[0], fresh_clips[index]),
                                           (captions[1], clips[index])]))
    psnr = hit["psnr_vs_plain_db"]
    print(f"hit vs fresh ({hit['request']}): {said}; " + (f"PSNR {psnr:.1f} dB" if psnr is not None
                                                         else "identical frames"))
    return {"request": hit["request"], "model_calls": hit["model_calls"], "steps": args.steps,
            "speedup_cpu_median": round(ratio, 3) if ratio is not None else None,
            "plain_runs": [vars(run) for run in plain_runs], "hit_runs": [vars(run) for run in hit_runs],
            "psnr_db": psnr, "picture": path}


def _time_hit_again(args, model, rows: list, hit: dict, config, plain_run, progress) -> tuple:
    """(plain runs, hit runs): the hit's row's pair, then TIMING_RUNS - 1 more of each, alternating which goes first,
    in a scratch cache holding only the generation the hit resumed from (each repeat's own entry removed after it,
    so the next is a hit again, not an exact repeat). The session's cache is left as it was. Fewer runs (no ratio)
    when the hit's source is not a request of this session, or a repeat did not take the same decision."""
    from .demo import session, world
    from .pipeline import generate
    from .schedule import flow_sigmas
    from .store import CarnatorStore

    plain_runs = [session.Timed(hit["plain_seconds"], hit["plain_cpu_seconds"])]
    hit_runs = [session.Timed(hit["seconds"], hit["cpu_seconds"])]
    source = next((row for row in rows if row["entry"] is not None and row["entry"] == hit["source_entry"]), None)
    if source is None:
        return plain_runs, hit_runs
    sigmas = flow_sigmas(args.steps)
    scratch = tempfile.mkdtemp(prefix="carnator-demo-timing-")
    store = CarnatorStore(scratch)     # the default limit: it holds two entries at most
    try:
        def carnator(row):
            runner = session.ProgressRunner(model, row["prompt"], args.guidance, progress.call)
            return generate(runner, world.initial_noise([row["seed"]]), sigmas, store, config, row["prompt"],
                            row["seed"])
        def written(result):
            store.writer.settle()
            return result.storing.wait() if result.storing is not None else None
        progress.start("timing the hit: the cached generation it resumes from")
        written(carnator(source))
        for repeat in range(1, TIMING_RUNS):
            order = ("plain", "hit") if repeat % 2 else ("hit", "plain")
            for which in order:
                progress.start(f"timing the hit: run {repeat + 1} of {TIMING_RUNS}, {which}")
                if which == "plain":
                    plain_runs.append(session.timed(lambda: plain_run(hit["prompt"], hit["seed"]))[1])
                    continue
                result, took = session.timed(lambda: carnator(hit))
                entry = written(result)
                if result.model_calls != hit["model_calls"] or not result.decision.reuse:
                    return plain_runs[:1], hit_runs[:1]
                hit_runs.append(took)
                if entry is not None:
                    store.delete(entry)
    finally:
        progress.clear()
        store.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return plain_runs, hit_runs


def _existing_store(args, path: str):
    """The cache at `path`, or None (after saying so) when there is none: nothing is created."""
    if not path:
        raise ValueError("--cache is empty: pass the folder of an existing cache, or its redis:// URL")
    _import_torch()
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


def run_reattach(args) -> int:
    _import_torch()
    from .store.backends import is_redis_url
    from .store.backends.farm import FarmBackend
    if not is_redis_url(args.cache):
        raise ValueError(f"--cache {args.cache[:200]!r} is not a redis:// URL: give the farm's Redis")
    backend = FarmBackend(args.cache.strip(), args.blob_dir, reattach=True)
    print(f"{backend.location} is farm {backend.identity[:8]}... again (the identity its folder's marker names); "
          "its workers may open it")
    backend.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    _Parser.command = ""
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay a short iteration session on the embedded demo model")
    demo.add_argument("--cache", type=_typed_path, default=None,
                      help="cache directory or redis:// URL, kept after the run (default: a temporary directory, "
                           "removed at the end)")
    demo.add_argument("--weights", type=_typed_path, default=None,
                      help="tiny DiT checkpoint (default: the embedded demo model; at 8 steps or fewer its embedded "
                           "4-step student)")
    demo.add_argument("--steps", type=_int_in(*STEPS_RANGE, f" (the demo model samples best at {DEMO_STEPS}, its "
                                                            "4-step student at 4)"),
                      default=DEMO_STEPS, help=f"denoising steps N of each request, {STEPS_RANGE[0]}-{STEPS_RANGE[1]} "
                                               f"(default {DEMO_STEPS})")
    demo.add_argument("--probe-steps", type=_int_in(1, STEPS_RANGE[1] - 1), default=None,
                      help="steps run before the cache is consulted, the Early Signature's; from 1 to --steps - 1 "
                           "(default 3; 1 at 8 steps or fewer)")
    demo.add_argument("--risk", choices=RISK_LEVELS, default="balanced",
                      help="the gate's risk level: safe reuses only close matches and resumes early, aggressive "
                           "reuses more and resumes later (default balanced)")
    demo.add_argument("--guidance", type=_finite_float_in(*GUIDANCE_RANGE, " (the demo model samples best at "
                                                                         f"{DEMO_GUIDANCE:g})"),
                      default=None,
                      help=f"classifier-free guidance scale, {GUIDANCE_RANGE[0]:g}-{GUIDANCE_RANGE[1]:g} (default "
                           f"{DEMO_GUIDANCE:g}, what the demo model was trained for; 1 at 8 steps or fewer, what its "
                           "distilled student runs at)")
    demo.add_argument("--out", type=_typed_path, default="carnator-demo-frames",
                      help="folder for the frames: a PNG strip per request and hit-vs-fresh.png (default "
                           "./carnator-demo-frames; made if missing, files of the same names are replaced)")
    demo.add_argument("--json", type=_typed_path, default=None,
                      help="also write the results to this JSON file (its folder must exist; checked before the run)")
    stats = commands.add_parser("stats", help="print a cache's statistics (creates nothing)")
    stats.add_argument("--verify", action="store_true",
                       help="also read every entry's data against its checksums and list the corrupt ones (exit "
                            "status 1 if any)")
    clear = commands.add_parser("clear", help="delete every entry of a cache (asks first, unless --yes)")
    clear.add_argument("--yes", action="store_true", help="delete without asking")
    reattach = commands.add_parser("reattach", help="after a farm's Redis lost its data (no appendonly): give the "
                                                    "emptied Redis the identity its blob folder's marker names, so "
                                                    "its workers may open it again (only then: another server at "
                                                    "the same address is refused)")
    reattach.add_argument("--blob-dir", type=_typed_path, required=True,
                          help="the farm's shared folder (absolute path)")
    for sub in (stats, clear, reattach):
        sub.add_argument("--cache", type=_typed_path, required=True,
                         help="the cache's directory, or redis://[:password@]host:port/db (the password may come "
                              "from CARNATOR_REDIS_PASSWORD)")
    demo.add_argument("--size-limit-mb", type=_int_in(*SIZE_LIMIT_MB_RANGE), default=DEFAULT_SIZE_LIMIT >> 20,
                      help=f"cache size limit in MiB, {SIZE_LIMIT_MB_RANGE[0]}-{SIZE_LIMIT_MB_RANGE[1]}, recorded with "
                           "the cache (stats shows it); least useful entries are evicted beyond it "
                           f"(default {DEFAULT_SIZE_LIMIT >> 20}, as on the Carnator Cache node)")
    for sub in (demo, stats, clear):
        sub.add_argument("--blob-dir", type=_typed_path, default="",
                         help="farm layout, with a redis:// --cache: the shared folder (absolute path, mounted by "
                              "every worker) that keeps the trajectories; empty = everything in Redis")
    return parser


class _Terminated(Exception):
    """SIGTERM, raised where the command is so that its clean-up (the temporary cache) runs before it exits."""


def _raise_terminated(signum, frame):
    raise _Terminated()


def main(argv=None) -> int:
    in_main_thread = threading.current_thread() is threading.main_thread()   # where Python takes signals
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    args = argparse.Namespace(command="the command")
    try:
        args = build_parser().parse_args(argv)
        status = {"demo": run_demo, "stats": run_stats, "clear": run_clear,
                  "reattach": run_reattach}[args.command](args)
        sys.stdout.flush()      # a reader that went away is found here, not in Python's flush at exit
        return status
    except (ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{chr(10) if sys.stderr.isatty() else ''}interrupted: {args.command} stopped (Ctrl-C); its "
              "temporary files are removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _Terminated:
        print(f"terminated: {args.command} stopped (SIGTERM); its temporary files are removed", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:
        # the reader went away (`stats | head`): the rest of the output has nowhere to go, and Python's own flush
        # at exit must not fail on it again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    status = main()
    signal.signal(signal.SIGINT, _stop_at_once)     # Ctrl-C while Python shuts down: one line all the same
    sys.exit(status)
