#!/usr/bin/env python3
"""Carnator with ComfyUI's EasyCache, side by side, at Wan2.1-T2V-1.3B size (gpu_host.py's setup: ComfyUI's
WanModel with random weights, 480p x 81 frames, bf16, euler/simple, N=50, p=5, k=25, the 0.3 density budget).

Cases, CUDA synchronised, model calls counted at the diffusion model (a DIFFUSION_MODEL wrapper after
EasyCache's, so it counts forwards that ran); at cfg 1 plain, miss and hit are the median of --repeats runs, plain
and miss interleaved in alternating order:
  plain                 ComfyUI sampling, no Carnator (the baseline of every speedup and difference)
  easycache             ComfyUI's EasyCache node alone, at the threshold of --easycache-thresholds whose calls
                        come nearest N/2 (about 2x); every threshold tried is reported
  miss                  Carnator on an empty store (probe + rest; the entry is written in the background after
                        the request returns, waited for outside the timed span and reported as write_after_s)
  hit                   the same request a hair off, resumed at k with the entry's sparse attention
  miss+easycache        Carnator on an empty store with EasyCache on the model: should equal easycache
  hit+easycache         its hit: steps k..N under EasyCache
  region hit N%         the hit resumed region-only (CarnatorConfig.region_only) with its target forced to N % of
                        the tokens, halo included (--region-shares; random weights give no target region of their own)
  region hit N%+easycache   the same on the EasyCache model
  region hit N% resident    the region-only hit with every block's kept keys and values on the GPU
                        (region_memory_margin 100; --region-resident-shares), beside the default's bounded memory
                        (blocks beyond the memory plain sampling needed are streamed from pinned host memory)
  region hit N% sparse keys (and +easycache)   the region-only hit with CarnatorConfig.region_sparse_keys: the
                        target attends only to the key blocks its query blocks reach in the entry's sparse
                        connectivity, so only those keys are kept and streamed (--region-sparse-shares; key_share)
  region hit N% 16-bit (and +easycache)   the region-only hit with CarnatorConfig.region_kv_8bit off: the kept keys
                        and values in the model's 16 bits, not the default's 8 (--region-16bit-shares);
                        rel_l2_vs_default: against the default's region-only hit at the same share, where it ran
  region hit N% no refresh   the region-only hit without refresh steps (region_refresh_steps 0, the default 2:
                        full steps from the cached trajectory's checkpoints; --region-refresh0-shares)
  cfg5 plain / easycache / miss / hit   the same with cfg 5 (cond + uncond)
Relative L2 differences are against plain (and, for miss+easycache, against easycache alone). The gate runs with
its defaults (no overrides); a hit it accepts at another checkpoint than k is forced to k (gpu_host.carnator_hit).
Warm-ups first, out of every timed span: 2 dense steps, then a short Carnator miss and 2 sparse steps with its
connectivity at this shape (the block-sparse kernel's compile); before the first region-only hit, one region-only hit
untimed (it pins the host memory the kept keys and values are copied into, which later hits of the process reuse;
its seconds are reported as region_warm_up_s).
Goals: hit+easycache >= 3.5x plain and >= 1.6x easycache; miss+easycache within 2 % of easycache; the plain miss
within 1 % of plain; region-only hit >= 3.6x plain at a 30 % target and >= 5x at 10 %, with EasyCache >= 5.5x; peak
GPU memory of every case within 10 % of plain's.
With --attention sage every case runs with SageAttention (the `sageattention` package's Triton kernels, through
ComfyUI's attention_sage as an optimized_attention_override, as KJNodes' "sageattn" override installs it), so each
speedup is against plain sampling with the same patch; one extra case, "plain (default attention)", times the
model without it. A hit attends sparsely with Carnator's kernel where its cached connectivity applies and through
SageAttention elsewhere (cross-attention, dense blocks).
With --compile the model is compiled as ComfyUI's TorchCompileModel compiles it (the whole diffusion model,
--compile-backend, inductor by default) and plain, miss, hit and the region-only hits run compiled, warm: the warm-ups
(each path run at two schedule lengths, and the region warm-up) take the compiles,
reported apart as compile.warm_up_s, and any compile inside the timed cases is counted (compile.compiles_in_cases,
0 when the timings hold no compile); one extra case, "plain (uncompiled)", times the model as it is. cfg 5 and the
EasyCache cases are left out (EasyCache inside a compiled model recompiles it at every step, with or without
Carnator). Goals: the compiled miss within 1 % of compiled plain; the compiled hit >= 2.2x compiled plain.

  python3 benchmarks/gpu_compose.py --out benchmarks/results/gpu/gpu_compose_h200.json
  python3 benchmarks/gpu_compose.py --smoke --out /tmp/compose.json      # tiny, CPU
  python3 benchmarks/gpu_compose.py --attention sage --skip-cfg5 --repeats 1 --easycache-thresholds 0.4 \
      --out benchmarks/results/gpu/gpu_compose_sage_h200.json
  python3 benchmarks/gpu_compose.py --compile --repeats 1 --region-shares 0.3 --region-resident-shares "" \
      --out benchmarks/results/gpu/gpu_compose_compile_h100.json
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

from gpu_host import (PRESETS, PROMPT, TEXT_DIM, Peak, build_model, carnator_hit, elapsed_logger,  # noqa: E402
                       find_comfyui, host_arguments, import_comfy, machine_facts, median, plain_sample, region_hits,
                       rel_diff, shares_list, timed, with_easycache, write_report)


ONOFF_SETTINGS = {"region_kv_triton": "8-bit kept keys and values dequantized by the Triton kernel",
                  "region_fa4": "a region step's target attention on FlashAttention-4 where it is installed"}


def parse_args(argv=None):
    parser = host_arguments(__doc__)
    parser.add_argument("--easycache-thresholds", default="0.2,0.3,0.4",
                        help="EasyCache reuse_threshold values tried; the one nearest 2x is used")
    parser.add_argument("--easycache-start", type=float, default=0.15)
    parser.add_argument("--easycache-end", type=float, default=0.95)
    parser.add_argument("--max-density", type=float, default=0.3)
    parser.add_argument("--store-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-cfg5", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="runs of plain, miss and hit at cfg 1 (median)")
    parser.add_argument("--region-shares", type=shares_list, default=[0.1, 0.3, 0.5],
                        help="target shares of the region-only hits (alone and with EasyCache); empty: none")
    parser.add_argument("--region-resident-shares", type=shares_list, default=[0.1],
                        help="target shares of region-only hits with every kept key and value on the GPU "
                             "(region_memory_margin 100), beside the bounded default; empty: none")
    parser.add_argument("--region-sparse-shares", type=shares_list, default=[],
                        help="target shares of region-only hits with region_sparse_keys (alone and with EasyCache), "
                             "beside the others; empty (default): none")
    parser.add_argument("--region-refresh0-shares", type=shares_list, default=[],
                        help="target shares of region-only hits without refresh steps (region_refresh_steps 0), "
                             "beside the default's; empty (default): none")
    parser.add_argument("--region-16bit-shares", type=shares_list, default=[],
                        help="target shares of region-only hits with region_kv_8bit off (alone and with EasyCache); "
                             "empty: none")
    for setting, what in ONOFF_SETTINGS.items():
        parser.add_argument("--" + setting.replace("_", "-"), choices=("default", "on", "off"), default="default",
                            help=f"CarnatorConfig.{setting} ({what}) for every case; default: the product's")
    parser.add_argument("--attention", choices=("default", "sage"), default="default",
                        help="sage: every case with SageAttention's Triton kernels (the sageattention package)")
    parser.add_argument("--compile", action="store_true",
                        help="every case on the model compiled as ComfyUI's TorchCompileModel does "
                             "(cfg 1, no EasyCache)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile")
    args = parser.parse_args(argv)
    args.skip_cfg5 = args.skip_cfg5 or args.compile
    return args


class SageAttention:
    """ComfyUI's attention_sage as an optimized_attention_override on a clone of the model, with its kernel calls
    counted: attention_sage falls back to PyTorch's attention when the kernel raises, and a benchmark must not
    report that fallback as SageAttention."""

    def __init__(self):
        import comfy.ldm.modules.attention as attention
        if not getattr(attention, "SAGE_ATTENTION_IS_AVAILABLE", False):
            raise SystemExit("--attention sage: the sageattention package is not importable here")
        from carnator_engine.hosts.compiled import eager_frame
        self.calls, self.failures = 0, []
        kernel = attention.sageattn

        @eager_frame      # with --compile: the count stays out of traced code
        def counted_kernel(*args, **kwargs):
            self.calls += 1
            try:
                return kernel(*args, **kwargs)
            except Exception as error:
                self.failures.append(f"{type(error).__name__}: {error}")
                raise
        attention.sageattn = counted_kernel

        def override(func, *args, **kwargs):
            return attention.attention_sage.__wrapped__(*args, **kwargs)
        override.carnator_fingerprint = "sageattention (attention_sage)"
        self.override = override

    def on(self, model):
        clone = model.clone()
        clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = self.override
        return clone

    def check(self):
        if self.failures or not self.calls:
            raise RuntimeError(f"SageAttention did not run: {self.calls} kernel calls, failures {self.failures[:3]}")


_CALLS = [0]       # diffusion model forwards since the last counted(): one case runs at a time


def _count(executor, *args, **kwargs):
    _CALLS[0] += 1
    return executor(*args, **kwargs)


_count.carnator_fingerprint = ""


def counted(model):
    """A clone whose diffusion model forwards are counted (declared an observer: not part of Carnator's key). One
    wrapper for every case, its frame never compiled (with --compile, a counter read in traced code would recompile the
    model at every call, and a new wrapper per case would recompile it per case)."""
    from comfy.patcher_extension import WrappersMP
    from carnator_engine.hosts.compiled import eager_frame
    clone = model.clone()
    _CALLS[0] = 0
    clone.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, "carnator_bench_counter", eager_frame(_count))
    return clone, _CALLS


def compiled(model, backend):
    """The model compiled as ComfyUI's TorchCompileModel node compiles it (its whole diffusion model)."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    clone = model.clone()
    set_torch_compile_wrapper(clone, backend=backend)
    return clone


class Compiles:
    """The frames torch compiles while the benchmark runs (dynamo's compile-start callback)."""

    def __init__(self):
        from torch._dynamo import callback_handler
        self.ids = []
        callback_handler.register_start_callback(lambda args: self.ids.append(str(args.compile_id)))

    def __len__(self):
        return len(self.ids)


def run(args):
    preset = dict(PRESETS["smoke" if args.smoke else "real"])
    n, p, k = preset["steps"], preset["probe"], preset["resume"]
    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = torch.device(device_name)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    comfy_path = find_comfyui(args.comfyui)
    version = import_comfy(comfy_path, cpu=not cuda)
    from carnator_engine.attention.connectivity import plan_from_tensors
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    started = time.perf_counter()
    model, params = build_model(preset, device, dtype, args.seed)
    default_model, sage = model, None
    if args.attention == "sage":
        sage = SageAttention()
        model = sage.on(model)
    uncompiled, compiles = model, None
    if args.compile:
        model, compiles = compiled(model, args.compile_backend), Compiles()
    gen = torch.Generator().manual_seed(args.seed)
    latent_shape = tuple(preset["latent"])
    noise = torch.randn(latent_shape, generator=gen)
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=gen)
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    # "hit" is the whole-clip hit; the region-only cases turn region_only on with their forced targets
    config = CarnatorConfig(probe_steps=p, block_size=preset["block_size"], max_density=args.max_density,
                            region_only=False)
    for setting in ONOFF_SETTINGS:
        if getattr(args, setting) != "default":
            config = dataclasses.replace(config, **{setting: getattr(args, setting) == "on"})
    sparse_keys = dataclasses.replace(config, region_sparse_keys=True)
    sixteen_bit = dataclasses.replace(config, region_kv_8bit=False)
    out = {**machine_facts(device, version), "params": params, "dtype": str(dtype),
           "attention": args.attention, "compile": {"backend": args.compile_backend} if args.compile else None,
           "config": {"steps": n, "probe": p, "resume": k, "latent": list(latent_shape), "repeats": args.repeats,
                      "max_density": args.max_density, "region_kv_triton": config.region_kv_triton,
                      "region_fa4": config.region_fa4,
                      "easycache_start": args.easycache_start,
                      "easycache_end": args.easycache_end}, "gate_overrides": {}, "cases": {}, "easycache_sweep": {}}
    cases = out["cases"]
    latents = {}
    region_latents = {}      # case name -> the region-only hit's latent (the 16-bit cases are compared with them)
    store_root = tempfile.mkdtemp(prefix="carnator_gpu_compose_", dir=args.store_dir)
    stores = []

    def save():
        write_report(args.out, out)

    log = elapsed_logger(started)

    def new_store(name):
        stores.append(CarnatorStore(os.path.join(store_root, f"{len(stores)}_{name}"), 16 << 30))
        return stores[-1]

    def easycache_model(threshold):
        return with_easycache(model, threshold, args.easycache_start, args.easycache_end)

    def runner_for(m, cfg, steps=n):
        return ComfyRunner(m, positive, negative, cfg=cfg, sampler_name="euler", scheduler="simple", steps=steps,
                           seed=args.seed)

    def written(result):
        """(entry id, seconds): waits for the entry the request queued, outside the timed span. Called first after
        the request: anything that reads result.entry_id before it would already have waited."""
        returned = time.perf_counter()
        entry_id = result.entry_id
        return entry_id, time.perf_counter() - returned

    def plain(m, cfg, label):
        m, calls = counted(m)
        sigmas = ComfyRunner.schedule(m, "euler", "simple", n)
        with Peak() as peak, timed() as span:
            latent = plain_sample(m, noise, sigmas, positive, negative, args.seed, cfg=cfg)
        log(f"{label}: {span['seconds']:.2f} s, {calls[0]} model calls")
        return {"seconds": span["seconds"], "model_calls": calls[0], "peak_bytes": peak.bytes}, latent

    def miss(m, cfg, label):
        m, calls = counted(m)
        runner, store = runner_for(m, cfg), new_store(label)
        with Peak() as peak, timed() as span:
            result = generate(runner, noise, runner.sigmas, store, config, PROMPT, args.seed)
        entry_id, write_after = written(result)
        if result.decision.reuse or entry_id is None:
            raise RuntimeError(f"{label}: expected a stored miss, got {result.summary()}")
        facts = {"seconds": span["seconds"], "model_calls": calls[0], "parts_s": result.seconds,
                 "write_after_s": write_after, "summary_model_calls": result.model_calls,
                 "step_cache": result.step_cache, "peak_bytes": peak.bytes}
        log(f"{label}: {facts['seconds']:.2f} s, {calls[0]} calls, written {facts['write_after_s']:.2f} s after the "
            f"return {({name: round(v, 3) for name, v in result.seconds.items()})}")
        return facts, runner, store, calls, runner.to_latent_format(result.latent)

    def hit(runner, store, calls, label):
        calls[0] = 0
        with Peak() as peak:
            facts, result, _ = carnator_hit(runner, store, config, noise, runner.sigmas, k, args.seed)
        entry_id, write_after = written(result)
        case = {"seconds": facts["seconds"], "model_calls": calls[0], "resume_step": facts["resume_step"],
                "gate_resume_step": facts["gate_resume_step"], "density": facts["plan_mean_density"],
                "probe_s": facts["probe_s"], "lookup_gate_s": facts["lookup_gate_s"],
                "resume_s": facts["resume_and_write_s"], "write_after_s": write_after,
                "summary_model_calls": result.model_calls, "step_cache_skipped": result.step_cache_skipped,
                "peak_bytes": peak.bytes}
        store.delete(entry_id)   # a repeat resumes from the miss's entry, not from this hit's (no step k)
        log(f"{label}: {case['seconds']:.2f} s, {calls[0]} calls (probe {case['probe_s']:.2f}, lookup+gate "
            f"{case['lookup_gate_s'] * 1e3:.1f} ms, resume {case['resume_s']:.2f}), k={case['resume_step']} (gate "
            f"{case['gate_resume_step']}), density {case['density']:.3f}")
        return case, runner.to_latent_format(result.latent)

    def region(runner, store, calls, reference, suffix="", shares=None, hit_config=config):
        """The region-only hits (with `hit_config`) at every share of `shares` (--region-shares by default), calls
        counted at the diffusion model as for the others; one that fails is reported in out["region_errors"] and the
        run goes on (the cases before it are kept)."""
        found = {}
        shares = args.region_shares if shares is None else shares
        # sparse keys and 16 bits keep blocks of other sizes: their pinned host memory is another warm-up's
        warm_up = "region_sparse_keys_warm_up_s" if hit_config.region_sparse_keys else \
            "region_16bit_warm_up_s" if not hit_config.region_kv_8bit else "region_warm_up_s"
        if shares and warm_up not in out:
            out[warm_up] = None
            before = len(compiles or ())
            try:
                with timed() as span:
                    region_hits(runner, store, hit_config, noise, runner.sigmas, k, args.seed, shares[:1], log,
                                lambda latent: {}, " (warm-up)")
                out[warm_up] = span["seconds"]
                if compiles is not None:
                    out["compile"]["region_warm_up_compiles"] = \
                        out["compile"].get("region_warm_up_compiles", 0) + len(compiles) - before
            except Exception:
                out.setdefault("region_errors", {})[warm_up] = traceback.format_exc()
                log(f"region warm-up FAILED:\n{traceback.format_exc()}")
        latest = {}     # the hit region_hits just ran: its latent, kept under its case name below

        def difference(latent):
            latent = latest["latent"] = runner.to_latent_format(latent)
            return {"rel_l2_vs_plain": rel_diff(latent, reference)}

        for share in shares:
            calls[0] = 0
            try:
                (name, case), = region_hits(runner, store, hit_config, noise, runner.sigmas, k, args.seed, [share],
                                            log, difference, suffix).items()
            except Exception:
                out.setdefault("region_errors", {})[f"{share:.0%}{suffix}"] = traceback.format_exc()
                log(f"region hit {share:.0%}{suffix} FAILED:\n{traceback.format_exc()}")
                continue
            found[name] = {**case, "model_calls": calls[0]}
            region_latents[name] = latest["latent"]
            default = region_latents.get(name.replace(" 16-bit", ""))
            if not hit_config.region_kv_8bit and default is not None:
                found[name]["rel_l2_vs_default"] = rel_diff(region_latents[name], default)
        return found

    def median_case(runs):
        middle = sorted(runs, key=lambda run_: run_["seconds"])[(len(runs) - 1) // 2]
        return {**middle, "seconds": median([run_["seconds"] for run_ in runs]),
                "runs_s": [run_["seconds"] for run_ in runs]}

    try:
        sigmas = ComfyRunner.schedule(model, "euler", "simple", n)
        warming = time.perf_counter()
        warm_model = counted(model)[0]    # the timed cases' model, counter included (compiled: the same graphs)
        with timed() as span:
            # compiled: 2 steps, then 3: dynamo guards on the schedule's length (transformer_options["sample_sigmas"]),
            # and a second length compiles the graphs for any; then the timed runs' own length, since on the H100
            # plain sampling at N still compiled once inside its timing (compiles_in_cases 1) after the two
            for short in ((3, 4, n + 1) if args.compile else (3,)):
                plain_sample(warm_model, noise, sigmas[:short], positive, negative, args.seed)
        log(f"warm-up dense (2 steps) {span['seconds']:.1f} s")
        with timed() as span:    # the Carnator path and the block-sparse kernel at this shape, out of the timings
            warm_steps = min(n, 10)
            warm = runner_for(warm_model, 1.0, warm_steps)
            warm_config = CarnatorConfig(probe_steps=2, block_size=preset["block_size"], max_density=args.max_density)
            warm_result = generate(warm, noise, warm.sigmas, new_store("warm-up"), warm_config, PROMPT, args.seed)
            connectivity = stores[-1].trajectory(stores[-1].record(warm_result.entry_id)).connectivity
            tokens = math.prod(warm.layout.token_grid(latent_shape))
            sparse = plan_from_tensors(connectivity, torch.zeros(tokens, dtype=torch.bool))
            warm.run(noise * float(warm.sigmas[warm_steps - 2]), warm.sigmas, warm_steps - 2, warm_steps,
                     GenerationObserver(sparse=sparse))
            if args.compile:     # Carnator's runs at a second schedule length (as plain's above)
                runner_for(warm_model, 1.0).run(noise, sigmas, 0, 2, GenerationObserver())
        log(f"warm-up Carnator miss ({warm_steps} steps) + 2 sparse steps {span['seconds']:.1f} s")
        out["warm_up_s"] = span["seconds"]
        if compiles is not None:
            out["compile"].update(warm_up_s=time.perf_counter() - warming, warm_up_compiles=len(compiles))
            cases["plain (uncompiled)"], latents["uncompiled"] = plain(uncompiled, 1.0, "plain (uncompiled)")
        if sage is not None:
            sage.check()
            cases["plain (default attention)"], latents["default attention"] = plain(default_model, 1.0,
                                                                                   "plain (default attention)")

        for cfg, prefix in ((1.0, ""), (5.0, "cfg5 ")):
            if cfg != 1.0 and args.skip_cfg5:
                continue
            repeats = args.repeats if cfg == 1.0 else 1
            plains, misses = [], []
            for i in range(repeats):      # interleaved, the order alternating: a drift (the GPU warming) falls on both
                for case in ("plain", "miss") if i % 2 == 0 else ("miss", "plain"):
                    if case == "plain":
                        facts, latents[prefix + "plain"] = plain(model, cfg, f"{prefix}plain #{i + 1}")
                        plains.append(facts)
                    else:
                        facts, runner, store, calls, latents[prefix + "miss"] = miss(model, cfg,
                                                                                     f"{prefix}miss #{i + 1}")
                        misses.append(facts)
            base_latent = latents[prefix + "plain"]
            cases[prefix + "plain"] = median_case(plains)
            cases[prefix + "miss"] = {**median_case(misses), "rel_l2_vs_plain": rel_diff(latents[prefix + "miss"],
                                                                                         base_latent)}
            hits = []
            for i in range(repeats):
                facts, latents[prefix + "hit"] = hit(runner, store, calls, f"{prefix}hit #{i + 1}")
                hits.append(facts)
            cases[prefix + "hit"] = {**median_case(hits), "rel_l2_vs_plain": rel_diff(latents[prefix + "hit"],
                                                                                       base_latent)}
            if cfg == 1.0:
                cases.update(region(runner, store, calls, base_latent))
                cases.update(region(runner, store, calls, base_latent, " resident", args.region_resident_shares,
                                    dataclasses.replace(config, region_memory_margin=100.0)))
                cases.update(region(runner, store, calls, base_latent, " sparse keys", args.region_sparse_shares,
                                    sparse_keys))
                cases.update(region(runner, store, calls, base_latent, " 16-bit", args.region_16bit_shares,
                                    sixteen_bit))
                cases.update(region(runner, store, calls, base_latent, " no refresh", args.region_refresh0_shares,
                                    dataclasses.replace(config, region_refresh_steps=0)))
            save()
            if args.compile:
                continue      # EasyCache inside a compiled model recompiles it at every step: not timed so
            if cfg == 1.0:   # the threshold: the one nearest 2x at cfg 1, kept for cfg 5
                for threshold in (float(t) for t in args.easycache_thresholds.split(",")):
                    facts, latents[f"easycache {threshold}"] = plain(easycache_model(threshold), cfg,
                                                                     f"easycache {threshold}")
                    out["easycache_sweep"][str(threshold)] = facts
                chosen = min(out["easycache_sweep"], key=lambda t: abs(out["easycache_sweep"][t]["model_calls"] - n / 2))
                out["easycache_threshold"] = float(chosen)
                easy, easy_latent = out["easycache_sweep"][chosen], latents[f"easycache {float(chosen)}"]
            else:
                easy, easy_latent = plain(easycache_model(out["easycache_threshold"]), cfg,
                                          f"{prefix}easycache")
            cases[prefix + "easycache"] = {**easy, "rel_l2_vs_plain": rel_diff(easy_latent, base_latent)}
            save()
            if cfg != 1.0:
                continue       # cfg 5: plain, EasyCache and the hit (the list)
            easy_model = easycache_model(out["easycache_threshold"])
            facts, runner, store, calls, miss_latent = miss(easy_model, cfg, "miss+easycache")
            cases["miss+easycache"] = {**facts, "rel_l2_vs_plain": rel_diff(miss_latent, base_latent),
                                       "rel_l2_vs_easycache": rel_diff(miss_latent, easy_latent)}
            facts, hit_latent = hit(runner, store, calls, "hit+easycache")
            cases["hit+easycache"] = {**facts, "rel_l2_vs_plain": rel_diff(hit_latent, base_latent)}
            cases.update(region(runner, store, calls, base_latent, "+easycache"))
            cases.update(region(runner, store, calls, base_latent, "+easycache sparse keys", args.region_sparse_shares,
                                sparse_keys))
            cases.update(region(runner, store, calls, base_latent, "+easycache 16-bit", args.region_16bit_shares,
                                sixteen_bit))
            save()
    finally:
        for store in stores:
            store.close()
        shutil.rmtree(store_root, ignore_errors=True)
    for name, case in cases.items():
        base = cases["cfg5 plain" if name.startswith("cfg5") else "plain"]
        case["speedup_vs_plain"] = base["seconds"] / case["seconds"]
        easy = cases.get("cfg5 easycache" if name.startswith("cfg5") else "easycache")
        if easy is not None:
            case["speedup_vs_easycache"] = easy["seconds"] / case["seconds"]
        if case.get("peak_bytes") and base.get("peak_bytes"):
            case["peak_vs_plain_pct"] = 100 * (case["peak_bytes"] / base["peak_bytes"] - 1)
    out["miss_extra_pct_vs_plain"] = 100 * (cases["miss"]["seconds"] / cases["plain"]["seconds"] - 1)
    if "miss+easycache" in cases:
        out["miss_easycache_extra_pct_vs_easycache"] = 100 * (cases["miss+easycache"]["seconds"]
                                                              / cases["easycache"]["seconds"] - 1)
    if compiles is not None:
        out["compile"]["compiles_in_cases"] = (len(compiles) - out["compile"]["warm_up_compiles"]
                                               - out["compile"].get("region_warm_up_compiles", 0))
        cases["plain (uncompiled)"]["rel_l2_vs_plain"] = rel_diff(latents["uncompiled"], latents["plain"])
    if sage is not None:
        sage.check()
        out["sage_kernel_calls"] = sage.calls
        cases["plain (default attention)"]["rel_l2_vs_plain"] = rel_diff(latents["default attention"], latents["plain"])
    out["total_seconds"] = time.perf_counter() - started
    save()
    print_table(out)
    return out


def _kept(case) -> str:
    """Where a region-only hit kept its keys and values: GiB resident on the GPU / streamed from host memory."""
    if case.get("region_streamed_bytes") is None:
        return ""
    return f"{case['region_resident_bytes'] / 2**30:.2f} / {case['region_streamed_bytes'] / 2**30:.2f}"


def print_table(out):
    c = out["config"]
    attention = " with SageAttention" if out.get("attention") == "sage" else ""
    compile_ = out.get("compile")
    easy = (f"EasyCache reuse_threshold {out['easycache_threshold']:g} (start {c['easycache_start']:g}, end "
            f"{c['easycache_end']:g}; sweep: " + ", ".join(f"{t}: {v['model_calls']} calls"
                                                          for t, v in out["easycache_sweep"].items()) + ")"
            if "easycache_threshold" in out else f"compiled ({compile_['backend']}), no EasyCache")
    print(f"\nCarnator + EasyCache{attention}: {out['device']}, torch {out['torch']}, "
          f"ComfyUI {out['comfyui_version']}, "
          f"{out['params'] / 1e9:.3f} B params, {out['dtype']}, N={c['steps']} p={c['probe']} k={c['resume']}, {easy}")
    print(f"| {'case':38} | {'seconds':>8} | {'calls':>5} | {'vs plain':>8} | {'vs EasyCache':>12} | "
          f"{'rel L2 vs plain':>15} | {'peak vs plain':>13} | {'token share':>11} | {'key share':>9} | "
          f"{'K/V GPU / streamed GiB':>22} |")
    print(f"|{'-' * 40}|{'-' * 10}|{'-' * 7}|{'-' * 10}|{'-' * 14}|{'-' * 17}|{'-' * 15}|{'-' * 13}|{'-' * 11}|"
          f"{'-' * 24}|")
    for name, case in out["cases"].items():
        rel, peak = case.get("rel_l2_vs_plain"), case.get("peak_vs_plain_pct")
        share = case.get("region_share") if case.get("region_only") else None
        keys = case.get("region_key_share") if case.get("region_only") else None
        print(f"| {name:38} | {case['seconds']:8.2f} | {case['model_calls']:>5} | {case['speedup_vs_plain']:>7.2f}x | "
              f"{case.get('speedup_vs_easycache', math.nan):>11.2f}x | "
              f"{'' if rel is None else f'{rel:.2e}':>15} | {'' if peak is None else f'{peak:+.1f} %':>13} | "
              f"{'' if share is None else f'{share:.3f}':>11} | {'' if keys is None else f'{keys:.3f}':>9} | "
              f"{_kept(case):>22} |")
    if "miss+easycache" in out["cases"]:
        miss = out["cases"]["miss+easycache"]
        print(f"miss+easycache vs easycache alone: rel L2 {miss['rel_l2_vs_easycache']:.2e}, "
              f"{out['miss_easycache_extra_pct_vs_easycache']:+.2f} % time")
    print(f"plain miss {out['miss_extra_pct_vs_plain']:+.2f} % vs plain (medians of {out['config']['repeats']})")
    if compile_:
        print(f"compile warm-up {compile_['warm_up_s']:.1f} s ({compile_['warm_up_compiles']} frames compiled, "
              f"{compile_.get('region_warm_up_compiles', 0)} more in the region warm-up); compiles inside the timed "
              f"cases: {compile_['compiles_in_cases']}")
    print(f"total {out['total_seconds']:.1f} s")


if __name__ == "__main__":
    run(parse_args())
