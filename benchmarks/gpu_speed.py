#!/usr/bin/env python3
"""End-to-end speed of a Carnator hit at Wan2.1-T2V-1.3B size, through the adapter the nodes use.

A Wan2.1-T2V-1.3B-architecture model (ComfyUI's own `comfy.ldm.wan.model.WanModel` inside
`comfy.model_base.WAN21` and a `ModelPatcher`; dim 1536, 30 layers, 12 heads, ffn 8960, patch (1,2,2),
text_dim 4096) with random weights in bf16, a 480p 81-frame latent [1, 16, 21, 60, 104] (32760 tokens)
and a random text context [1, 512, 4096] are driven through `ComfyRunner` (keyed PREDICT_NOISE wrapper,
per-block dit patches, chained attention override) and the engine pipeline (probe -> lookup -> gate ->
resume -> write-back), with ComfyUI's euler sampler and simple schedule, cfg 1 (one model call a step).

Measured in one process, side by side (CUDA synchronised, medians where repeated):
  full      plain ComfyUI sampling of all N steps with dense attention, no Carnator patches (the baseline)
  miss      the same request through Carnator on an empty store (probe + the rest + write-back)
  hit       the same request again: probe p steps, lookup, gate, resume at step k with the cached
            block-sparse attention recorded by the miss, in two entries: one recorded with the
            mass rule alone (attention_mass 0.9) and one with the density budget too (max_density,
            default 0.3); each hit runs at the density its entry measured
  hit-band  the same hit with the entry's connectivity replaced by a band (local window) of a chosen
            density: a layout-only reference, since random weights attend almost uniformly
  overhead  lookup + gate with the store holding several entries, as a share of `full`
  attention share a of a step: the step with self-attention replaced by a no-op, against dense
Warm-ups come first and stay out of the compared times (their times are reported): 2 dense steps
through ComfyUI, the FlexAttention compile, and 2 sparse steps through the model.
The gate runs with its defaults (no gate_overrides); if it accepts the repeated request at another checkpoint
than k, k is set explicitly and the JSON says so (`forced_resume_step`, with the gate's own `gate_resume_step`).

Usage:
  python3 benchmarks/gpu_speed.py --out gpu_speed.json            # real size (needs a large GPU)
  python3 benchmarks/gpu_speed.py --smoke --out /tmp/smoke.json   # 2 layers, dim 256, N=10, p=2, k=5; CPU ok
ComfyUI is found at --comfyui, else $COMFYUI_PATH, else <repo>/.host/ComfyUI, else /opt/ComfyUI; only
`comfy/` (plus torchsde for its samplers) is imported: no text encoders, no server.
"""
from __future__ import annotations

import math
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE] if HERE not in sys.path else []

import torch  # noqa: E402

import reports  # noqa: E402
from gpu_host import (HEAD_DIM, PRESETS, PROMPT, StepTimer, TEXT_DIM, band_connectivity, build_model, carnator_hit,
                      elapsed_logger, find_comfyui, flex_warnings, host_arguments, ideal_speedup, import_comfy, kernel_ms,
                      median, noop_self_attention, plain_sample, rel_diff, sdpa_ms, sync, timed)  # noqa: E402


