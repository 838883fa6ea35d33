"""Command line: `python -m carnator_engine demo | stats | clear`.

`demo` replays a short creative-iteration session on the embedded demo model (the project's tiny
DiT trained on the evaluation world) and prints, for each request, the gate's decision, the model
calls it cost and the attributes read back from the generated pixels.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .demo import DEMO_GUIDANCE, DEMO_STEPS
from .gate import RISK_LEVELS
from .store import DEFAULT_SIZE_LIMIT

DEMO_SESSION = [
    ("first request: cold cache", {"color": "red", "shape": "circle", "direction": "right", "background": "black",
                                   "size": "large", "speed": "slow"}, 1),
    ("same prompt, same seed", {"color": "red", "shape": "circle", "direction": "right", "background": "black",
                                "size": "large", "speed": "slow"}, 1),
    ("size edit", {"color": "red", "shape": "circle", "direction": "right", "background": "black",
                   "size": "small", "speed": "slow"}, 1),
    ("colour edit", {"color": "green", "shape": "circle", "direction": "right", "background": "black",
                     "size": "large", "speed": "slow"}, 1),
    ("direction swap (reads alike)", {"color": "red", "shape": "circle", "direction": "left",
                                      "background": "black", "size": "large", "speed": "slow"}, 1),
    ("background change", {"color": "red", "shape": "circle", "direction": "right", "background": "white",
                           "size": "large", "speed": "slow"}, 1),
]


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
        f"attributes: how many of the prompt's {attributes} attributes ({names}) the generated clip shows, as read "
        f"back from its pixels ({attributes}/{attributes}: all of them).",
        "sec: wall time. The first request also pays one-time start-up costs (PyTorch's first calls, the empty "
        "cache's creation), so compare the later misses with each other.",
    ])


def run_demo(args) -> int:
    import torch

    from .backbones.tiny_dit import load_tiny_dit
    from .demo import DEMO_WEIGHTS, world
    from .euler import TinyDiTRunner
    from .pipeline import CarnatorConfig, generate
    from .schedule import flow_sigmas

    weights = args.weights or DEMO_WEIGHTS
    if not os.path.exists(weights):
        print(f"error: demo weights not found at {weights}: pass --weights PATH to a Carnator tiny DiT "
              "checkpoint (benchmarks/README.md says how to train one)", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_tiny_dit(weights)
    cache_dir = args.cache or tempfile.mkdtemp(prefix="carnator-demo-")
    store = _open_store(args, cache_dir)
    config = CarnatorConfig(probe_steps=args.probe_steps, risk=args.risk, block_size=64)
    sigmas = flow_sigmas(args.steps)
    rows = []
    print(f"Carnator demo: {args.steps} steps, probe {args.probe_steps}, risk {args.risk}, cache {cache_dir}")
    for label, attributes, seed in DEMO_SESSION:
        text = world.prompt(attributes)
        runner = TinyDiTRunner(model, text, guidance_scale=args.guidance)
        noise = world.initial_noise([seed])
        started = time.perf_counter()
        result = generate(runner, noise, sigmas, store, config, text, seed)
        seconds = time.perf_counter() - started
        read = world.analyze(result.latent[0].clamp(-1, 1))
        correct = sum(read[name] == attributes[name] for name in world.ATTRIBUTES)
        rows.append({"request": label, "prompt": text, "seed": seed, "reuse": result.decision.reuse,
                     "exact_repeat": result.decision.exact_repeat,
                     "resume_step": result.decision.resume_step, "model_calls": result.model_calls,
                     "seconds": round(seconds, 3), "attributes_correct": f"{correct}/{len(world.ATTRIBUTES)}",
                     "read_back": read, "reasons": result.decision.reasons})
    header = f"{'request':30} {'decision':8} {'k':>3} {'calls':>5} {'sec':>6}  attributes"
    print(header + "\n" + "-" * len(header))
    for row in rows:
        decision = "repeat" if row["exact_repeat"] else "HIT" if row["reuse"] else "miss"
        print(f"{row['request']:30} {decision:8} {row['resume_step']:>3} {row['model_calls']:>5} "
              f"{row['seconds']:>6.2f}  {row['attributes_correct']}")
    total = sum(r["model_calls"] for r in rows)
    print(f"model calls: {total} of {args.steps * len(rows)} "
          f"({100 * (1 - total / (args.steps * len(rows))):.0f}% saved)")
    print(demo_legend(args.steps, args.probe_steps, len(world.ATTRIBUTES), ", ".join(world.ATTRIBUTES)))
    store.writer.settle()   # the stats count the last requests' entries, written in the background
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"rows": rows, "store": store.stats()}, handle, indent=2)
    store.close()
    return 0


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
    print(json.dumps({**store.stats(), "problems": store.drain_problems()}, indent=2))
    store.close()
    return 0


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
    demo.add_argument("--cache", default="", help="cache directory or redis:// URL (default: a fresh temporary "
                                                  "directory)")
    demo.add_argument("--weights", default="", help="tiny DiT checkpoint (default: the embedded demo model)")
    demo.add_argument("--steps", type=_positive_int, default=DEMO_STEPS,
                      help=f"denoising steps N of each request (default {DEMO_STEPS})")
    demo.add_argument("--probe-steps", type=_positive_int, default=3,
                      help="steps run before the cache is consulted, the Early Signature's (default 3)")
    demo.add_argument("--risk", choices=RISK_LEVELS, default="balanced",
                      help="the gate's risk level: safe reuses only close matches and resumes early, aggressive "
                           "reuses more and resumes later (default balanced)")
    demo.add_argument("--guidance", type=float, default=DEMO_GUIDANCE,
                      help=f"classifier-free guidance scale (default {DEMO_GUIDANCE:g}, what the demo model was "
                           "trained for)")
    demo.add_argument("--json", default="", help="also write the results to this JSON file")
    stats = commands.add_parser("stats", help="print a cache's statistics (creates nothing)")
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
