#!/usr/bin/env python3
"""Where a region-only hit's time goes: Wan 2.1 1.3B, 480p x 81, N=50 (ComfyUI's WanModel, random weights, bf16).

One miss is stored and plain sampling timed (warm, beside the hits); then, for each variant (how the kept keys and
values are held) and target share, one region-only hit resumed at k as gpu_compose's (probe 5, resume 25). Each
step's wall time is taken at the step boundaries (CUDA synchronised): the probe's full steps, the full step k that
captures the other tokens' keys and values, and the region steps; the hit's whole time beside them. torch.profiler
records one full step of the probe (the baseline: a plain step) and --profile-steps region steps of each hit: ops by
self GPU time, and how much of the steps' wall time the GPU was busy (below 100 %: the steps wait on the CPU); after
each hit, the host-to-GPU copy rate (host_link_gbps). Before the timed hits, one untimed hit of each variant takes
the first run's costs (pinning host memory).

Variants: streamed (the default: the target attends on FlashAttention-4 where it is installed; the kept keys and
values, in 8 bits dequantized by the Triton kernel, that do not fit within the memory plain sampling needed are
streamed from pinned host memory), torch (region_kv_triton off: the 8 bits dequantized by torch's multiply),
resident (region_memory_margin 100: every block on the GPU), 16-bit (region_kv_8bit off: kept in the model's 16
bits, streamed as the default's), host kernel (region_fa4 off: the target attends through the host's kernel even
where FlashAttention-4 is installed), easycache and easycache host kernel (the same on the model with ComfyUI's
EasyCache node, --easycache-threshold, from a miss stored with it). Each case lists every step's milliseconds in
order (step_s.sequence: the probe, step k's capture, the first region step's placement, ...).
--profile-steps 0 profiles nothing, so that every hit's seconds are unprofiled.

  python3 benchmarks/region_profile.py --out benchmarks/results/gpu/region_profile_h200.json
  python3 benchmarks/region_profile.py --smoke --out /tmp/region_profile.json          # tiny, CPU
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from gpu_host import (PRESETS, PROMPT, TEXT_DIM, Peak, build_model, elapsed_logger, find_comfyui,  # noqa: E402
                      host_arguments, import_comfy, machine_facts, median, plain_sample, region_hits, shares_list,
                      sync, timed, with_easycache, write_report)

VARIANTS = {"streamed": {}, "torch": {"region_kv_triton": False}, "resident": {"region_memory_margin": 100.0},
            "16-bit": {"region_kv_8bit": False}, "host kernel": {"region_fa4": False}, "easycache": {},
            "easycache host kernel": {"region_fa4": False}}


def parse_args(argv=None):
    parser = host_arguments(__doc__)
    parser.add_argument("--shares", type=shares_list, default=[0.1, 0.3], help="target shares of the hits")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"how the kept keys and values are held, of {', '.join(VARIANTS)}")
    parser.add_argument("--profile-steps", type=int, default=3,
                        help="region steps each profile records (0: none, every hit timed unprofiled)")
    parser.add_argument("--easycache-threshold", type=float, default=0.4,
                        help="EasyCache's reuse_threshold in the easycache variant (start 0.15, end 0.95)")
    parser.add_argument("--refresh-steps", type=int, default=2,
                        help="CarnatorConfig.region_refresh_steps of every hit (default 2, the product's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown or not args.variants:
        parser.error(f"--variants: {', '.join(unknown) or 'none given'}; choose from {', '.join(VARIANTS)}")
    if args.profile_steps < 0:
        parser.error("--profile-steps must be 0 or more")
    if not 0 < args.easycache_threshold < 10:
        parser.error("--easycache-threshold must be above 0 and below 10 (EasyCache's own range)")
    return args


class StepClock:
    """Wraps GenerationObserver.begin_step while installed: the time each step began (synchronised) and its kind
    ("full" or "region"), and a torch.profiler over the steps `profiled` names (kind, first step, how many)."""

    def __init__(self, observer_class, cuda: bool):
        self.observer_class, self.cuda = observer_class, cuda
        self.marks: list = []
        self.profiled = None
        self.profiles: dict = {}
        self._profiler = None
        self._original = observer_class.begin_step

    def __enter__(self):
        clock = self

        def begin_step(observer, step, x):
            clock.tick(step, None)
            clock._original(observer, step, x)
            region = observer.region
            clock.marks[-1] = (step, clock.marks[-1][1], "region" if region is not None and region.active else "full")
            clock.profile(step, clock.marks[-1][2])
        self.observer_class.begin_step = begin_step
        return self

    def __exit__(self, *exc):
        self.observer_class.begin_step = self._original
        self.tick(None, None)
        self._stop()
        return False

    def tick(self, step, kind) -> None:
        sync()
        self.marks.append((step, time.perf_counter(), kind))

    def steps(self) -> list:
        """(step, kind, seconds) of every step that ended within the clock."""
        return [(s, kind, t1 - t0) for (s, t0, kind), (_, t1, _) in zip(self.marks, self.marks[1:]) if s is not None]

    def profile(self, step, kind) -> None:
        if self.profiled is None:
            return
        name, first, count = self.profiled
        if self._profiler is None and kind == name and step >= first:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._profiler.start()
            self._profiled_from, self._profiled_steps = time.perf_counter(), 0
        elif self._profiler is not None:
            self._profiled_steps += 1
            if self._profiled_steps == count or kind != name:
                self._stop()

    def _stop(self) -> None:
        if self._profiler is None:
            return
        sync()
        wall = time.perf_counter() - self._profiled_from
        self._profiler.stop()
        self.profiles[self.profiled[0]] = profile_table(self._profiler, wall, self._profiled_steps, self.cuda)
        self._profiler, self.profiled = None, None


class HostLink:
    """The host-to-GPU copy rate right after a hit (GB/s, median of three 512 MiB copies from pinned memory): a region
    step streams its kept keys and values over that link, so a slow hit beside a slow link points at the link."""

    def __init__(self, device: torch.device):
        self.device = device
        self.source = torch.empty(1 << 29, dtype=torch.uint8, pin_memory=True) if device.type == "cuda" else None

    def gbps(self):
        if self.source is None:
            return None                # the CPU: no link
        target = torch.empty_like(self.source, device=self.device)    # only meanwhile: the hits' peaks stay theirs
        rates = []
        for _ in range(3):
            sync()
            started = time.perf_counter()
            target.copy_(self.source, non_blocking=True)
            sync()
            rates.append(self.source.numel() / (time.perf_counter() - started) / 1e9)
        return median(rates)


def profile_table(profiler, wall: float, steps: int, cuda: bool) -> dict:
    """The profiled steps' wall time, the GPU's busy time and the top ops by self time. On CUDA the busy time sums the
    kernels and copies (on every stream: a side stream's copies overlapping the compute count too) and the ops are the
    torch ops that launched them; on the CPU both are the ops' own CPU time."""
    events = profiler.key_averages()

    def own(event):
        if cuda:
            return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        return event.self_cpu_time_total

    def on_device(event):
        return "CUDA" in str(getattr(event, "device_type", ""))
    busy = sum(own(event) for event in events if on_device(event) == cuda) / 1e6
    top = sorted((event for event in events if not on_device(event)), key=own, reverse=True)[:25]
    return {"steps": steps, "wall_s_per_step": wall / max(steps, 1), "busy_s_per_step": busy / max(steps, 1),
            "busy_share": busy / wall if wall else None, "clock": "GPU" if cuda else "CPU",
            "top_ops": [{"name": event.key, "calls_per_step": event.count / max(steps, 1),
                         "ms_per_step": own(event) / 1e3 / max(steps, 1)} for event in top]}


def run(args):
    preset = dict(PRESETS["smoke" if args.smoke else "real"])
    n, p, k = preset["steps"], preset["probe"], preset["resume"]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    version = import_comfy(find_comfyui(args.comfyui), cpu=not cuda)
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    started = time.perf_counter()
    log = elapsed_logger(started)
    model, params = build_model(preset, device, dtype, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(tuple(preset["latent"]), generator=generator)
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=generator)
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]

    def runner_on(m):
        return ComfyRunner(m, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                           seed=args.seed)
    runner = runner_on(model)
    config = CarnatorConfig(probe_steps=p, block_size=preset["block_size"], max_density=0.3, region_only=False,
                            region_refresh_steps=args.refresh_steps)
    out = {**machine_facts(device, version), "params": params, "dtype": str(dtype),
           "config": {"steps": n, "probe": p, "resume": k, "latent": list(preset["latent"]),
                      "profile_steps": args.profile_steps}, "cases": {}}
    store_root = tempfile.mkdtemp(prefix="carnator_region_profile_")
    store = CarnatorStore(os.path.join(store_root, "store"), 16 << 30)
    try:
        with Peak() as peak, StepClock(GenerationObserver, cuda) as clock:
            clock.profiled = ("full", 2, 1)
            miss = generate(runner, noise, runner.sigmas, store, config, PROMPT, args.seed)
        if miss.decision.reuse or miss.entry_id is None:
            raise RuntimeError(f"expected a stored miss, got {miss.summary()}")
        full = [seconds for step, kind, seconds in clock.steps() if step > 0]
        out["miss"] = {"full_step_s": median(full), "peak_bytes": peak.bytes, "profile_full": clock.profiles["full"]}
        log(f"miss: full step {median(full) * 1e3:.1f} ms; profiled: "
            f"{clock.profiles['full']['busy_share']:.0%} busy")
        with Peak() as peak, timed() as span:      # after the miss: warm, as the hits are
            plain_sample(model, noise, runner.sigmas, positive, negative, args.seed)
        out["plain"] = {"seconds": span["seconds"], "peak_bytes": peak.bytes}
        log(f"plain sampling: {span['seconds']:.2f} s")
        plain_runner, easy_runner = runner, None
        link = HostLink(device)
        for variant in args.variants:
            hit_config = dataclasses.replace(config, **VARIANTS[variant])
            runner = plain_runner
            if variant.startswith("easycache"):   # its own miss: a request's step cache is part of what a hit matches
                if easy_runner is None:
                    easy_runner = runner_on(with_easycache(model, args.easycache_threshold))
                    generate(easy_runner, noise, easy_runner.sigmas, store, config, PROMPT, args.seed)
                runner = easy_runner
            region_hits(runner, store, hit_config, noise, runner.sigmas, k, args.seed, args.shares[:1], log,
                        lambda latent: {}, f" {variant} (warm-up)")
            for share in args.shares:
                with StepClock(GenerationObserver, cuda) as clock:
                    clock.profiled = ("region", k + 2, args.profile_steps) if args.profile_steps else None
                    (name, case), = region_hits(runner, store, hit_config, noise, runner.sigmas, k, args.seed,
                                                [share], log, lambda latent: {}, f" {variant}").items()
                kinds, steps = {}, clock.steps()
                for step, kind, seconds in steps:
                    kinds.setdefault(kind, []).append(seconds)
                sequence = [f"{step}{kind[0]} {seconds * 1e3:.1f}" for step, kind, seconds in steps]
                case.update({"host_link_gbps": link.gbps(),
                             "speedup_vs_plain": out["plain"]["seconds"] / case["seconds"],
                             "peak_vs_plain": case["peak_bytes"] / out["plain"]["peak_bytes"] - 1
                             if out["plain"]["peak_bytes"] else None,       # the CPU has no peak to read
                             "step_s": {**{kind: {"median": median(values), "count": len(values),
                                                  "total": sum(values)} for kind, values in kinds.items()},
                                        "sequence": sequence},
                             "profile_region": clock.profiles.get("region")})
                out["cases"][name] = case
                region = case["profile_region"] or {}
                log(f"{name}: {case['seconds']:.2f} s; region step {median(kinds.get('region', [])) * 1e3:.1f} ms x "
                    f"{len(kinds.get('region', []))}, full step {median(kinds.get('full', [])) * 1e3:.1f} ms x "
                    f"{len(kinds.get('full', []))}; profiled: {region.get('busy_share') or 0:.0%} busy; host link "
                    f"{case['host_link_gbps'] or 0:.1f} GB/s")
                write_report(args.out, out)
    finally:
        store.close()
        shutil.rmtree(store_root, ignore_errors=True)
    out["total_seconds"] = time.perf_counter() - started
    write_report(args.out, out)
    print_table(out)
    return out


