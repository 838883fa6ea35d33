#!/usr/bin/env python3
"""The creator's desk: Carnator on a 24 GB or 16 GB card, the card made a creator's by ComfyUI's own memory
management (never by hand): the host starts with --reserve-vram (the card's total less the budget, in GiB) and, where
asked, --lowvram or --novram, so ComfyUI loads what fits and streams the rest of the weights every step.

Setups (--setup; one command each on one GPU, cut at --budget-s so it ends within 9 minutes):
  wan14b-24gb-bf16      Wan 2.1 14B T2V size (dim 5120, 40 layers, ffn 13824), bf16 weights, 24 GiB left
  wan14b-24gb-fp8       the same, weights stored fp8_e4m3fn and cast per layer (UNETLoader's weight_dtype)
  wan14b-16gb-fp8       fp8 weights, 16 GiB left
  wan22-a14b-24gb-fp8   Wan 2.2 A14B: two 14B experts, the low-noise one from step 10, fp8, 24 GiB left
Random weights (gpu_host.build_model, built on the host as ComfyUI loads them), 480p x 81 frames, euler / simple,
20 steps, probe 2, resume 10, cfg 5 (--cfg 1 for the cfg-1 row), the product's defaults otherwise.

Cases, in order (a case the time budget leaves out is listed under "skipped"): plain (the process's first call after
a 2-step warm-up), miss, whole-clip hit, region-only 10 % (the first region-only hit of the process), 10 % again,
30 %, EasyCache plain, miss + EasyCache (its entry), hit + EasyCache. Each row: seconds, speedup against plain of the
same run, model calls (diffusion model forwards), peak GPU memory allocated against plain, host memory (the process's
peak resident set inside the case, and pinned host memory torch allocated) against plain, and the time the compute
stream spent on weights that ComfyUI streams (CUDA events on it around comfy.ops.cast_bias_weight of weights not on
the card: the copy it waits for, not the part overlapped with compute); compute is the rest. The time kept keys and values take to move is not measured (left empty).
Region-only is off by default in the product: its rows carry "region_only_default": false.

  python3 benchmarks/desk.py --setup wan14b-24gb-fp8 --out benchmarks/results/gpu/desk_wan14b_24gb_fp8_h100.json
  python3 benchmarks/desk.py --smoke --out /tmp/desk.json        # tiny, CPU, seconds
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import gpu_host as gs  # noqa: E402

WAN14B = dict(dim=5120, layers=40, ffn=13824, latent=(1, 16, 21, 60, 104), text_len=512)
SETUPS = {
    "wan14b-24gb-bf16": dict(budget_gib=24, weights="bf16", experts=1),
    "wan14b-24gb-fp8": dict(budget_gib=24, weights="fp8_e4m3fn", experts=1),
    "wan14b-16gb-fp8": dict(budget_gib=16, weights="fp8_e4m3fn", experts=1),
    "wan22-a14b-24gb-fp8": dict(budget_gib=24, weights="fp8_e4m3fn", experts=2),
}
SMOKE = gs.PRESETS["smoke"]
REGION_NOTE = "region-only is off by default (CarnatorConfig.region_only); reported, not yet the product's path"


def parse_args(argv=None):
    parser = gs.host_arguments(__doc__)
    parser.add_argument("--setup", choices=sorted(SETUPS), default="wan22-a14b-24gb-fp8")
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--vram-mode", choices=("default", "lowvram", "novram"), default="default",
                        help="ComfyUI's --lowvram / --novram beside --reserve-vram")
    parser.add_argument("--budget-s", type=float, default=520.0,
                        help="cases that would start after this many seconds are skipped (one command < 9 min)")
    parser.add_argument("--easycache-threshold", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def comfy_memory_args(budget_gib, vram_mode, cuda):
    """ComfyUI's flags that leave `budget_gib` of the card: --reserve-vram is in GiB (ComfyUI multiplies by 1024**3)."""
    if not cuda:
        return []
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    reserve = round(total_gib - budget_gib, 1)
    if reserve < 0:
        raise SystemExit(f"--setup: the card has {total_gib:.1f} GiB, less than the {budget_gib} GiB budget")
    return ["--reserve-vram", str(reserve)] + ([f"--{vram_mode}"] if vram_mode != "default" else [])


def host_memory():
    """(peak resident bytes since the last reset, pinned bytes torch's host allocator holds)."""
    peak = None
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    stats = torch.cuda.memory.host_memory_stats() if torch.cuda.is_available() else {}
    return peak, stats.get("allocated_bytes.current")


