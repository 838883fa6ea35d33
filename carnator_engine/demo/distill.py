"""Distil the demo TinyVideoDiT into a few-step, guidance-free student (the evaluation world's "4-step LoRA").

    python3 -m carnator_engine.demo.distill --out tiny_dit_4step.safetensors --minutes 5.5
    python3 -m carnator_engine.demo.distill --out /tmp/s.safetensors --smoke      # a CPU check

Targets (--target). The teacher is the shipped demo model sampled as it samples best (Euler,
flow_sigmas(20, shift 3), guidance 2, uncond prompt ""); the student, initialised from the teacher (or --init),
samples at guidance 1 (the guidance is distilled into the weights, as a cfg-1 distilled LoRA does).
- reflow (one stage): every batch draws world prompts (held-out triples excluded, as in train.py) and noise and runs
  the teacher's whole guided trajectory to its end x0_T(noise); the student learns the straight path between them,
  x_sigma = (1 - sigma) x0_T + sigma noise, v* = noise - x0_T, half the sigmas its own (flow_sigmas(4, shift 3)
  without the final 0), half logit-normal. Each teacher batch serves `--reuse` optimiser steps at fresh sigmas.
  Its weakness: between sigma 1 and 0 the student sees points on straight lines, not the states its own Euler
  steps reach, and the lines of different noises cross, so the target there is an average (shape suffers).
- onpolicy-x0 and onpolicy-segment (stage 2, after `--reflow-minutes` of reflow as stage 1): the student rolls
  out its own Euler steps (a step count drawn from --rollout-steps per batch) and at each state x it reaches
  (sigma s) the teacher, run from x at its own resolution (teacher_substeps), gives the target: its final clip
  from x (x0: v* = (x - x0_T(x)) / s, so the x0-hat after every student step, the first included, is the
  teacher's clip) or its state at the student's next sigma s' (segment: v* = (x - x_T(s')) / (s - s')). One
  optimiser step per student step; the student then takes its own (pre-update) step. The student learns where
  it actually goes, the way DAgger corrects a policy's drift.
AdamW with warm-up and cosine decay over the time budget, an EMA of the weights, bf16 autocast on CUDA.
`distill_sweep` trains several recipes at once on one GPU and compares them.

At the end the EMA weights, cast to fp16 as shipped, are written to --out (fp16 safetensors that load_tiny_dit
reads), then sample held-out random prompts at 4, 6 and 8 Euler steps and guidance 1; the teacher at 20 steps
guidance 2 is scored on the same requests; the recipe and scores go to --json.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from ..backbones.tiny_dit import load_tiny_dit
from ..schedule import flow_sigmas
from . import DEMO_GUIDANCE, DEMO_STEPS, DEMO_WEIGHTS, world
from .train import (combination_index, eval_requests, evaluate, learning_rate, optimise, prompt_tokens,
                    report_requests, shipped_copy, training_device)

SHIFT = 3.0


def _log(message: str) -> None:
    print(message, flush=True)


TARGETS = {
    "reflow": "reflow: the straight path from each noise to the end of the teacher's trajectory from it, "
              "x_sigma = (1 - sigma) x0_T + sigma noise, target v = noise - x0_T, guidance 1",
    "onpolicy-x0": "on-policy x0: the student's own Euler rollouts; at each of its states x (sigma s) the teacher's "
                   "guided trajectory from x to 0 gives x0_T(x), target v = (x - x0_T(x)) / s, so the student's "
                   "x0-hat at every step is the teacher's final clip from where the student is",
    "onpolicy-segment": "on-policy segment: the student's own Euler rollouts; at each of its states x (sigma s) the "
                        "teacher's guided steps from s to the student's next sigma s' give x_T(s'), target "
                        "v = (x - x_T(s')) / (s - s'), so each student step lands where the teacher would",
}


def _sha_named(path: str) -> dict:
    with open(path, "rb") as handle:
        return {"weights": os.path.basename(path), "sha256": hashlib.sha256(handle.read()).hexdigest()}


def _cat_text(first: tuple, second: tuple) -> tuple:
    return tuple(torch.cat([a, b]) for a, b in zip(first, second))


@torch.no_grad()
def teacher_path(teacher, x: torch.Tensor, sigmas, text: tuple, empty_text: tuple, guidance: float) -> torch.Tensor:
    """Where the teacher's guided Euler steps along `sigmas` (descending, sigmas[0] = x's level) take `x`."""
    both = _cat_text(text, empty_text)
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        model_in = torch.cat([x, x])
        v = teacher(model_in, torch.full((model_in.shape[0],), float(sigma), device=x.device), both).float()
        cond, uncond = v.chunk(2)
        x = x + (float(sigma_next) - float(sigma)) * (uncond + guidance * (cond - uncond))
    return x


def teacher_clips(teacher, noise: torch.Tensor, text: tuple, empty_text: tuple, steps: int,
                  guidance: float) -> torch.Tensor:
    """The end of the teacher's guided Euler trajectory from `noise` (sigma 1)."""
    return teacher_path(teacher, noise, flow_sigmas(steps, SHIFT).tolist(), text, empty_text, guidance)


