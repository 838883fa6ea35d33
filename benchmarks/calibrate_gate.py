"""Gate calibration in the evaluation world: signature distances by kind of edit, and what reuse does.

For pairs (cached request, new request) of each kind — the same prompt with another seed, one
attribute edited (same seed and fresh seed), adversarial swaps — it prints the distribution of the
gate's inputs (pooled block states, attention structure, denoised estimate outside the target
region, target share) and, for forced reuse at several resume steps, how often the result keeps
the new request's attributes. The risk presets in carnator_engine/gate.py were set from this table.

    python benchmarks/calibrate_gate.py --pairs 12 --out benchmarks/out/calibration.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carnator_engine.backbones.tiny_dit import load_tiny_dit  # noqa: E402
from carnator_engine.demo import DEMO_WEIGHTS, world  # noqa: E402
from carnator_engine.euler import TinyDiTRunner  # noqa: E402
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe, resume  # noqa: E402
from carnator_engine.schedule import flow_sigmas  # noqa: E402
from carnator_engine.store import CarnatorStore  # noqa: E402

KINDS = ("same_prompt_new_seed", "edit_same_seed", "edit_new_seed", "direction_swap", "color_swap")


def make_pair(kind: str, generator: torch.Generator):
    first = world.random_attributes(generator=generator)
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    other_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
    if kind == "same_prompt_new_seed":
        return (first, seed), (first, other_seed)
    if kind == "direction_swap":
        return (first, seed), (world.edit(first, "direction", generator, world.OPPOSITE_DIRECTION[first["direction"]]), seed)
    if kind == "color_swap":
        return (first, seed), (world.edit(first, "color", generator), seed)
    name = world.ATTRIBUTES[int(torch.randint(len(world.ATTRIBUTES), (1,), generator=generator))]
    return (first, seed), (world.edit(first, name, generator), seed if kind == "edit_same_seed" else other_seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=DEMO_WEIGHTS)
    parser.add_argument("--pairs", type=int, default=12, help="pairs per kind")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--resume-steps", default="6,9,12,15")
    parser.add_argument("--out", default="benchmarks/out/calibration.json")
    args = parser.parse_args(argv)
    model = load_tiny_dit(args.weights)
    sigmas = flow_sigmas(args.steps)
    resume_steps = [int(s) for s in args.resume_steps.split(",")]
    # Permissive thresholds: we want every pair's numbers, and a forced hit at each resume step.
    loose = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, max_context_share=1.0, max_target_fraction=1.0,
                 max_resume_fraction=0.95, min_saved_steps=1)
    generator = torch.Generator().manual_seed(0)
    report = {}
    for kind in KINDS:
        rows = []
        for _ in range(args.pairs):
            (first, seed_a), (second, seed_b) = make_pair(kind, generator)
            with tempfile.TemporaryDirectory() as directory:
                store = CarnatorStore(directory, 1 << 30)
                cold = CarnatorConfig(probe_steps=args.probe_steps, block_size=64, max_checkpoints=args.steps,
                                      gate_overrides=loose)
                generate(TinyDiTRunner(model, world.prompt(first)), world.initial_noise([seed_a]), sigmas, store,
                         cold, world.prompt(first), seed_a)
                runner = TinyDiTRunner(model, world.prompt(second))
                probed = probe(runner, world.initial_noise([seed_b]), sigmas, cold)
                candidates = lookup(store, probed, cold)
                row = {"numbers": decide(probed, candidates, cold).numbers, "correct_at": {}}
                for k in resume_steps:
                    forced = replace(cold, gate_overrides={**loose, "max_resume_fraction": k / args.steps})
                    decision = decide(probed, candidates, forced)
                    if not decision.reuse:
                        continue
                    row.setdefault("resumed_at", {})[k] = decision.resume_step
                    result = resume(runner, probed, decision, store, forced)
                    read = world.analyze(result.latent[0].clamp(-1, 1))
                    row["correct_at"][k] = all(read[a] == second[a] for a in world.ATTRIBUTES)
                store.close()
            rows.append(row)
        report[kind] = rows
        numbers = {key: [r["numbers"].get(key, float("nan")) for r in rows]
                   for key in ("hidden", "attention", "context", "context_share", "chance", "target_fraction", "denoised")}
        summary = {key: (min(v), statistics.median(v), max(v)) for key, v in numbers.items()}
        correct = {k: sum(r["correct_at"].get(k, False) for r in rows) / len(rows) for k in resume_steps}
        print(f"\n{kind}")
        for key, (low, mid, high) in summary.items():
            print(f"  {key:16} min {low:.4f}  median {mid:.4f}  max {high:.4f}")
        print("  correct after forced reuse at k: " + ", ".join(f"{k}: {v:.0%}" for k, v in correct.items()))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
