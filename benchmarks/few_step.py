#!/usr/bin/env python3
"""Carnator at few-step schedules (4, 6, 8 steps, cfg 1: step-distilled LoRAs), at real size, random weights.

Per step count N, side by side in one process, through the adapter the nodes use (ComfyRunner, euler / simple,
cfg 1, one model call a step) and the pipeline at such schedules (probe 1 step, the gate's own resume step, no gate
overrides, risk aggressive: the default does not reuse at 8 steps or fewer, so the hits are aggressive's):
  plain    plain ComfyUI sampling of all N steps, dense attention (Wan 2.2 A14B: the template's two samplers,
           the low-noise expert from step N/2: 2+2, 3+3, 4+4)
  miss     the same request through Carnator on an empty store (probe + the rest + write-back)
  hit      the miss's request a hair off (noise x 1.0001) through probe -> lookup -> gate -> resume, with the
           block-sparse attention the miss recorded (density budget --max-density), and again dense
  region   the hit resumed region-only with its target forced to --region-shares of the tokens (at these step counts
           the resume stage usually finds too few steps left for it to pay, and resumes whole-clip: the case says why)
  repeat   the identical request: its stored result, no model call
Medians of --repeats runs (plain, miss, sparse hit), none with a step callback (plain sampling has none). Warm-ups
(dense steps, the FlexAttention compile, one untimed miss per step count) come first.

  python3 benchmarks/few_step.py --backbone wan2.1-1.3b --out $OUT/few_step_wan21.json    # 480p x 81, one H200
  python3 benchmarks/few_step.py --backbone wan2.2-a14b --out $OUT/few_step_a14b.json     # 480p x 49, two experts
  python3 benchmarks/few_step.py --smoke --out /tmp/few_step.json                          # tiny, CPU
"""
from __future__ import annotations

import math
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE] if HERE not in sys.path else []

import torch  # noqa: E402

import gpu_backbones as gb  # noqa: E402
import gpu_host as gs  # noqa: E402
import reports  # noqa: E402

SPECS = {
    "wan2.1-1.3b": dict(kind="wan", experts=1, dim=1536, layers=30, ffn=8960, latent=(1, 16, 21, 60, 104),
                        text_len=512),
    "wan2.2-a14b": dict(gb.BACKBONES["wan2.2-a14b"], experts=2),
}
SMOKE = {
    "wan2.1-1.3b": dict(kind="wan", experts=1, dim=256, layers=2, ffn=512, latent=(1, 16, 4, 16, 16), text_len=16),
    "wan2.2-a14b": dict(gb.SMOKE["wan2.2-a14b"], experts=2),
}


def parse_args(argv=None):
    parser = gs.host_arguments(__doc__)
    parser.add_argument("--backbone", choices=sorted(SPECS), default="wan2.1-1.3b")
    parser.add_argument("--steps", default="4,6,8", help="step counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-density", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--region-shares", type=gs.shares_list, default=[0.3],
                        help="target shares of the region-only hits (empty: none)")
    return parser.parse_args(argv)