def teacher_substeps(sigma_from: float, sigma_to: float, teacher_steps: int) -> list:
    """The teacher's sigmas from sigma_from down to sigma_to at its own resolution: evenly spaced in the
    unshifted time, as many steps as its `teacher_steps`-step schedule spends on that span (at least one).
    For a 4-step student and a 20-step teacher these are exactly the teacher's own sigmas."""
    def unshift(sigma):
        return sigma / (SHIFT - (SHIFT - 1.0) * sigma)
    t_from, t_to = unshift(sigma_from), unshift(sigma_to)
    count = max(1, math.ceil(teacher_steps * (t_from - t_to) - 1e-6))
    t = torch.linspace(t_from, t_to, count + 1, dtype=torch.float64)
    sigmas = (SHIFT * t / (1.0 + (SHIFT - 1.0) * t)).tolist()
    sigmas[0], sigmas[-1] = sigma_from, sigma_to
    return sigmas


def on_policy_target(teacher, x: torch.Tensor, sigma: float, sigma_next: float, target: str, text: tuple,
                     empty_text: tuple, teacher_steps: int, guidance: float) -> torch.Tensor:
    """The velocity a student step from x (at sigma) to sigma_next should take: towards the teacher's final
    clip from x ("onpolicy-x0"), or to the teacher's own state at sigma_next from x ("onpolicy-segment")."""
    end = 0.0 if target == "onpolicy-x0" else sigma_next
    goal = teacher_path(teacher, x, teacher_substeps(sigma, end, teacher_steps), text, empty_text, guidance)
    return (x - goal) / (sigma - end)