def print_table(out) -> None:
    print(f"\n{out['device']}, torch {out['torch']}; a full step of the miss {out['miss']['full_step_s'] * 1e3:.1f} ms")
    print(f"plain sampling {out['plain']['seconds']:.2f} s, peak {out['plain']['peak_bytes'] / 2**30:.2f} GiB")
    print(f"{'case':<28} {'s':>7} {'vs plain':>9} {'region step ms':>15} {'busy':>6} {'peak GiB':>9} {'vs plain':>9} "
          f"{'link GB/s':>10}")
    for name, case in out["cases"].items():
        region = case["step_s"].get("region", {})
        busy = (case.get("profile_region") or {}).get("busy_share")
        print(f"{name:<28} {case['seconds']:>7.2f} {case['speedup_vs_plain']:>8.2f}x "
              f"{region.get('median', float('nan')) * 1e3:>15.1f} {(busy or 0) * 100:>5.0f}% "
              f"{case['peak_bytes'] / 2**30:>9.2f} {(case['peak_vs_plain'] or 0) * 100:>+8.1f}% "
              f"{case.get('host_link_gbps') or 0:>10.1f}")
    for name, profile in [("full step (miss)", out["miss"]["profile_full"])] + \
            [(name, case["profile_region"]) for name, case in out["cases"].items() if case.get("profile_region")]:
        print(f"\n{name}: {profile['wall_s_per_step'] * 1e3:.1f} ms a step, {profile['clock']} busy "
              f"{profile['busy_s_per_step'] * 1e3:.1f} ms; top ops by self {profile['clock']} ms a step")
        for op in profile["top_ops"][:15]:
            print(f"  {op['ms_per_step']:8.2f}  x{op['calls_per_step']:<6.0f} {op['name'][:90]}")


if __name__ == "__main__":
    run(parse_args())
