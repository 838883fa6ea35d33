#!/usr/bin/env python3
"""Where a Carnator miss spends its time beyond plain ComfyUI sampling (gpu_host.py's Wan2.1-1.3B setup).

Plain sampling and a miss on an empty store run interleaved --repeats times (the order alternating, so the GPU's
warming falls on both), CUDA synchronised at each end only.
Each step's end is marked by a CUDA event in the sampler callback, so the per-step GPU durations of plain and miss
sit side by side without a synchronisation inside the run; the miss's parts (pipeline's `seconds`) and the CPU time
of the host calls a miss makes more often than plain (sampler calls, model loads, the lookup) are summed by
wrapping them. One more plain and one more miss run under torch.profiler: GPU kernel time, and the count and CPU time
of the CUDA runtime calls that stall the CPU or the GPU (synchronisations, copies, allocations), side by side.

  python3 benchmarks/miss_profile.py --out benchmarks/results/gpu/miss_profile_h200.json
  python3 benchmarks/miss_profile.py --steps 4 --probe 1 --out $OUT/miss_profile_4step.json   # a few-step schedule
  python3 benchmarks/miss_profile.py --smoke --out /tmp/miss_profile.json      # tiny, CPU
"""
from __future__ import annotations

import collections
import functools
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
from gpu_host import (PRESETS, PROMPT, TEXT_DIM, build_model, elapsed_logger, find_comfyui,  # noqa: E402
                       host_arguments, import_comfy, median, plain_sample, timed)

RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
                 "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaFreeHost", "cudaMemGetInfo",
                 "cudaLaunchKernel")