def training_sigmas(batch: int, student_steps: int, generator: torch.Generator, device) -> torch.Tensor:
    """Half the student's own sigmas (its final 0 excluded), half logit-normal."""
    own = flow_sigmas(student_steps, SHIFT)[:-1].to(device)
    pick = own[torch.randint(0, student_steps, (batch,), generator=generator, device=device)]
    spread = torch.sigmoid(torch.randn(batch, generator=generator, device=device))
    return torch.where(torch.rand(batch, generator=generator, device=device) < 0.5, pick, spread)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="student weights (.safetensors, fp16 EMA)")
    parser.add_argument("--json", help="recipe and accuracy report (default: --out with .json)")
    parser.add_argument("--teacher", default=DEMO_WEIGHTS)
    parser.add_argument("--teacher-steps", type=int, default=DEMO_STEPS)
    parser.add_argument("--teacher-guidance", type=float, default=DEMO_GUIDANCE)
    parser.add_argument("--student-steps", type=int, default=4)
    parser.add_argument("--target", choices=TARGETS, default="reflow",
                        help="what the student learns (the module's docstring describes each)")
    parser.add_argument("--reflow-minutes", type=float, default=0.0,
                        help="with an on-policy target: train on reflow for this long first (stage 1)")
    parser.add_argument("--rollout-steps", default="4",
                        help="on-policy targets: step counts the student's rollouts use, one drawn per batch "
                             "(repeat one to weight it: 4,4,6,8)")
    parser.add_argument("--init", help="start from these weights (default: the teacher)")
    parser.add_argument("--minutes", type=float, default=5.5, help="training wall-clock budget")
    parser.add_argument("--smoke", action="store_true", help="a few CPU-sized steps, to check the script")
    parser.add_argument("--batch", type=int, default=256, help="teacher trajectories per batch")
    parser.add_argument("--reuse", type=int, default=4, help="optimiser steps per teacher batch")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--ema", type=float, default=0.998)
    parser.add_argument("--eval-steps", default="4,6,8", help="student step counts scored in the report")
    parser.add_argument("--teacher-eval", default="20:2,4:1",
                        help="teacher settings scored on the same requests, STEPS:GUIDANCE comma-separated ('' none): "
                             "how it samples best, and at the student's schedule without distillation")
    parser.add_argument("--eval-prompts", type=int, default=512)
    parser.add_argument("--eval-heldout", type=int, default=256)
    parser.add_argument("--eval-every", type=float, default=60.0, help="seconds between progress evals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    bad_counts = [n for n in args.rollout_steps.split(",") if not n.strip().isdigit() or int(n) < 1]
    if bad_counts:
        parser.error(f"--rollout-steps {args.rollout_steps!r}: {bad_counts[0]!r} is not a step count; give whole "
                     "numbers >= 1, comma-separated (4,4,6,8)")
    if args.smoke:
        args.batch, args.warmup, args.minutes, args.reuse = min(args.batch, 2), 2, 0.0, 1
        args.eval_prompts, args.eval_heldout, args.eval_every = 4, 2, 1e9
        args.teacher_steps, args.teacher_eval = 2, "2:2" if args.teacher_eval else ""   # a 2-step teacher
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.json or os.path.splitext(args.out)[0] + ".json"
    device, cuda = training_device(args.device, args.seed)

    teacher = load_tiny_dit(args.teacher, str(device)).eval().requires_grad_(False)
    with open(args.teacher, "rb") as handle:
        teacher_sha = hashlib.sha256(handle.read()).hexdigest()
    start_from = load_tiny_dit(args.init, str(device)) if args.init else teacher
    if start_from.config != teacher.config:
        raise ValueError(f"--init {args.init}: its config differs from the teacher's; give a student of {args.teacher}")
    student = copy.deepcopy(start_from).float().train().requires_grad_(True)
    ema = copy.deepcopy(student).eval().requires_grad_(False)
    rollout_steps = [int(n) for n in args.rollout_steps.split(",")]
    config = teacher.config
    parameters = sum(p.numel() for p in student.parameters())
    _log(f"device {device} ({torch.cuda.get_device_name(device) if cuda else 'cpu'}), torch {torch.__version__}, "
         f"{parameters / 1e6:.2f}M parameters; teacher {args.teacher_steps} steps guidance {args.teacher_guidance:g}"
         f" -> student {args.student_steps} steps guidance 1")
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0, fused=cuda)
    tokens = prompt_tokens(config.vocabulary, config.text_len, device)
    empty_row = tokens.shape[0] - 1
    generator = torch.Generator(device=device).manual_seed(args.seed)

    def trajectory_batch():
        codes = world.sample_codes(args.batch, generator, device, heldout="exclude")
        rows = combination_index(codes)
        noise = torch.randn((args.batch,) + world.CLIP_SHAPE, generator=generator, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            text = teacher.text(tokens[rows])
            empty = teacher.text(tokens[torch.full_like(rows, empty_row)])
            clips = teacher_clips(teacher, noise, text, empty, args.teacher_steps, args.teacher_guidance)
        return noise, clips.float(), rows

    def fit(step: int, lr: float, inputs, sigma, rows, targets) -> tuple:
        """One optimiser step towards `targets`; returns (loss, the student's velocity before the step)."""
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            v = student(inputs, sigma, student.text(tokens[rows]))
        return optimise(student, ema, optimizer, F.mse_loss(v.float(), targets), step, args.ema), v.detach().float()

    def reflow_step(step: int, lr: float, batch: tuple) -> torch.Tensor:
        noise, clips, rows = batch
        sigma = training_sigmas(args.batch, args.student_steps, generator, device)
        s = sigma[:, None, None, None, None]
        return fit(step, lr, (1 - s) * clips + s * noise, sigma, rows, noise - clips)[0]

    def on_policy_steps(step: int, lr_at) -> tuple:
        """One batch of the student's own rollouts, one optimiser step per rollout step; (steps taken, loss)."""
        codes = world.sample_codes(args.batch, generator, device, heldout="exclude")
        rows = combination_index(codes)
        x = torch.randn((args.batch,) + world.CLIP_SHAPE, generator=generator, device=device)
        n = rollout_steps[int(torch.randint(len(rollout_steps), (1,), generator=generator, device=device))]
        sigmas = flow_sigmas(n, SHIFT).tolist()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda), torch.no_grad():
            text = teacher.text(tokens[rows])
            empty = teacher.text(tokens[torch.full_like(rows, empty_row)])
        loss = torch.zeros(())
        for index, (sigma, sigma_next) in enumerate(zip(sigmas[:-1], sigmas[1:])):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                targets = on_policy_target(teacher, x, sigma, sigma_next, args.target, text, empty,
                                           args.teacher_steps, args.teacher_guidance)
            loss, v = fit(step + index, lr_at(step + index), x, torch.full((args.batch,), sigma, device=device),
                          rows, targets)
            x = x + (sigma_next - sigma) * v
        return n, loss

    budget = args.minutes * 60.0
    start = time.time()
    step, trajectories, progress = 0, 0, []
    last_log = last_eval = start
    quick = eval_requests(128 if not args.smoke else 2, args.seed + 7, "exclude")
    loss = torch.zeros(())
    reflow_seconds = args.reflow_minutes * 60.0 if args.target != "reflow" else budget
    reflow_steps = rollouts = 0
    lr = args.lr

    def lr_at(at_step: int) -> float:
        fraction = min(1.0, (time.time() - start) / budget) if budget > 0 else 1.0
        return learning_rate(args.lr, at_step, args.warmup, fraction)

    batches = 0
    while True:
        elapsed = time.time() - start
        if (args.smoke and batches >= 2) or (not args.smoke and elapsed >= budget):
            break
        # A smoke run takes one batch of each stage the recipe has.
        in_reflow = (batches == 0 and reflow_seconds > 0) if args.smoke else elapsed < reflow_seconds
        batches += 1
        if in_reflow or args.target == "reflow":
            batch = trajectory_batch()
            trajectories += args.batch
            for _ in range(args.reuse):
                lr = lr_at(step)
                loss = reflow_step(step, lr, batch)
                step += 1
            reflow_steps = step
        else:
            taken, loss = on_policy_steps(step, lr_at)
            lr = lr_at(step)
            step += taken
            rollouts += args.batch
        now = time.time()
        if now - last_log >= 15 or args.smoke:
            value = float(loss)
            if not math.isfinite(value):
                raise RuntimeError(f"loss became {value} at step {step}")
            _log(f"step {step:6d}  {now - start:6.1f}s  loss {value:.5f}  lr {lr:.2e}  {trajectories} trajectories")
            last_log = now
        if now - last_eval >= args.eval_every:
            scores = evaluate(shipped_copy(ema), *quick, guidance=1.0, steps=args.student_steps)
            progress.append({"step": step, "seconds": round(now - start, 1), "student": scores})
            _log(f"  eval @ {step}: {args.student_steps} steps g=1 {scores}")
            last_eval = time.time()
    train_seconds = time.time() - start
    _log(f"trained {step} steps ({reflow_steps} reflow) on {trajectories} teacher trajectories and {rollouts} "
         f"student rollouts in {train_seconds:.0f}s")

    shipped = shipped_copy(ema)
    shipped.half().save(args.out)   # before the evaluation: a run stopped during it keeps its student
    shipped.float()
    random_set, heldout_set = report_requests(args.seed, args.eval_prompts, args.eval_heldout)
    reference = {}
    for setting in filter(None, args.teacher_eval.split(",")):
        steps, guidance = int(setting.split(":")[0]), float(setting.split(":")[1])
        reference[f"{steps} steps, guidance {guidance:g}"] = {
            "random": evaluate(teacher.float(), *random_set, guidance=guidance, steps=steps),
            "heldout": evaluate(teacher.float(), *heldout_set, guidance=guidance, steps=steps)}
        _log(f"teacher {steps} steps g={guidance:g}: random {reference[f'{steps} steps, guidance {guidance:g}']['random']}")
    by_steps = {}
    for steps in [int(s) for s in args.eval_steps.split(",")]:
        by_steps[str(steps)] = {"random": evaluate(shipped, *random_set, guidance=1.0, steps=steps),
                                "heldout": evaluate(shipped, *heldout_set, guidance=1.0, steps=steps)}
        _log(f"student {steps} steps g=1: random {by_steps[str(steps)]['random']}\n"
             f"                  held-out {by_steps[str(steps)]['heldout']}")
    report = {
        "model": {"path": os.path.basename(args.out), "parameters": parameters, "dtype": "float16 (EMA)",
                  "bytes": os.path.getsize(args.out), "steps": args.student_steps, "guidance": 1.0,
                  "sampler": "euler", "sigmas": f"flow_sigmas({args.student_steps}, shift={SHIFT:g})"},
        "recipe": {"method": TARGETS[args.target], "target": args.target,
                   "reflow_stage_steps": reflow_steps,
                   "reflow_sigmas": f"half flow_sigmas({args.student_steps}, shift={SHIFT:g})[:-1], half logit-normal",
                   "rollout_steps": rollout_steps if args.target != "reflow" else None,
                   "teacher": os.path.basename(args.teacher), "teacher_sha256": teacher_sha,
                   "teacher_steps": args.teacher_steps, "teacher_guidance": args.teacher_guidance,
                   "initialised_from": _sha_named(args.init) if args.init else "teacher", "text_dropout": 0.0,
                   "heldout_triples": [list(t) for t in world.HELDOUT_TRIPLES]},
        "training": {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                     "seconds": round(train_seconds, 1), "steps": step, "teacher_trajectories": trajectories,
                     "student_rollouts": rollouts,
                     "batch": args.batch, "reuse": args.reuse, "lr": args.lr, "warmup": args.warmup, "ema": args.ema,
                     "seed": args.seed, "final_loss": round(float(loss), 5), "progress": progress},
        "evaluation": {"random_prompts": args.eval_prompts, "heldout_prompts": args.eval_heldout,
                       "teacher": reference, "student_by_steps": by_steps},
        "accuracy": by_steps.get(str(args.student_steps), {}).get("random"),
        "command": " ".join(["python3", "-m", "carnator_engine.demo.distill"] + list(argv if argv is not None else sys.argv[1:])),
    }
    with open(json_path, "w") as handle:
        json.dump(report, handle, indent=2)
    _log(f"wrote {args.out} ({os.path.getsize(args.out) / 1e6:.2f} MB) and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
