#!/usr/bin/env python3
"""Carnator with ComfyUI's EasyCache, side by side, at Wan2.1-T2V-1.3B size (the gpu_speed.py setup: ComfyUI's
WanModel with random weights, 480p x 81 frames, bf16, euler/simple, N=50, p=5, k=25, the 0.3 density budget).

Cases, each one run, CUDA synchronised, model calls counted at the diffusion model (a DIFFUSION_MODEL wrapper
after EasyCache's, so it counts forwards that ran):
  plain                 ComfyUI sampling, no Carnator (the baseline of every speedup and difference)
  easycache             ComfyUI's EasyCache node alone, at the threshold of --easycache-thresholds whose calls
                        come nearest N/2 (about 2x); every threshold tried is reported
  miss                  Carnator on an empty store (probe + rest + write-back): its cost over plain
  hit                   the same request a hair off, resumed at k with the entry's sparse attention
  miss+easycache        Carnator on an empty store with EasyCache on the model: should equal easycache
  hit+easycache         its hit: steps k..N under EasyCache
  cfg5 plain / easycache / miss / hit   the same with cfg 5 (cond + uncond)
Relative L2 differences are against plain (and, for miss+easycache, against easycache alone).
Goals (issue 15): hit+easycache >= 3.5x plain and >= 1.6x easycache; miss+easycache within 2 % of easycache;
the plain miss within 1 % of plain.

  python3 benchmarks/gpu_compose.py --out benchmarks/results/gpu/gpu_compose_h200.json
  python3 benchmarks/gpu_compose.py --smoke --out /tmp/compose.json      # tiny, CPU
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import reports  # noqa: E402
from gpu_speed import (PRESETS, PROMPT, TEXT_DIM, build_model, carnator_hit, elapsed_logger,  # noqa: E402
                       find_comfyui, import_comfy, plain_sample, rel_diff, timed)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-friendly size (gpu_speed's smoke preset)")
    parser.add_argument("--comfyui", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--easycache-thresholds", default="0.05,0.1,0.2",
                        help="EasyCache reuse_threshold values tried; the one nearest 2x is used")
    parser.add_argument("--easycache-start", type=float, default=0.15)
    parser.add_argument("--easycache-end", type=float, default=0.95)
    parser.add_argument("--max-density", type=float, default=0.3)
    parser.add_argument("--store-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-cfg5", action="store_true")
    return parser.parse_args(argv)


def counted(model):
    """A clone whose diffusion model forwards are counted (declared an observer: not part of Carnator's key)."""
    from comfy.patcher_extension import WrappersMP
    clone = model.clone()
    calls = [0]

    def count(executor, *args, **kwargs):
        calls[0] += 1
        return executor(*args, **kwargs)
    count.carnator_fingerprint = ""
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "carnator_bench_counter", count)
    return clone, calls


def with_easycache(model, threshold, args):
    from comfy_extras.nodes_easycache import EasyCacheNode
    return EasyCacheNode.execute(model, threshold, args.easycache_start, args.easycache_end, False)[0]


