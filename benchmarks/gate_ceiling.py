"""The ceiling of any Compatibility Gate in the evaluation world: how many model calls a gate that knew the
truth could save without making a single request wrong.

Each request of the iteration stream is probed and looked up as Carnator does; then every candidate is
resumed at every resume step the entry holds (target cells from the preset's cell threshold, the target-share
and risk limits ignored) and the result read back from pixels. A resume is *safe* if it gets right every
attribute the same request without reuse got right. The oracle takes, per request, the furthest safe resume
over all candidates (a miss if none): an upper bound for every gate built on these entries, since a real gate
must choose before it sees the result. The store holds each request's full generation (the best entry a
session could leave behind).

    python benchmarks/gate_ceiling.py --stream 60 --out benchmarks/results/quality/gate_ceiling.json
"""
from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from carnator_engine.backbones.tiny_dit import load_tiny_dit  # noqa: E402
from carnator_engine.demo import DEMO_GUIDANCE, DEMO_STEPS, DEMO_WEIGHTS, world  # noqa: E402
from carnator_engine.euler import TinyDiTRunner  # noqa: E402
from carnator_engine.gate import Decision, RISK_LEVELS, RISK_POLICIES, measure  # noqa: E402
from carnator_engine.localize import latent_mask  # noqa: E402
from carnator_engine.observer import GenerationObserver  # noqa: E402
from carnator_engine.pipeline import CarnatorConfig, follow_entry, lookup, probe, resume  # noqa: E402
from carnator_engine.schedule import denoised_from_velocity, flow_sigmas  # noqa: E402
from carnator_engine.store import CarnatorStore  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reports  # noqa: E402  (the summary JSON, the per-request rows gzipped beside it)


# what a gate sees (its inputs) and one thing it could see after the hit's first model call
SIGNALS = ("hidden", "attention", "denoised", "context", "target_fraction", "resume_residual")


class FirstStepObserver(GenerationObserver):
    """Keeps the denoised estimate of the first model call a hit makes (on the resumed latent)."""

    first_denoised = None

    def step_end(self, step, x_next, denoised):
        super().step_end(step, x_next, denoised)
        if self.first_denoised is None:
            self.first_denoised = denoised


def resume_residual(observer, payload, sigmas, step: int, target: torch.Tensor):
    """RMS difference, outside the target region, between the hit's first denoised estimate and the entry's own
    at the same step (from its checkpoints at step and step + 1): does the model, under the new prompt, want to
    change the context it was handed? None where the entry lacks the next checkpoint."""
    if step + 1 not in payload.checkpoints or bool(target.all()):
        return None
    here, after = (payload.checkpoints[s].float() for s in (step, step + 1))
    velocity = (after - here) / (float(sigmas[step + 1]) - float(sigmas[step]))
    entry = denoised_from_velocity(here, float(sigmas[step]), velocity)
    difference = (observer.first_denoised.cpu() - entry).pow(2).mean(1)[0]
    return difference[~target].mean().sqrt().item()


def trials(runner, probed, candidates, store, config):
    """Every (candidate, resume step) a hit could take: yields (entry index, step, gate numbers, clip)."""
    policy = config.policy()
    for rank, candidate in enumerate(candidates):
        cells, numbers = measure(candidate, policy)
        target = latent_mask(cells, probed.latent.shape[-3:])
        payload = store.trajectory(candidate.record)
        for step in candidate.record.checkpoint_steps:
            if step <= probed.probe_steps + 1:
                continue
            decision = Decision(True, config.risk, probed.steps, probed.probe_steps, step,
                                candidate.record.entry_id, cells)
            observer = FirstStepObserver()
            latent = follow_entry(runner, probed, decision, payload, config, observer)
            signals = {**numbers, "resume_residual": resume_residual(observer, payload, probed.sigmas, step, target)}
            yield rank, step, signals, latent[0].clamp(-1, 1).cpu()


