#!/usr/bin/env python3
"""Do the default gate's limits carry across backbones? Nudged, new-seed and new-conditioning requests at real size.

Per backbone (ComfyUI 0.3.64's own model classes with random weights in bf16, built as benchmarks/gpu_backbones.py
builds them, plus Wan2.1-1.3B as benchmarks/gpu_host.py builds it), one Carnator miss is stored, then the gate
(default risk, no overrides) answers, after its probe and lookup:
  nudged noise      the miss's request with its noise x 1.0001: the same generation, to reuse at the usual k
  nudged text       the miss's conditioning plus 0.1 % of its RMS in random noise: a hair off, to reuse
  new seed (x3)     the same conditioning from other noise: with random weights nothing is shared, to refuse
  new text (x2)     other random conditioning, the same noise: to refuse
Printed per request: the decision, the resume step, and the gate's inputs (pooled block states, attention
structure, the x0-hat difference outside the target region in noise units, the difference two unrelated estimates
show (`chance`) and the share of it). Euler / simple / cfg 1, N = 20, probe 2, as gpu_backbones.py.

  python3 benchmarks/gate_transfer.py --out $OUT/gate_transfer.json          # one H200, about 3 minutes
  python3 benchmarks/gate_transfer.py --smoke --out /tmp/gate_transfer.json  # tiny, CPU
"""
from __future__ import annotations

import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import gpu_backbones as gb  # noqa: E402
import gpu_host as gs  # noqa: E402
import reports  # noqa: E402

WAN_1_3B = dict(kind="wan", experts=1, **{key: gs.PRESETS["real"][key] for key in ("dim", "layers", "ffn", "latent",
                                                                                    "text_len")})
BACKBONES = {"wan2.1-1.3b": WAN_1_3B, **gb.BACKBONES}
SMOKE = {"wan2.1-1.3b": dict(gb.SMOKE["wan2.2-a14b"], experts=1), **gb.SMOKE}
EXPECTED = {"nudged noise": True, "nudged text": True, "new seed": False, "new text": False}


def parse_args(argv=None):
    return gb.common_parser(__doc__.split("\n\n")[0], BACKBONES).parse_args(argv)


def nudged(conditioning, seed):
    states, options = conditioning[0]
    generator = torch.Generator().manual_seed(seed)
    return [[states + 1e-3 * states.pow(2).mean().sqrt() * torch.randn(states.shape, generator=generator), options]]


def queries(spec, noise, positive, seed):
    """(label, noise, positive conditioning) of every request the gate answers."""
    def other_noise(offset):
        return torch.randn(spec["latent"], generator=torch.Generator().manual_seed(seed + offset))
    return ([("nudged noise", noise * 1.0001, positive), ("nudged text", noise, nudged(positive, seed + 50))]
            + [("new seed", other_noise(100 + i), positive) for i in range(3)]
            + [("new text", noise, gb.conditioning(spec, seed + 7 + i)) for i in range(2)])


def measure(name, spec, args, device, dtype, log):
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore
    models, params = gb.build(spec, device, dtype, args.seed)
    noise = torch.randn(spec["latent"], generator=torch.Generator().manual_seed(args.seed))
    positive, negative = gb.conditioning(spec, args.seed + 1), gb.conditioning(spec, args.seed + 2)
    switch = args.steps // 2 if len(models) == 2 else None
    experts = {} if switch is None else {"low_noise_model": models[1], "switch_step": switch}
    runner = ComfyRunner(models[0], positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple",
                         steps=args.steps, seed=args.seed, **experts)
    sigmas = runner.sigmas
    config = CarnatorConfig(probe_steps=args.probe, block_size=32 if args.smoke else 128)
    out = {"params": params, "latent": list(spec["latent"]), "requests": []}
    root = tempfile.mkdtemp(prefix="carnator_gate_transfer_")
    try:
        store = CarnatorStore(os.path.join(root, name), size_limit_bytes=64 << 30)
        started = time.perf_counter()
        miss = generate(runner, noise, sigmas, store, config, gs.PROMPT, args.seed)
        if miss.decision.reuse or miss.entry_id is None:
            raise RuntimeError(f"expected a stored miss, got {miss.summary()}")
        log(f"{name}: {params / 1e9:.2f} B parameters, miss stored in {time.perf_counter() - started:.1f} s")
        for index, (label, request_noise, request_positive) in enumerate(queries(spec, noise, positive, args.seed)):
            request = runner.with_step_callback(None)
            request.positive = request_positive
            request.request_fingerprint = f"{label} {index}"        # never answered as an exact repeat
            answer = gb.refused(request, store, config, request_noise, sigmas)
            answer.update(request=label, expected_reuse=EXPECTED[label])
            out["requests"].append(answer)
            numbers = answer["numbers"]
            log(f"{name}: {label:12} reuse={answer['reuse']!s:5} k={answer['resume_step']:2} "
                f"context {numbers.get('context', float('nan')):.4f} chance {numbers.get('chance', float('nan')):.4f} "
                f"share {numbers.get('context_share', float('nan')):.3f} hidden {numbers.get('hidden', 0):.4f}")
    finally:
        del models, runner
        gb.release(root)
    return out


def print_table(out):
    print(f"\nDefault gate across backbones: {out['device']}, torch {out['torch']}, ComfyUI {out['comfyui_version']}, "
          f"N={out['steps']} p={out['probe']}, no overrides")
    print("| backbone | request | expected | decision | k | hidden | attention | context | chance | share of chance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in out["results"].items():
        if "error" in result:
            print(f"| {name} | error: {result['error'].strip().splitlines()[-1][:80]} |")
            continue
        for answer in result["requests"]:
            n = answer["numbers"]
            print(f"| {name} | {answer['request']} | {'reuse' if answer['expected_reuse'] else 'refuse'} | "
                  f"{'HIT' if answer['reuse'] else 'refused'} | {answer['resume_step'] if answer['reuse'] else ''} | "
                  + " | ".join(f"{n.get(key, float('nan')):.4f}" for key in ("hidden", "attention", "context", "chance"))
                  + f" | {n.get('context_share', float('nan')):.3f} |")
    print(f"\nas expected: {out['as_expected']} of {out['answered']} requests")


def run(args):
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    version = gs.import_comfy(gs.find_comfyui(args.comfyui), cpu=not cuda)
    started = time.perf_counter()
    specs = SMOKE if args.smoke else gb.with_video(BACKBONES, args.video, args.only.split(","))
    out = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "comfyui_version": version, "dtype": str(dtype), "steps": args.steps,
           "probe": args.probe, "gate_overrides": {}, "smoke": args.smoke, "results": {}}
    gb.measure_each(args, specs, measure, device, dtype, gs.elapsed_logger(started), out)
    answers = [a for r in out["results"].values() for a in r.get("requests", [])]
    out.update(answered=len(answers), as_expected=sum(a["reuse"] == a["expected_reuse"] for a in answers),
               total_seconds=time.perf_counter() - started)
    reports.write(args.out, out)
    print_table(out)
    return out


if __name__ == "__main__":
    run(parse_args())