def measure_steps(n, models, spec, args, block_size, root, log):
    from carnator_engine.gate import default_probe_steps
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore
    noise = torch.randn(spec["latent"], generator=torch.Generator().manual_seed(args.seed))
    positive, negative = gb.conditioning(spec, args.seed + 1), gb.conditioning(spec, args.seed + 2)
    switch = n // 2 if len(models) == 2 else None
    experts = {} if switch is None else {"low_noise_model": models[1], "switch_step": switch}
    # No step callback: plain sampling runs without one, and a timer's CUDA synchronisation at every step end would
    # charge the miss and the hits an idle GPU at each step start that plain sampling does not pay.
    runner = ComfyRunner(models[0], positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                         seed=args.seed, **experts)
    sigmas = runner.sigmas
    # risk aggressive: the default (balanced) does not reuse at few-step schedules (carnator_engine/few_step_gate.py);
    # a miss is the same at every risk level, and the hits measure what a hit costs where a level does reuse
    # "hit" is the whole-clip hit; the region-only case turns region_only on
    config = CarnatorConfig(probe_steps=default_probe_steps(n), block_size=block_size, max_density=args.max_density,
                            risk="aggressive", region_only=False)
    out = {"steps": n, "probe_steps": config.probe_steps, "switch_step": switch}

    plain_runs = []
    for _ in range(args.repeats):
        with gs.timed() as span:
            reference = gb.plain(models, switch, noise, sigmas, positive, negative, args.seed)
        plain_runs.append(span["seconds"])
    plain_s = gs.median(plain_runs)
    out["plain"] = {"seconds": plain_s, "runs_s": plain_runs}

    # One untimed miss first, as plain sampling was warmed up: a schedule's first run through the pipeline (its
    # recorders' first allocations at this size) is a process's cost, not a request's.
    warm = generate(runner, noise, sigmas, CarnatorStore(os.path.join(root, f"n{n}_warm"), size_limit_bytes=64 << 30),
                    config, gs.PROMPT, args.seed)
    warm.entry_id
    miss_runs = []
    for i in range(args.repeats):       # each on an empty store; the last one's entry serves the hits
        store = CarnatorStore(os.path.join(root, f"n{n}_miss{i}"), size_limit_bytes=64 << 30)
        with gs.timed() as span:
            miss = generate(runner, noise, sigmas, store, config, gs.PROMPT, args.seed)
        miss_runs.append(span["seconds"])
        if miss.decision.reuse or miss.entry_id is None:
            raise RuntimeError(f"expected a stored miss, got {miss.summary()}")
    miss_s = gs.median(miss_runs)
    out["miss"] = {"seconds": miss_s, "runs_s": miss_runs, "model_calls": miss.model_calls,
                   "extra_pct_vs_plain": 100.0 * (miss_s - plain_s) / plain_s, "parts_s": miss.seconds,
                   "rel_diff_vs_plain": gs.rel_diff(runner.to_latent_format(miss.latent), reference)}
    log(f"N={n}: plain {plain_s:.2f} s, miss {miss_s:.2f} s ({out['miss']['extra_pct_vs_plain']:+.2f} %)")

    for key, hit_config, repeats in (("hit", config, args.repeats),
                                     ("hit_dense", CarnatorConfig(probe_steps=config.probe_steps, block_size=block_size,
                                                                  sparse_attention=False, risk="aggressive",
                                                                  region_only=False), 1)):
        runs = []
        for _ in range(repeats):
            facts, result, _ = gs.carnator_hit(runner, store, hit_config, noise, sigmas, None, args.seed)
            facts["rel_diff_vs_miss"] = gs.rel_diff(result.latent, miss.latent)
            runs.append(facts)
        seconds = gs.median([r["seconds"] for r in runs])
        out[key] = {"seconds": seconds, "speedup_vs_plain": plain_s / seconds, "model_calls": runs[0]["model_calls"],
                    "resume_step": runs[0]["resume_step"], "density": runs[0]["plan_mean_density"], "runs": runs}
        log(f"N={n}: {key} {seconds:.2f} s = {plain_s / seconds:.2f}x plain, k={runs[0]['resume_step']}, "
            f"{runs[0]['model_calls']} calls, density {runs[0]['plan_mean_density']:.3f}")

    out["region"] = gs.region_hits(runner, store, config, noise, sigmas, None, args.seed, args.region_shares, log,
                                   lambda latent: {"rel_diff_vs_miss": gs.rel_diff(latent, miss.latent)})
    for case in out["region"].values():
        case["speedup_vs_plain"] = plain_s / case["seconds"]

    with gs.timed() as span:
        repeat = generate(runner, noise, sigmas, store, config, gs.PROMPT, args.seed)
    out["repeat"] = {"seconds": span["seconds"], "model_calls": repeat.model_calls,
                     "exact_repeat": repeat.decision.exact_repeat}
    log(f"N={n}: exact repeat {span['seconds']:.3f} s, {repeat.model_calls} calls")
    return out