def reset_peak_rss():
    """Resets VmHWM to the current resident set (Linux: 5 into clear_refs), so a case's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


class WeightMoves:
    """CUDA events around comfy.ops.cast_bias_weight of weights that are not on the compute device (the part of the
    model ComfyUI streams): the compute stream's time on them, copy and wait for the offload stream included."""

    def __init__(self):
        import comfy.ops
        self.ops, self.original = comfy.ops, comfy.ops.cast_bias_weight
        self.cuda = torch.cuda.is_available()
        self.events, self.calls = [], 0
        moves = self

        def cast_bias_weight(s, input=None, dtype=None, device=None, bias_dtype=None):
            target = device if device is not None else (input.device if input is not None else None)
            if target is None or s.weight.device.type == torch.device(target).type:   # resident: not moved
                return moves.original(s, input, dtype, device, bias_dtype)
            moves.calls += 1
            if not moves.cuda:
                return moves.original(s, input, dtype, device, bias_dtype)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = moves.original(s, input, dtype, device, bias_dtype)
            end.record()
            moves.events.append((start, end))
            return out

        comfy.ops.cast_bias_weight = cast_bias_weight

    def take(self):
        """{"weights_moved": calls, "weights_move_s": seconds or None on the CPU} since the last take."""
        gs.sync()
        seconds = sum(a.elapsed_time(b) for a, b in self.events) / 1e3 if self.cuda else None
        out = {"weights_moved": self.calls, "weights_move_s": seconds}
        self.events, self.calls = [], 0
        return out


def run(args):
    import gpu_backbones
    from gpu_compose import counted
    setup = SETUPS[args.setup]
    cuda = torch.cuda.is_available() and not args.smoke and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    comfy_args = comfy_memory_args(setup["budget_gib"], args.vram_mode, cuda)
    version = gs.import_comfy(gs.find_comfyui(args.comfyui), cpu=not cuda, comfy_args=comfy_args)
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    preset = SMOKE if args.smoke else dict(WAN14B, steps=20, probe=2, resume=10, block_size=128)
    n, p, k = preset["steps"], preset["probe"], preset["resume"]
    dtype = torch.bfloat16 if cuda else torch.float32
    weight_dtype = torch.float8_e4m3fn if setup["weights"] == "fp8_e4m3fn" else None
    started = time.perf_counter()
    log = gs.elapsed_logger(started)
    built = [gs.build_model(preset, torch.device("cpu"), dtype, args.seed + i, weight_dtype, device)
             for i in range(setup["experts"])]     # on the host, as ComfyUI loads a checkpoint: it moves what fits
    params = sum(count for _, count in built)
    log(f"{params / 1e9:.2f} B parameters built ({setup['weights']})")
    gen = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(preset["latent"], generator=gen)
    context = torch.randn(1, preset["text_len"], gs.TEXT_DIM, generator=gen)
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    switch = n // 2 if setup["experts"] == 2 else None
    config = CarnatorConfig(probe_steps=p, block_size=preset["block_size"], region_only=False)
    out = {**gs.machine_facts(device, version), "setup": args.setup, **setup, "comfyui_args": comfy_args,
           "card_total_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
           "params": params, "dtype": str(dtype), "smoke": args.smoke,
           "stored_dtypes": sorted({str(w.dtype) for m, _ in built for w in m.model.diffusion_model.parameters()}),
           "config": {"steps": n, "probe": p, "resume": k, "cfg": args.cfg, "latent": list(preset["latent"]),
                      "easycache_threshold": args.easycache_threshold, "switch_step": switch},
           "kv_move_s": "not measured", "cases": {}, "skipped": [], "errors": {}}
    cases = out["cases"]
    moves = WeightMoves()
    root = tempfile.mkdtemp(prefix="carnator_desk_")

    def models_for(easycache):
        chosen = [gs.with_easycache(m, args.easycache_threshold) if easycache else m for m, _ in built]
        counted_models = [counted(m) for m in chosen]
        return [m for m, _ in counted_models], counted_models[0][1]

    def runner_for(models):
        experts = {} if switch is None else {"low_noise_model": models[1], "switch_step": switch}
        return ComfyRunner(models[0], positive, negative, cfg=args.cfg, sampler_name="euler", scheduler="simple",
                           steps=n, seed=args.seed, **experts)

    def measured(name, calls, body):
        """Runs body() -> facts as case `name` unless the budget is spent: its peaks, host memory, moves, calls."""
        if time.perf_counter() - started > args.budget_s:
            out["skipped"].append(name)
            return None
        calls[0] = 0
        moves.take()
        reset_peak_rss()
        try:
            with gs.Peak() as peak:
                facts = body()
        except Exception:
            out["errors"][name] = traceback.format_exc()
            log(f"{name} FAILED:\n{out['errors'][name]}")
            return None
        rss, pinned = host_memory()
        cases[name] = {**facts, "model_calls": calls[0], "peak_bytes": peak.bytes, "host_peak_rss_bytes": rss,
                       "host_pinned_bytes": pinned, **moves.take()}
        log(f"{name}: {facts['seconds']:.2f} s, {calls[0]} calls, peak {peak.bytes / 2**30:.2f} GiB")
        gs.write_report(args.out, out)
        return cases[name]

    try:
        plain_models, calls = models_for(False)
        runner = runner_for(plain_models)
        sigmas = runner.sigmas
        with gs.timed() as span:
            gs.plain_sample(plain_models[0], noise, sigmas[:3], positive, negative, args.seed, cfg=args.cfg)
        out["warm_up_s"] = span["seconds"]

        def plain(models):
            def body():
                with gs.timed() as span:
                    gpu_backbones.plain(models, switch, noise, sigmas, positive, negative, args.seed, cfg=args.cfg)
                return {"seconds": span["seconds"]}
            return body

        def miss(store):
            def body():
                with gs.timed() as span:
                    result = generate(runner, noise, sigmas, store, config, gs.PROMPT, args.seed)
                if result.decision.reuse or result.entry_id is None:
                    raise RuntimeError(f"expected a stored miss, got {result.summary()}")
                return {"seconds": span["seconds"], "parts_s": result.seconds}
            return body

        def hit(store):
            def body():
                facts, result, _ = gs.carnator_hit(runner, store, config, noise, sigmas, k, args.seed)
                store.delete(result.entry_id)      # the next hit resumes from the miss's entry
                return {key: facts[key] for key in ("seconds", "probe_s", "resume_step", "plan_mean_density")}
            return body

        def region(store, share):
            def body():
                (name, facts), = gs.region_hits(runner, store, config, noise, sigmas, k, args.seed, [share], log,
                                                lambda latent: {}).items()
                return {**facts, "region_only_default": False, "note": REGION_NOTE}
            return body

        measured("plain", calls, plain(plain_models))
        store = CarnatorStore(os.path.join(root, "plain"), 64 << 30)
        measured("miss", calls, miss(store))
        if "miss" in cases:
            measured("hit", calls, hit(store))
            measured("region hit 10% (first)", calls, region(store, 0.1))
            measured("region hit 10% (again)", calls, region(store, 0.1))
            measured("region hit 30%", calls, region(store, 0.3))
        store.close()
        easy_models, calls = models_for(True)
        measured("easycache", calls, plain(easy_models))
        runner = runner_for(easy_models)
        easy_store = CarnatorStore(os.path.join(root, "easycache"), 64 << 30)
        measured("miss+easycache", calls, miss(easy_store))
        if "miss+easycache" in cases:
            measured("hit+easycache", calls, hit(easy_store))
        easy_store.close()
    finally:
        moves.ops.cast_bias_weight = moves.original
        shutil.rmtree(root, ignore_errors=True)
    base = cases.get("plain")
    for case in cases.values():
        if base is None:
            break
        case["speedup_vs_plain"] = base["seconds"] / case["seconds"]
        case["peak_vs_plain_pct"] = _pct(case["peak_bytes"], base["peak_bytes"])
        case["host_rss_vs_plain_pct"] = _pct(case["host_peak_rss_bytes"], base["host_peak_rss_bytes"])
        case["host_pinned_vs_plain_bytes"] = (None if case["host_pinned_bytes"] is None
                                              else case["host_pinned_bytes"] - base["host_pinned_bytes"])
    out["total_seconds"] = time.perf_counter() - started
    gs.write_report(args.out, out)
    print_table(out)
    return out