def run(args):
    preset = dict(PRESETS["smoke" if args.smoke else "real"])
    n, p, k = preset["steps"], preset["probe"], preset["resume"]
    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    comfy_path = find_comfyui(args.comfyui)
    version = import_comfy(comfy_path, cpu=not cuda)
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    started = time.perf_counter()
    model, params = build_model(preset, device, dtype, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    latent_shape = tuple(preset["latent"])
    noise = torch.randn(latent_shape, generator=gen)
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=gen)
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    overrides = dict(max_hidden=2.0, max_attention=1.0, max_context=10.0, cell_threshold=10.0,
                     max_target_fraction=1.0, max_resume_fraction=min(1.0, (k + 1.5) / n), min_saved_steps=1)
    config = CarnatorConfig(probe_steps=p, block_size=preset["block_size"], max_density=args.max_density,
                            gate_overrides=overrides)
    out = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "comfyui_version": version, "params": params, "dtype": str(dtype),
           "config": {"steps": n, "probe": p, "resume": k, "latent": list(latent_shape),
                      "max_density": args.max_density, "easycache_start": args.easycache_start,
                      "easycache_end": args.easycache_end}, "cases": {}, "easycache_sweep": {}}
    cases = out["cases"]

    def save():
        reports.write(args.out, out)

    log = elapsed_logger(started)

    def plain(m, cfg, label):
        m, calls = counted(m)
        sigmas = ComfyRunner.schedule(m, "euler", "simple", n)
        with timed() as span:
            latent = plain_sample(m, noise, sigmas, positive, negative, args.seed, cfg=cfg)
        log(f"{label}: {span['seconds']:.2f} s, {calls[0]} model calls")
        return {"seconds": span["seconds"], "model_calls": calls[0]}, latent

    def carnator(m, cfg, store, label):
        m, calls = counted(m)
        runner = ComfyRunner(m, positive, negative, cfg=cfg, sampler_name="euler", scheduler="simple", steps=n,
                             seed=args.seed)
        with timed() as span:
            result = generate(runner, noise, runner.sigmas, store, config, PROMPT, args.seed)
        miss = {"seconds": span["seconds"], "model_calls": calls[0], "parts_s": result.seconds,
                "summary_model_calls": result.model_calls, "step_cache": result.step_cache}
        log(f"{label} miss: {miss['seconds']:.2f} s, {calls[0]} calls {result.seconds}")
        calls[0] = 0
        facts, hit, _ = carnator_hit(runner, store, config, noise, runner.sigmas, k, args.seed)
        hit_case = {"seconds": facts["seconds"], "model_calls": calls[0], "resume_step": facts["resume_step"],
                    "density": facts["plan_mean_density"], "summary_model_calls": hit.model_calls,
                    "step_cache_skipped": hit.step_cache_skipped}
        log(f"{label} hit: {hit_case['seconds']:.2f} s, {calls[0]} calls")
        return (miss, runner.to_latent_format(result.latent)), (hit_case, runner.to_latent_format(hit.latent))

    store_root = tempfile.mkdtemp(prefix="carnator_gpu_compose_", dir=args.store_dir)
    try:
        with timed() as span:
            plain_sample(model, noise, ComfyRunner.schedule(model, "euler", "simple", n)[:3], positive, negative,
                         args.seed)
        log(f"warm-up {span['seconds']:.1f} s")
        for cfg, prefix in ((1.0, ""), (5.0, "cfg5 ")):
            if cfg != 1.0 and args.skip_cfg5:
                continue
            base, base_latent = plain(model, cfg, prefix + "plain")
            cases[prefix + "plain"] = base
            if cfg == 1.0:   # the threshold: the one nearest 2x at cfg 1, kept for cfg 5
                for threshold in (float(t) for t in args.easycache_thresholds.split(",")):
                    out["easycache_sweep"][str(threshold)] = plain(with_easycache(model, threshold, args), cfg,
                                                                   f"easycache {threshold}")[0]
                chosen = min(out["easycache_sweep"], key=lambda t: abs(out["easycache_sweep"][t]["model_calls"] - n / 2))
                out["easycache_threshold"] = float(chosen)
            easy_model = with_easycache(model, out["easycache_threshold"], args)
            easy, easy_latent = plain(easy_model, cfg, prefix + "easycache")
            cases[prefix + "easycache"] = {**easy, "rel_l2_vs_plain": rel_diff(easy_latent, base_latent)}
            for label, m, reference in ((prefix + "", model, None), (prefix + "easycache ", easy_model, easy_latent)):
                if cfg != 1.0 and m is easy_model:
                    continue       # cfg 5: plain, EasyCache and the hit (the list)
                store = CarnatorStore(os.path.join(store_root, f"{cfg}{label.strip()}"), 16 << 30)
                (miss, miss_latent), (hit, hit_latent) = carnator(m, cfg, store, label + "carnator")
                name = label.replace("easycache ", "").strip()
                cases[f"{name} miss{'+easycache' if m is easy_model else ''}".strip()] = {
                    **miss, "rel_l2_vs_plain": rel_diff(miss_latent, base_latent),
                    **({"rel_l2_vs_easycache": rel_diff(miss_latent, reference)} if reference is not None else {})}
                cases[f"{name} hit{'+easycache' if m is easy_model else ''}".strip()] = {
                    **hit, "rel_l2_vs_plain": rel_diff(hit_latent, base_latent)}
                store.close()
            save()
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    for name, case in cases.items():
        base = cases["cfg5 plain" if name.startswith("cfg5") else "plain"]
        case["speedup_vs_plain"] = base["seconds"] / case["seconds"]
        if "easycache" in cases:
            easy = cases["cfg5 easycache" if name.startswith("cfg5") and "cfg5 easycache" in cases else "easycache"]
            case["speedup_vs_easycache"] = easy["seconds"] / case["seconds"]
    out["total_seconds"] = time.perf_counter() - started
    save()
    print_table(out)
    return out


def print_table(out):
    c = out["config"]
    print(f"\nCarnator + EasyCache: {out['device']}, torch {out['torch']}, ComfyUI {out['comfyui_version']}, "
          f"{out['params'] / 1e9:.3f} B params, {out['dtype']}, N={c['steps']} p={c['probe']} k={c['resume']}, "
          f"EasyCache reuse_threshold {out['easycache_threshold']:g} (start {c['easycache_start']:g}, end "
          f"{c['easycache_end']:g}; sweep: " + ", ".join(f"{t}: {v['model_calls']} calls"
                                                        for t, v in out["easycache_sweep"].items()) + ")")
    print(f"| {'case':22} | {'seconds':>8} | {'calls':>5} | {'vs plain':>8} | {'vs EasyCache':>12} | {'rel L2 vs plain':>15} |")
    print(f"|{'-' * 24}|{'-' * 10}|{'-' * 7}|{'-' * 10}|{'-' * 14}|{'-' * 17}|")
    for name, case in out["cases"].items():
        rel = case.get("rel_l2_vs_plain")
        print(f"| {name:22} | {case['seconds']:8.2f} | {case['model_calls']:>5} | {case['speedup_vs_plain']:>7.2f}x | "
              f"{case.get('speedup_vs_easycache', math.nan):>11.2f}x | "
              f"{'' if rel is None else f'{rel:.2e}':>15} |")
    miss = out["cases"].get("miss+easycache")
    if miss:
        print(f"miss+easycache vs easycache alone: rel L2 {miss['rel_l2_vs_easycache']:.2e}")
    print(f"total {out['total_seconds']:.1f} s")


if __name__ == "__main__":
    run(parse_args())