def run(args):
    spec = (SMOKE if args.smoke else SPECS)[args.backbone]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    comfy_path = gs.find_comfyui(args.comfyui)
    started = time.perf_counter()
    version = gs.import_comfy(comfy_path, cpu=device.type != "cuda")
    log = gs.elapsed_logger(started)
    steps = [int(s) for s in args.steps.split(",")]
    block_size = 32 if args.smoke else 128
    out = {"backbone": args.backbone, "preset": "smoke" if args.smoke else "real", "comfyui_version": version,
           "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else platform.processor() or "cpu", "dtype": str(dtype), "sampler": "euler", "scheduler": "simple",
           "cfg": 1.0, "spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec.items()},
           "max_density": args.max_density, "block_size": block_size, "gate_overrides": {}, "results": {}}
    models, params = gb.build(spec, device, dtype, args.seed)
    gs.sync()
    out["params"] = params
    log(f"{args.backbone}: {params / 1e9:.3f} B parameters on {out['device']}")

    noise = torch.randn(spec["latent"], generator=torch.Generator().manual_seed(args.seed))
    positive, negative = gb.conditioning(spec, args.seed + 1), gb.conditioning(spec, args.seed + 2)
    from carnator_engine.attention.connectivity import plan_from_tensors
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    warm = ComfyRunner(models[0], positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=4,
                       seed=args.seed)
    tokens = math.prod(warm.layout.token_grid(noise.shape))
    out["tokens"] = tokens
    with gs.timed() as span:              # cuDNN plans, allocator, weights on the device; the FlexAttention compile
        for model in models:
            gs.plain_sample(model, noise, warm.sigmas[:3], positive, negative, args.seed)
        band, _ = gs.band_connectivity(tokens, block_size, args.max_density)
        tables = {name: band for name in range(warm.backbone.num_blocks)}
        tables["block_size"] = torch.tensor(block_size)
        for model in models:
            runner = ComfyRunner(model, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple",
                                 steps=4, seed=args.seed)
            runner.run(noise * float(runner.sigmas[2]), runner.sigmas, 2, 4,
                       GenerationObserver(sparse=plan_from_tensors(tables, torch.zeros(tokens, dtype=torch.bool))))
    out["warmup_s"] = span["seconds"]
    log(f"warm-up {span['seconds']:.1f} s")

    root = tempfile.mkdtemp(prefix="carnator_few_step_")
    try:
        for n in steps:
            out["results"][str(n)] = measure_steps(n, models, spec, args, block_size, root, log)
            reports.write(args.out, out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["total_seconds"] = time.perf_counter() - started
    reports.write(args.out, out)
    print_table(out)
    return out


def print_table(out):
    print(f"\nCarnator few-step ({out['preset']}): {out['backbone']}, {out['params'] / 1e9:.3f} B params, "
          f"{out['tokens']} tokens, {out['device']}, {out['dtype']}, euler/simple cfg 1, ComfyUI "
          f"{out['comfyui_version']}, max_density {out['max_density']}")
    print("| N | p | k | plain s | miss s (vs plain) | hit s (x plain) | hit calls | dense hit s (x plain) "
          "| repeat s (calls) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, r in out["results"].items():
        print(f"| {n} | {r['probe_steps']} | {r['hit']['resume_step']} | {r['plain']['seconds']:.2f} | "
              f"{r['miss']['seconds']:.2f} ({r['miss']['extra_pct_vs_plain']:+.2f} %) | {r['hit']['seconds']:.2f} "
              f"({r['hit']['speedup_vs_plain']:.2f}x) | {r['hit']['model_calls']} of {n} | "
              f"{r['hit_dense']['seconds']:.2f} ({r['hit_dense']['speedup_vs_plain']:.2f}x) | "
              f"{r['repeat']['seconds']:.3f} ({r['repeat']['model_calls']}) |")
    for n, r in out["results"].items():
        for name, case in r.get("region", {}).items():
            print(f"N={n} {name}: {case['seconds']:.2f} s ({case['speedup_vs_plain']:.2f}x plain), region-only "
                  f"{case['region_only']}: {case['region_reason']}")


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()