def _pct(value, base):
    return None if not value or not base else 100.0 * (value / base - 1)


def _cell(value, form, unit=""):
    return "" if value is None else format(value, form) + unit


def print_table(out):
    c = out["config"]
    print(f"\nThe creator's desk: {out['setup']} on {out['device']} (ComfyUI {out['comfyui_version']} "
          f"{' '.join(out['comfyui_args']) or 'no memory flags'}), {out['params'] / 1e9:.2f} B params, "
          f"{out['weights']}, N={c['steps']} p={c['probe']} k={c['resume']} cfg {c['cfg']:g}")
    print("| case | seconds | vs plain | calls | peak GPU vs plain | host RSS vs plain | pinned vs plain MiB | "
          "weights moved s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, case in out["cases"].items():
        pinned = case.get("host_pinned_vs_plain_bytes")
        mark = " *" if case.get("region_only_default") is False else ""
        print(f"| {name}{mark} | {case['seconds']:.2f} | {_cell(case.get('speedup_vs_plain'), '.2f', 'x')} | "
              f"{case['model_calls']} | {_cell(case.get('peak_vs_plain_pct'), '+.1f', ' %')} | "
              f"{_cell(case.get('host_rss_vs_plain_pct'), '+.1f', ' %')} | "
              f"{_cell(None if pinned is None else pinned / 2**20, '.0f')} | "
              f"{_cell(case.get('weights_move_s'), '.2f')} |")
    print(f"* {REGION_NOTE}. Kept keys and values moved: not measured.")
    if out["skipped"]:
        print(f"skipped (time budget): {', '.join(out['skipped'])}")
    print(f"total {out['total_seconds']:.1f} s")


if __name__ == "__main__":
    run(parse_args())