def parse_args(argv=None):
    parser = host_arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler pair")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="sampler steps (default: the preset's, 50 real)")
    parser.add_argument("--probe", type=int, default=None, help="probe steps (default: the preset's, 5 real)")
    parser.add_argument("--risk", default="balanced", choices=("safe", "balanced", "aggressive"),
                        help="the miss's risk level: at 8 steps or fewer only aggressive records the connectivity")
    args = parser.parse_args(argv)
    preset = PRESETS["smoke" if args.smoke else "real"]
    args.steps, args.probe = args.steps or preset["steps"], args.probe or preset["probe"]
    if not 1 <= args.probe < args.steps:
        parser.error(f"--probe {args.probe} must be between 1 and --steps - 1 ({args.steps - 1})")
    return args


class StepEvents:
    """Sampler callback: a CUDA event (or, on the CPU, the wall clock) at each step's end, without synchronising."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks = []

    def start(self):
        self.marks = [(-1, self._mark())]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def __call__(self, step, *_):
        self.marks.append((int(step), self._mark()))

    def durations_ms(self) -> list:
        """(step, ms since the previous mark): the first is measured from start()."""
        out = []
        for (_, a), (step, b) in zip(self.marks, self.marks[1:]):
            out.append((step, a.elapsed_time(b) if self.cuda else (b - a) * 1e3))
        return out


class CallTimes:
    """Wraps named functions in place and sums the CPU time and count of their calls (restore() undoes it)."""

    def __init__(self, targets: dict):
        self.totals = collections.defaultdict(lambda: [0, 0.0])
        self.saved = []
        for name, (owner, attribute) in targets.items():
            original = getattr(owner, attribute)
            self.saved.append((owner, attribute, original))
            setattr(owner, attribute, self._timed(name, original))

    def _timed(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = self.totals[name]
                total[0] += 1
                total[1] += time.perf_counter() - started
        return wrapper

    def take(self) -> dict:
        out = {name: {"calls": c, "ms": round(s * 1e3, 2)} for name, (c, s) in sorted(self.totals.items())}
        self.totals.clear()
        return out

    def restore(self):
        for owner, attribute, original in reversed(self.saved):
            setattr(owner, attribute, original)


def profile_summary(prof) -> dict:
    """GPU kernel time and the CUDA runtime calls that stall, from a torch.profiler run."""
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0)
    runtime = {e.key: {"count": e.count, "cpu_ms": round(e.cpu_time_total / 1e3, 2)}
               for e in events if e.key in RUNTIME_CALLS}
    ops = {e.key: {"count": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 2),
                   "device_ms": round(e.self_device_time_total / 1e3, 2)} for e in events}
    return {"gpu_kernel_ms": round(kernel_us / 1e3, 1), "runtime": runtime, "ops": ops}


def op_differences(plain: dict, miss: dict, key: str, top: int = 12) -> list:
    names = set(plain["ops"]) | set(miss["ops"])
    rows = [(name, miss["ops"].get(name, {}).get(key, 0.0) - plain["ops"].get(name, {}).get(key, 0.0),
             plain["ops"].get(name, {}).get("count", 0), miss["ops"].get(name, {}).get("count", 0)) for name in names]
    rows.sort(key=lambda row: -abs(row[1]))
    return [{"op": name, f"extra_{key}": round(extra, 2), "plain_count": pc, "miss_count": mc}
            for name, extra, pc, mc in rows[:top]]


def run(args):
    preset = dict(PRESETS["smoke" if args.smoke else "real"])
    preset.update(steps=args.steps, probe=args.probe)
    n, p = preset["steps"], preset["probe"]
    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = torch.device(device_name).type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    version = import_comfy(find_comfyui(args.comfyui), cpu=not cuda)
    import comfy.model_management
    import comfy.sample
    import comfy.sampler_helpers
    from carnator_engine import pipeline, resume
    from carnator_engine.attention.connectivity import ConnectivityRecorder
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import CheckpointRecorder
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    started = time.perf_counter()
    log = elapsed_logger(started)
    model, params = build_model(preset, torch.device(device_name), dtype, args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(tuple(preset["latent"]), generator=gen)
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=gen)
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    config = CarnatorConfig(probe_steps=p, block_size=preset["block_size"], max_density=0.3, risk=args.risk)
    sigmas = ComfyRunner.schedule(model, "euler", "simple", n)
    store_root = tempfile.mkdtemp(prefix="carnator_miss_profile_")
    events = StepEvents(cuda)
    calls = CallTimes({
        "comfy.sample.sample_custom": (comfy.sample, "sample_custom"),
        "load_models_gpu": (comfy.model_management, "load_models_gpu"),
        "prepare_sampling": (comfy.sampler_helpers, "prepare_sampling"),
        "ComfyRunner._patched_clone": (ComfyRunner, "_patched_clone"),
        "ComfyRunner.run": (ComfyRunner, "run"),
        "pipeline.request_identity": (pipeline, "request_identity"),
        "pipeline._repeated": (pipeline, "_repeated"),
        "pipeline.new_bucket_reasons": (pipeline, "new_bucket_reasons"),
        "pipeline.warm_denoised_projection": (pipeline, "warm_denoised_projection"),
        "resume.finish": (resume, "finish"),
        "pipeline.replay": (pipeline, "replay"),
        "pipeline.lookup": (pipeline, "lookup"),
        "pipeline.decide": (pipeline, "decide"),
        "pipeline._queue_write": (pipeline, "_queue_write"),
        "SignatureRecorder.signature": (pipeline.SignatureRecorder, "signature"),
        "SignatureRecorder.block_output": (pipeline.SignatureRecorder, "block_output"),
        "SignatureRecorder.self_attention": (pipeline.SignatureRecorder, "self_attention"),
        "SignatureRecorder.denoised": (pipeline.SignatureRecorder, "denoised"),
        "CheckpointRecorder.record": (CheckpointRecorder, "record"),
        "ConnectivityRecorder.self_attention": (ConnectivityRecorder, "self_attention"),
        "ConnectivityRecorder.tensors": (ConnectivityRecorder, "tensors"),
        "runner.preview": (ComfyRunner, "preview"),
    })
    stores = []
    out = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
           "torch": torch.__version__, "comfyui_version": version, "params": params, "dtype": str(dtype),
           "config": {"steps": n, "probe": p, "risk": args.risk, "latent": list(preset["latent"]), "repeats": args.repeats},
           "runs": []}

    def plain():
        events.start()
        with timed() as span:
            plain_sample(model, noise, sigmas, positive, negative, args.seed, callback=events)
        return {"seconds": span["seconds"], "steps_ms": events.durations_ms()}

    def miss():
        stores.append(CarnatorStore(os.path.join(store_root, str(len(stores))), 4 << 30))
        runner = ComfyRunner(model, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                             seed=args.seed, step_callback=events)
        events.start()
        with timed() as span:
            result = generate(runner, noise, runner.sigmas, stores[-1], config, PROMPT, args.seed)
        entry = result.entry_id
        if result.decision.reuse or entry is None:
            raise RuntimeError(f"expected a stored miss, got {result.summary()}")
        return {"seconds": span["seconds"], "steps_ms": events.durations_ms(), "parts_s": result.seconds}

    try:
        plain()
        miss()   # warm-ups: the first sampler call and the first miss (projections, allocator) stay out of the runs
        calls.take()
        for i in range(args.repeats):
            row = {}
            for case, work in (("plain", plain), ("miss", miss))[::1 if i % 2 == 0 else -1]:   # order alternating
                row.update({case: work(), case + "_calls": calls.take()})
            out["runs"].append(row)
            log(f"#{i + 1}: plain {row['plain']['seconds']:.3f} s, miss {row['miss']['seconds']:.3f} s "
                f"(+{100 * (row['miss']['seconds'] / row['plain']['seconds'] - 1):.2f} %)")
            reports.write(args.out, out)
        if not args.no_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            profiled = {}
            for name, case in (("plain", plain), ("miss", miss)):
                with torch.profiler.profile(activities=activities) as prof:
                    wall = case()["seconds"]
                profiled[name] = {"seconds": wall, **profile_summary(prof)}
            out["profiled"] = {name: {k: v for k, v in summary.items() if k != "ops"}
                               for name, summary in profiled.items()}
            out["extra_ops_device_ms"] = op_differences(profiled["plain"], profiled["miss"], "device_ms")
            out["extra_ops_self_cpu_ms"] = op_differences(profiled["plain"], profiled["miss"], "self_cpu_ms")
    finally:
        calls.restore()
        for store in stores:
            store.close()
        shutil.rmtree(store_root, ignore_errors=True)
    out["summary"] = summarise(out["runs"], p)
    out["total_seconds"] = time.perf_counter() - started
    reports.write(args.out, out)
    print_report(out)
    return out


def summarise(runs: list, probe_steps: int) -> dict:
    """Medians over the runs: totals, and where the extra falls (before the first step, the probe's steps, the
    step after the probe, the other steps)."""
    def span(case, first, last):
        return sum(ms for step, ms in case["steps_ms"] if first <= step <= last)
    parts = collections.defaultdict(list)
    for row in runs:
        plain, miss = row["plain"], row["miss"]
        steps = max(step for step, _ in plain["steps_ms"])
        parts["plain_s"].append(plain["seconds"])
        parts["miss_s"].append(miss["seconds"])
        parts["extra_pct"].append(100 * (miss["seconds"] / plain["seconds"] - 1))
        for name, first, last in (("first_step", 0, 0), ("probe_steps_1_to_p-1", 1, probe_steps - 1),
                                  ("step_p", probe_steps, probe_steps), ("steps_after_p", probe_steps + 1, steps)):
            parts[f"extra_ms_{name}"].append(span(miss, first, last) - span(plain, first, last))
        parts["extra_ms_after_last_step"].append(1e3 * (miss["seconds"] - plain["seconds"]) - (
            span(miss, 0, steps) - span(plain, 0, steps)))
    return {name: round(median(values), 3) for name, values in parts.items()}


def print_report(out):
    s = out["summary"]
    print(f"\nA Carnator miss vs plain ComfyUI: {out['device']}, torch {out['torch']}, N={out['config']['steps']} "
          f"p={out['config']['probe']}, medians of {out['config']['repeats']} interleaved pairs")
    print(f"plain {s['plain_s']:.3f} s, miss {s['miss_s']:.3f} s, extra {s['extra_pct']:+.2f} %")
    print("| where | extra ms |\n|---|---|")
    for name, value in s.items():
        if name.startswith("extra_ms_"):
            print(f"| {name[len('extra_ms_'):]} | {value:+.1f} |")
    for name, value in (out["runs"][-1]["miss_calls"] if out["runs"] else {}).items():   # medians over the runs
        times = {case: median([run[case + "_calls"].get(name, {"ms": 0.0})["ms"] for run in out["runs"]])
                 for case in ("miss", "plain")}
        plain_calls = out["runs"][-1]["plain_calls"].get(name, {"calls": 0})["calls"]
        print(f"  {name}: miss {value['calls']} calls {times['miss']:.2f} ms, plain {plain_calls} calls "
              f"{times['plain']:.2f} ms")
    for name, summary in out.get("profiled", {}).items():
        runtime = ", ".join(f"{k} {v['count']}x {v['cpu_ms']} ms" for k, v in sorted(summary["runtime"].items()))
        print(f"profiled {name}: {summary['seconds']:.3f} s, GPU kernels {summary['gpu_kernel_ms']} ms; {runtime}")
    for row in out.get("extra_ops_device_ms", [])[:8]:
        print(f"  extra GPU: {row}")
    for row in out.get("extra_ops_self_cpu_ms", [])[:8]:
        print(f"  extra CPU: {row}")


def main(argv=None):
    run(parse_args(argv))


if __name__ == "__main__":
    main()