def parse_args(argv=None):
    parser = host_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--probe", type=int, default=None)
    parser.add_argument("--resume", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--attention-mass", type=float, default=0.9)
    parser.add_argument("--max-density", type=float, default=0.3,
                        help="density budget of the second recorded entry (CarnatorConfig.max_density)")
    parser.add_argument("--chosen-density", type=float, default=0.3, help="density of the band connectivity")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of each hit")
    parser.add_argument("--store-dir", default=None, help="parent of the temporary stores (default: /tmp)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def run(args):
    preset = dict(PRESETS["smoke" if args.smoke else "real"])
    for key in ("steps", "probe", "resume", "block_size", "repeats"):
        value = getattr(args, key)
        if value is not None:
            preset[key] = value
    n, p, k = preset["steps"], preset["probe"], preset["resume"]
    if not 1 <= p < k < n:
        raise SystemExit(f"need 1 <= probe < resume < steps, got p={p}, k={k}, N={n}")
    device_name = args.device
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    comfy_path = find_comfyui(args.comfyui)
    started = time.perf_counter()
    version = import_comfy(comfy_path, cpu=not cuda)
    import comfy.model_management as mm

    from carnator_engine.attention import sparse as sa
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, checkpoint_steps, generate
    from carnator_engine.store import CarnatorStore, TrajectoryPayload

    out = {"path": "ComfyRunner (carnator_engine.hosts.comfyui) + carnator_engine.pipeline, ComfyUI samplers",
           "preset": "smoke" if args.smoke else "real", "comfyui_version": version, "comfyui_path": comfy_path,
           "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else platform.processor()
           or "cpu", "comfy_device": str(mm.get_torch_device()), "dtype": str(dtype),
           "sampler": "euler", "scheduler": "simple", "cfg": 1.0,
           "config": {**{k_: v for k_, v in preset.items() if k_ != "latent"}, "latent": list(preset["latent"]),
                      "attention_mass": args.attention_mass, "max_density": args.max_density,
                      "chosen_density": args.chosen_density},
           "results": {}}
    res = out["results"]

    def save():
        reports.write(args.out, out)

    log = elapsed_logger(started)

    log(f"ComfyUI {version} from {comfy_path}; torch {torch.__version__}; device {out['device']}")
    t = time.perf_counter()
    model, params = build_model(preset, device, dtype, args.seed)
    sync()
    out["params"] = params
    log(f"model built: {params / 1e9:.3f} B params in {time.perf_counter() - t:.1f} s")

    gen = torch.Generator().manual_seed(args.seed)
    latent_shape = tuple(preset["latent"])
    noise = torch.randn(latent_shape, generator=gen)
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=gen)
    positive = [[context, {}]]
    negative = [[torch.zeros_like(context), {}]]
    timer = StepTimer()
    runner = ComfyRunner(model, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                         seed=args.seed, step_callback=timer)
    sigmas = runner.sigmas
    tokens = math.prod(runner.layout.token_grid(latent_shape))
    heads = preset["dim"] // HEAD_DIM
    block_size = preset["block_size"]
    out["tokens"] = tokens
    kept = checkpoint_steps(n, p, 12)
    if k not in kept:
        raise SystemExit(f"resume step {k} is not among the checkpoints an entry keeps ({kept})")
    config = CarnatorConfig(probe_steps=p, block_size=block_size, attention_mass=args.attention_mass)
    budget_config = CarnatorConfig(probe_steps=p, block_size=block_size, attention_mass=args.attention_mass,
                                   max_density=args.max_density)
    out["gate_overrides"] = {}      # the default gate decides; a hit at another k than asked is forced to k

    # -- warm-up: dense steps through ComfyUI (cuDNN plans, allocator), flex compile for this shape --
    with timed() as span:
        plain_sample(model, noise, sigmas[: 3], positive, negative, args.seed)
    log(f"warm-up dense (2 steps) {span['seconds']:.1f} s")
    band, band_density = band_connectivity(tokens, block_size, args.chosen_density)
    qkv = [torch.randn(1, tokens, heads * HEAD_DIM, device=device, dtype=dtype)
           .reshape(1, tokens, heads, HEAD_DIM).transpose(1, 2) for _ in range(3)]
    warm_plan = sa.BlockSparseAttention({0: band}, block_size=block_size, seq_len=tokens)
    with warnings.catch_warnings(record=True) as caught, timed() as span:
        warnings.simplefilter("always")
        warm_plan.attend(0, *qkv)
    res["flex_warmup"] = {"seconds": span["seconds"], "flex_available": sa.flex_available(),
                          "warnings": flex_warnings(caught)}
    log(f"sparse attention warm-up (flex compile on CUDA) {res['flex_warmup']['seconds']:.1f} s "
        f"{res['flex_warmup']['warnings'] or ''}")

    # -- kernels alone: one self-attention of this shape --
    import torch.nn.functional as F
    reps = preset["kernel_reps"]
    res["kernels_ms"] = {"sdpa_dense": sdpa_ms(qkv, reps),
                         "sdpa_torch_default_priority": kernel_ms(lambda: F.scaled_dot_product_attention(*qkv), reps),
                         f"sparse_band_d{band_density:.3f}": kernel_ms(lambda: warm_plan.attend(0, *qkv), reps)}
    res["kernel_band_ms"] = res["kernels_ms"][f"sparse_band_d{band_density:.3f}"]
    save()
    log(f"kernels (ms): {res['kernels_ms']}")

    # -- (1) full generation, plain ComfyUI, dense (twice: the overhead goal is a few tenths of a second) --
    full_runs, full_steps = [], []
    for _ in range(2):
        with timed(timer) as span:
            full_latent = plain_sample(model, noise, sigmas, positive, negative, args.seed, callback=timer)
        full_runs.append(span["seconds"])
        full_steps += timer.step_seconds()
        log(f"full generation (plain ComfyUI, {n} steps, dense): {full_runs[-1]:.2f} s")
    full_s = median(full_runs)
    res["full"] = {"seconds": full_s, "runs_s": full_runs, "step_median_s": median(full_steps), "steps": n,
                   "finite": bool(torch.isfinite(full_latent).all()), "latent_std": float(full_latent.float().std())}
    save()
    log(f"full generation median {full_s:.2f} s, step {median(full_steps) * 1e3:.1f} ms")

    # -- (4) attention share: self-attention as a no-op --
    noop = model.clone()
    noop.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = noop_self_attention
    with timed(timer):
        plain_sample(noop, noise, sigmas[: preset["noop_steps"] + 1], positive, negative, args.seed, callback=timer)
    noop_step = median(timer.step_seconds())
    a = max(0.0, min(1.0, 1.0 - noop_step / res["full"]["step_median_s"]))
    res["attention_share"] = {"a": a, "step_dense_s": res["full"]["step_median_s"], "step_noop_s": noop_step,
                              "kernel_estimate": preset["layers"] * res["kernels_ms"]["sdpa_dense"] / 1e3
                              / res["full"]["step_median_s"]}
    save()
    log(f"attention share a = {a:.3f} (step {noop_step * 1e3:.1f} ms with self-attention skipped; kernel-count "
        f"estimate {res['attention_share']['kernel_estimate']:.3f})")

    store_root = tempfile.mkdtemp(prefix="carnator_gpu_speed_", dir=args.store_dir)
    try:
        store = CarnatorStore(os.path.join(store_root, "measured"), size_limit_bytes=16 << 30)

        budget_store = CarnatorStore(os.path.join(store_root, "budget"), size_limit_bytes=16 << 30)

        # -- misses: the same request through Carnator on an empty store (each stores an entry) --
        def carnator_miss(label, miss_store, miss_config):
            with timed(timer) as span:
                result = generate(runner, noise, sigmas, miss_store, miss_config, PROMPT, args.seed)
            seconds = span["seconds"]
            if result.decision.reuse or result.entry_id is None:
                raise RuntimeError(f"expected a stored miss, got {result.summary()}")
            facts = {"seconds": seconds, "step_median_s": median(timer.step_seconds()),
                     "parts_s": result.seconds, "model_calls": result.model_calls,
                     "rel_diff_vs_full": rel_diff(runner.to_latent_format(result.latent), full_latent)}
            log(f"{label}: {seconds:.2f} s {({k_: round(v, 3) for k_, v in result.seconds.items()})}")
            return facts, result

        res["miss"], miss = carnator_miss("miss (Carnator, empty store)", store, config)
        res["miss_budget"], budget_miss = carnator_miss(f"miss (max_density {args.max_density})", budget_store,
                                                        budget_config)
        miss_s = median([res["miss"]["seconds"], res["miss_budget"]["seconds"]])
        save()

        recorded = {}
        for name, entry_store, entry in (("measured", store, miss), ("budget", budget_store, budget_miss)):
            tables = recorded[name] = entry_store.trajectory(entry_store.record(entry.entry_id)).connectivity
            first = sorted(table for table in tables if table != "block_size")[0]
            entry_plan = sa.BlockSparseAttention({0: tables[first].bool()}, block_size=block_size, seq_len=tokens)
            label = f"sparse_{name}_block{first}_d{entry_plan.mean_density():.3f}"
            res["kernels_ms"][label] = kernel_ms(lambda: entry_plan.attend(0, *qkv), reps)
            res[f"kernel_{name}_block_density"] = entry_plan.mean_density()
            res[f"kernel_{name}_ms"] = res["kernels_ms"][label]
        log(f"kernels (ms): {res['kernels_ms']}")

        # -- (2) hits with the recorded connectivity --
        def hits(label, hit_store, hit_config, repeats):
            runs = []
            for i in range(repeats):
                timer.reset()
                facts, result, probed = carnator_hit(runner, hit_store, hit_config, noise, sigmas, k, args.seed)
                facts["sparse_step_median_s"] = median(timer.step_seconds(first_step=k + 1))
                facts["rel_diff_vs_miss"] = rel_diff(result.latent, miss.latent)
                facts["finite"] = bool(torch.isfinite(result.latent).all())
                runs.append(facts)
                log(f"{label} #{i + 1}: {facts['seconds']:.2f} s (probe {facts['probe_s']:.2f}, lookup+gate "
                    f"{facts['lookup_gate_s'] * 1e3:.1f} ms, resume+write {facts['resume_and_write_s']:.2f}), "
                    f"k={facts['resume_step']} (gate {facts['gate_resume_step']}), density "
                    f"{facts['plan_mean_density']:.3f}, sparse calls {facts['sparse_attend_calls']}, "
                    f"rel diff vs miss {facts['rel_diff_vs_miss']:.4f} {facts['warnings'] or ''}")
            return {"runs": runs, "seconds_median": median([r["seconds"] for r in runs]),
                    "density": runs[0]["plan_mean_density"],
                    "sparse_step_median_s": median([r["sparse_step_median_s"] for r in runs])}, probed

        # -- (2b) hits with a band connectivity of the chosen density (same entry otherwise) --
        record = store.record(miss.entry_id)
        payload = store.trajectory(record)
        blocks = [name for name in payload.connectivity if name != "block_size"]
        banded = {name: band.clone() for name in blocks}
        banded["block_size"] = torch.tensor(block_size)
        band_store = CarnatorStore(os.path.join(store_root, "band"), size_limit_bytes=16 << 30)
        band_store.put(bucket=record.bucket, prompt=record.prompt, seed=record.seed, steps=record.steps,
                       probe_steps=record.probe_steps, signature=store.signature(record),
                       payload=TrajectoryPayload(payload.checkpoints, banded), latent_shape=record.latent_shape,
                       thumbnail=store.thumbnail(record.entry_id))
        # -- warm-up of the sparse path through the model, as the dense path had (compiles for the model's
        # q/k/v layout); its time is what the first hit in a fresh process pays once --
        from carnator_engine.attention.connectivity import plan_from_tensors
        from carnator_engine.observer import GenerationObserver
        no_target = torch.zeros(tokens, dtype=torch.bool)
        with timed() as span:
            runner.run(noise * float(sigmas[n - 2]), sigmas, n - 2, n,
                       GenerationObserver(sparse=plan_from_tensors(recorded["budget"], no_target)))
        res["sparse_path_warmup_s"] = span["seconds"]
        log(f"warm-up sparse path through the model (2 steps) {res['sparse_path_warmup_s']:.1f} s")

        probed = None
        for key, label, hit_store, hit_config, repeats in (
                ("hit_budget", f"hit (measured, max_density {args.max_density})", budget_store, budget_config,
                 preset["repeats"]),
                ("hit_measured", "hit (measured, mass rule alone)", store, config, 1),
                ("hit_band", f"hit (band, density {band_density:.3f})", band_store, config, 1)):
            try:
                res[key], probed = hits(label, hit_store, hit_config, repeats)
            except Exception:
                res[key] = {"error": traceback.format_exc()}
                log(f"{label} FAILED:\n" + res[key]["error"])
            save()
        res["hit_band"]["band_density"] = band_density
        if probed is None:
            raise RuntimeError("no hit ran: see the errors above")
        probe_s = median([run_["probe_s"] for key in ("hit_budget", "hit_measured", "hit_band")
                          for run_ in res[key].get("runs", [])])

        # -- (3) lookup + gate with the store holding several entries --
        for i in range(max(0, 5 - len(store.records()))):
            store.put(bucket=record.bucket, prompt=f"{record.prompt} copy {i}", seed=record.seed, steps=record.steps,
                      probe_steps=record.probe_steps, signature=store.signature(record), payload=payload,
                      latent_shape=record.latent_shape)
        from carnator_engine import pipeline
        lookups = []
        for _ in range(7):
            with timed() as span:
                candidates = pipeline.lookup(store, probed, config)
                pipeline.decide(probed, candidates, config)
            lookups.append(span["seconds"])
        entries = len(store.records())
        lookup_s = median(lookups)
        probe_extra = probe_s - p * res["full"]["step_median_s"]
        res["overhead"] = {
            "store_entries": entries, "lookup_gate_s": lookup_s,
            "lookup_gate_pct_of_full": 100.0 * lookup_s / full_s,
            "probe_s": probe_s,
            "probe_pct_of_full": 100.0 * probe_s / full_s,
            "probe_extra_vs_plain_steps_s": probe_extra,
            "probe_lookup_gate_extra_pct_of_full": 100.0 * (probe_extra + lookup_s) / full_s,
            "miss_extra_pct_of_full": 100.0 * (miss_s - full_s) / full_s,
            "miss_s": miss_s,
            "write_back_s": miss.seconds.get("write_back"),
        }
        save()
        log(f"lookup+gate with {entries} entries: {lookup_s * 1e3:.1f} ms = "
            f"{res['overhead']['lookup_gate_pct_of_full']:.3f}% of full")
    finally:
        shutil.rmtree(store_root, ignore_errors=True)

    # -- summary --
    summary = []
    for key, label, kernel in (("hit_budget", f"hit, measured, max_density {args.max_density}", "kernel_budget_ms"),
                               ("hit_measured", "hit, measured, mass rule alone", "kernel_measured_ms"),
                               ("hit_band", "hit, band connectivity", "kernel_band_ms")):
        hit = res[key]
        if "error" in hit:
            continue
        d = hit["density"]
        kernel_ratio = res[kernel] / res["kernels_ms"]["sdpa_dense"]
        summary.append({
            "case": label, "density": d, "seconds": hit["seconds_median"],
            "speedup_vs_full": full_s / hit["seconds_median"], "speedup_vs_miss": miss_s / hit["seconds_median"],
            "ideal": ideal_speedup(n, p, k, a, d),
            "ideal_from_step_times": n * res["full"]["step_median_s"]
            / (p * res["full"]["step_median_s"] + (n - k) * hit["sparse_step_median_s"]),
            "sparse_step_s": hit["sparse_step_median_s"], "kernel_ratio": kernel_ratio,
            "ideal_with_kernel_ratio": ideal_speedup(n, p, k, a, kernel_ratio),
        })
    res["summary"] = summary
    out["total_seconds"] = time.perf_counter() - started
    save()
    print_table(out)
    return out


def print_table(out):
    res = out["results"]
    cfg = out["config"]
    n, p, k = cfg["steps"], cfg["probe"], cfg["resume"]
    a = res["attention_share"]["a"]
    print()
    print(f"Carnator GPU speed ({out['preset']}): {out['device']}, torch {out['torch']}, ComfyUI "
          f"{out['comfyui_version']}, {out['params'] / 1e9:.3f} B params, {out['tokens']} tokens, {out['dtype']}, "
          f"euler/simple cfg 1, N={n} p={p} k={k}, block {cfg['block_size']}")
    print(f"path: {out['path']}")
    rows = [("full generation (plain ComfyUI, dense)", res["full"]["seconds"], "1.00x", "", "",
             f"step {res['full']['step_median_s'] * 1e3:.1f} ms"),
            ("Carnator miss (empty store, median of 2)", res["overhead"]["miss_s"],
             f"{res['full']['seconds'] / res['overhead']['miss_s']:.2f}x", "", "",
             f"{res['overhead']['miss_extra_pct_of_full']:+.2f}% vs full")]
    for s in res["summary"]:
        rows.append((s["case"], s["seconds"], f"{s['speedup_vs_full']:.2f}x", f"{s['density']:.3f}",
                     f"{s['ideal']:.2f}x", f"sparse step {s['sparse_step_s'] * 1e3:.1f} ms, "
                                           f"step-time ideal {s['ideal_from_step_times']:.2f}x"))
    print(f"| {'case':44} | {'seconds':>8} | {'speedup':>7} | {'density':>7} | {'ideal':>6} | notes")
    print(f"|{'-' * 46}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 8}|------")
    for name, secs, speed, dens, ideal, note in rows:
        print(f"| {name:44} | {secs:8.2f} | {speed:>7} | {dens:>7} | {ideal:>6} | {note}")
    o = res["overhead"]
    print(f"attention share a = {a:.3f} (self-attention no-op step {res['attention_share']['step_noop_s'] * 1e3:.1f} ms"
          f" vs {res['attention_share']['step_dense_s'] * 1e3:.1f} ms; kernel estimate "
          f"{res['attention_share']['kernel_estimate']:.3f})")
    print(f"lookup+gate ({o['store_entries']} entries): {o['lookup_gate_s'] * 1e3:.2f} ms = "
          f"{o['lookup_gate_pct_of_full']:.3f}% of full; probe {o['probe_s']:.2f} s ({o['probe_pct_of_full']:.1f}% of "
          f"full, {o['probe_extra_vs_plain_steps_s'] * 1e3:+.0f} ms vs {p} plain steps); probe+lookup+gate extra "
          f"{o['probe_lookup_gate_extra_pct_of_full']:.2f}%; write-back {o['write_back_s']:.2f} s")
    print(f"kernels (ms, one self-attention): {res['kernels_ms']}")
    print(f"total {out['total_seconds']:.1f} s")


def main(argv=None):
    args = parse_args(argv)
    run(args)


if __name__ == "__main__":
    main()
