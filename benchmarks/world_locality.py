"""How much of a clip an edit changes, in each evaluation world: the room a localized reuse has to work with.

Each world's iteration stream (one edit per request) is rendered from ground truth: every edit is drawn twice with
the same seed, before and after, and a token (the demo model's patch: 1 frame x 4 x 4 pixels, 512 a clip) counts
as changed when any of its pixels moves by more than one 8-bit level. No model is involved: this is what the worlds
ask of a generator, the upper bound of what a perfect model's edits would change.

    python benchmarks/world_locality.py --out benchmarks/results/demo_model/world_locality.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carnator_engine.demo.train import WORLDS  # noqa: E402

PATCH = (1, 4, 4)          # TinyDiTConfig.patch: one token per frame and 4 x 4 pixels
LEVEL = 2.0 / 255          # one 8-bit level of a clip in [-1, 1]


def changed_tokens(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """[B] share of tokens with any pixel changed by more than one level, clips [B, 3, F, H, W]."""
    moved = ((before - after).abs() > LEVEL).any(1).float()[:, None]                             # [B, 1, F, H, W]
    tokens = torch.nn.functional.max_pool3d(moved, PATCH, PATCH)
    return tokens.flatten(1).mean(1)


def locality(world, requests: int, seed: int) -> dict:
    """Per edit kind: edits, mean share of tokens changed, share of edits changing at most half of the clip."""
    stream = world.iteration_stream(requests, seed=seed)
    edits = [(before, after) for before, after in zip(stream, stream[1:])]
    shares = []
    for start in range(0, len(edits), 64):
        chunk = edits[start:start + 64]
        seeds = [after.seed for _, after in chunk]
        render = lambda scenes: torch.stack([world.render(s, seed=x) for s, x in zip(scenes, seeds)])  # noqa: E731
        shares += changed_tokens(render([b.attributes for b, _ in chunk]), render([a.attributes for _, a in chunk]))
    by_kind = {}
    for (_, after), share in zip(edits, shares):
        by_kind.setdefault(after.edited, []).append(float(share))
    by_kind["all edits"] = [float(s) for s in shares]
    return {kind: {"edits": len(values), "tokens_changed": sum(values) / len(values),
                   "at_most_half": sum(v <= 0.5 for v in values) / len(values)} for kind, values in by_kind.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000, help="requests in each world's iteration stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/out/world_locality.json")
    args = parser.parse_args(argv)
    if args.requests < 2:
        parser.error(f"--requests must be at least 2 (one edit needs two requests), got {args.requests}")
    results = {name: locality(world, args.requests, args.seed) for name, world in WORLDS.items()}
    report = {"machine": f"{platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}",
              "args": vars(args), "token": "1 frame x 4 x 4 pixels (512 a clip)", "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(f"Share of the clip's tokens an edit changes (ground truth, same seed; {args.requests} requests a world)")
    print(f"{'world':6} {'edit':12} {'edits':>6} {'tokens changed':>15} {'edits <= half':>14}")
    for name, table in results.items():
        for kind, row in table.items():
            print(f"{name:6} {kind:12} {row['edits']:>6} {row['tokens_changed']:>15.1%} {row['at_most_half']:>14.0%}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