def auc(values: list, wrong: list):
    """Chance that a resume that made the request wrong scores higher than one that did not (0.5: no signal)."""
    bad = [v for v, w in zip(values, wrong) if w and v is not None]
    good = [v for v, w in zip(values, wrong) if not w and v is not None]
    if not bad or not good:
        return None
    return sum((b > g) + 0.5 * (b == g) for b in bad for g in good) / (len(bad) * len(good))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default=DEMO_WEIGHTS)
    parser.add_argument("--stream", type=int, default=60)
    parser.add_argument("--restart-every", type=int, default=10)
    parser.add_argument("--fixed-seed", action="store_true", help="one seed per session instead of one per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=DEMO_STEPS)
    parser.add_argument("--probe-steps", type=int, default=3)
    parser.add_argument("--risk", default="balanced", choices=RISK_LEVELS, help="whose cell threshold marks targets")
    parser.add_argument("--candidates", type=int, default=3, help="nearest entries tried per request")
    parser.add_argument("--out", default="benchmarks/out/gate_ceiling.json")
    args = parser.parse_args(argv)

    model = load_tiny_dit(args.weights, "cpu")
    sigmas = flow_sigmas(args.steps)
    config = CarnatorConfig(probe_steps=args.probe_steps, risk=args.risk, lookup_limit=args.candidates)
    stream = world.iteration_stream(args.stream, seed=args.seed, restart_every=args.restart_every,
                                    one_seed_per_session=args.fixed_seed)
    rows, store = [], None
    scratch = tempfile.mkdtemp(prefix="carnator-ceiling-")      # each session's store, removed at the end
    started = time.perf_counter()
    for index, request in enumerate(stream):
        if index % args.restart_every == 0:
            if store is not None:
                store.close()
            store = CarnatorStore(os.path.join(scratch, f"session-{index // args.restart_every}"), 1 << 30)
        runner = TinyDiTRunner(model, request.prompt, guidance_scale=DEMO_GUIDANCE)
        probed = probe(runner, world.initial_noise([request.seed]), sigmas, config)
        candidates = lookup(store, probed, config)
        attempts = list(trials(runner, probed, candidates, store, config))
        miss = Decision(False, args.risk, probed.steps, probed.probe_steps, probed.probe_steps)
        reference = resume(runner, probed, miss, store, config, request.prompt, request.seed).latent[0].clamp(-1, 1)
        reference_read = world.analyze(reference.cpu())
        row = {"prompt": request.prompt, "edited": request.edited, "reference_read": reference_read,
               "expected": request.attributes, "reference_right": world.all_right(reference_read, request.attributes),
               "trials": []}
        for rank, step, signals, clip in attempts:
            read = world.analyze(clip)
            row["trials"].append({"candidate": rank, "resume_step": step, "signals": signals, "read": read,
                                  "right": world.all_right(read, request.attributes),
                                  "made_wrong": world.made_wrong(read, reference_read, request.attributes)})
        safe = [t["resume_step"] for t in row["trials"] if not t["made_wrong"]]
        row["oracle_resume_step"] = max(safe, default=args.probe_steps)
        rows.append(row)
        print(f"{index + 1}/{len(stream)} {request.edited or 'cold':10} oracle k={row['oracle_resume_step']:2d} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    store.close()
    shutil.rmtree(scratch, ignore_errors=True)

    saved = lambda step: (step - args.probe_steps) / args.steps  # noqa: E731
    per_edit = collections.defaultdict(list)
    for row in rows:
        per_edit[row["edited"] or "cold start"].append(saved(row["oracle_resume_step"]))
    reference_accuracy = sum(r["reference_right"] for r in rows) / len(rows)
    fixed_step = {}
    for step in sorted({t["resume_step"] for row in rows for t in row["trials"]}):
        # every warm request resumed at `step` from its nearest entry: a gate that never refuses
        pairs = [(row, t) for row in rows for t in row["trials"] if t["resume_step"] == step and t["candidate"] == 0]
        hit_rows = {id(row) for row, _ in pairs}
        correct = sum(t["right"] for _, t in pairs) + sum(r["reference_right"] for r in rows if id(r) not in hit_rows)
        wrong = [bool(t["made_wrong"]) for _, t in pairs]
        fixed_step[step] = {
            "hits": len(pairs), "calls_saved": len(pairs) * saved(step) / len(rows),
            "attribute_accuracy": correct / len(rows),
            "made_wrong": sum(t["right"] < row["reference_right"] for row, t in pairs),
            "made_right": sum(t["right"] > row["reference_right"] for row, t in pairs),
            "signal_auc": {name: auc([t["signals"][name] for _, t in pairs], wrong) for name in SIGNALS}}
    summary = {"oracle_calls_saved": sum(saved(r["oracle_resume_step"]) for r in rows) / len(rows),
               "oracle_hit_rate": sum(r["oracle_resume_step"] > args.probe_steps for r in rows) / len(rows),
               "oracle_calls_saved_by_edit": {k: {"requests": len(v), "calls_saved": sum(v) / len(v)}
                                              for k, v in sorted(per_edit.items())},
               "reference_accuracy": reference_accuracy, "nearest_entry_at_fixed_step": fixed_step}
    machine = f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}"
    reports.write(args.out, {"machine": machine, "args": vars(args), "summary": summary, "rows": rows})

    seeds = "one seed per session" if args.fixed_seed else "a fresh seed per request"
    print(f"\nGate ceiling ({len(rows)} requests, {args.steps} steps, probe {args.probe_steps}, {seeds}; {machine})")
    print(f"oracle: {summary['oracle_hit_rate']:.0%} hits, {summary['oracle_calls_saved']:.1%} of model calls saved, "
          "no request made wrong")
    print(f"{'edit':12} {'requests':>8} {'saved':>7}")
    for edit, numbers in summary["oracle_calls_saved_by_edit"].items():
        print(f"{edit:12} {numbers['requests']:>8d} {numbers['calls_saved']:>7.1%}")
    print(f"\nEvery warm request resumed from its nearest entry at one step (no reuse: "
          f"{reference_accuracy:.1%} accuracy); AUC: how well each signal ranks the resumes that made a request wrong")
    print(f"{'step':>4} {'hits':>5} {'saved':>6} {'accuracy':>8} {'wrong/right':>11} " + " ".join(f"{n[:9]:>9}" for n in SIGNALS))
    for step, numbers in fixed_step.items():
        aucs = " ".join(f"{numbers['signal_auc'][n]:>9.2f}" if numbers["signal_auc"][n] is not None else f"{'-':>9}"
                        for n in SIGNALS)
        print(f"{step:>4d} {numbers['hits']:>5d} {numbers['calls_saved']:>6.1%} {numbers['attribute_accuracy']:>8.1%} "
              f"{numbers['made_wrong']:>5d} / {numbers['made_right']:<3d} {aucs}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
