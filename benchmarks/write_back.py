#!/usr/bin/env python3
"""What the background write-back (carnator_engine/store/write_back.py) takes off a miss, on gpu_host's Wan model.

ComfyUI's WanModel (gpu_host.build_model, random weights) through ComfyRunner, `--repeats` times, interleaved:
  plain     ComfyUI sampling alone (the baseline)
  returned  a Carnator miss on an empty store, timed until generate() returns: what a request waits for now
  written   the same call, timed on until its entry is written (result.entry_id waits): what it waited for when
            the write-back ran before the return (the same work in the same order), paired with `returned`, so
            their difference (`write_after_return`) is free of the run-to-run noise of sampling
  queueing  what the request still spends on the write-back: copies of the final latent and preview, and the submit
and a session: `--session` requests in a row on one store (different seeds; mostly misses), each waiting for its
write or not, so the overlap of one request's write with the next request's sampling is measured as well (on a CPU
they share the cores; on a GPU the write needs only the host).

Usage:
  python3 benchmarks/write_back.py --out /tmp/write_back.json                 # CPU-sized defaults
  python3 benchmarks/write_back.py --device cuda --preset real --out ...      # Wan 1.3B's real size
"""
from __future__ import annotations

import argparse
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
from gpu_host import (PRESETS, PROMPT, TEXT_DIM, build_model, find_comfyui, import_comfy, median,  # noqa: E402
                       plain_sample, timed)

CPU_PRESET = dict(PRESETS["smoke"], dim=128, layers=2, ffn=256, latent=(1, 16, 8, 32, 32), steps=10, probe=2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", choices=["cpu", "smoke", "real"], default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--session", type=int, default=3, help="requests in a row for the session rows")
    parser.add_argument("--comfyui", default=None)
    parser.add_argument("--store-dir", default=None)
    return parser.parse_args(argv)


def run(args):
    preset = CPU_PRESET if args.preset == "cpu" else PRESETS[args.preset]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    version = import_comfy(find_comfyui(args.comfyui), cpu=not cuda)
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    model, params = build_model(preset, device, torch.bfloat16 if cuda else torch.float32, 0)
    n = preset["steps"]
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=torch.Generator().manual_seed(0))
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    config = CarnatorConfig(probe_steps=preset["probe"], block_size=preset["block_size"])
    root = tempfile.mkdtemp(prefix="carnator_write_back_", dir=args.store_dir)
    stores = []

    def noise(seed):
        return torch.randn(tuple(preset["latent"]), generator=torch.Generator().manual_seed(seed))

    def fresh_store():
        stores.append(CarnatorStore(os.path.join(root, str(len(stores))), 16 << 30))
        return stores[-1]

    def carnator(store, seed, wait_for_the_write):
        """(the result, seconds until generate() returns, seconds until its entry is written if waited for)."""
        runner = ComfyRunner(model, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                             seed=seed)
        with timed() as returned:
            result = generate(runner, noise(seed), runner.sigmas, store, config, PROMPT, seed)
        if wait_for_the_write and result.entry_id is None:
            raise RuntimeError(f"the entry was not written: {result.warnings}")
        return result, returned["seconds"], time.perf_counter() - returned["start"]

    def plain(seed):
        sigmas = ComfyRunner.schedule(model, "euler", "simple", n)
        with timed() as span:
            plain_sample(model, noise(seed), sigmas, positive, negative, seed)
        return span["seconds"]

    out = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "comfyui_version": version, "params": params,
           "preset": {**preset, "latent": list(preset["latent"])}, "repeats": args.repeats}
    try:
        plain(0), carnator(fresh_store(), 0, True)     # warm-ups, not counted
        times = {"plain": [], "returned": [], "written": [], "queueing": []}
        for _ in range(args.repeats):
            times["plain"].append(plain(1))
            result, returned, written = carnator(fresh_store(), 1, True)
            if result.decision.reuse:
                raise RuntimeError(f"expected a miss on an empty store, got {result.summary()}")
            times["returned"].append(returned), times["written"].append(written)
            times["queueing"].append(result.seconds["write_back"])
        out["entry_bytes"] = stores[-1].stats()["entry_bytes"]
        session = {}
        for waits in (True, False):     # the same requests in the same order: the gate decides alike in both
            store = fresh_store()
            started = time.perf_counter()
            hits = sum(carnator(store, seed, waits)[0].decision.reuse for seed in range(2, 2 + args.session))
            store.writer.settle()
            session["waiting for each write" if waits else "in the background"] = time.perf_counter() - started
        out["session_hits"] = hits
    finally:
        for store in stores:
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: median(values) for name, values in times.items()}
    medians["write_after_return"] = median([w - r for w, r in zip(times["written"], times["returned"])])
    out.update(seconds=times, medians=medians, session_seconds=session,
               returned_vs_plain_pct=100 * (medians["returned"] / medians["plain"] - 1),
               written_vs_plain_pct=100 * (medians["written"] / medians["plain"] - 1))
    reports.write(args.out, out)
    print(f"{out['device']} ({out['cpu_count']} cores), latent {preset['latent']}, N={n}, entry "
          f"{out['entry_bytes'] / 2**20:.1f} MiB, {args.repeats} repeats, medians:")
    print(f"  plain ComfyUI                          {medians['plain']:.3f} s")
    print(f"  miss, until it returns (now)           {medians['returned']:.3f} s  "
          f"{out['returned_vs_plain_pct']:+.1f} %")
    print(f"  miss, until its entry is written       {medians['written']:.3f} s  "
          f"{out['written_vs_plain_pct']:+.1f} %")
    print(f"  the write after the return (paired)    {medians['write_after_return'] * 1e3:.1f} ms")
    print(f"  the write-back inside the request      {medians['queueing'] * 1e3:.1f} ms (copies, submit)")
    for name, seconds in session.items():
        print(f"  {args.session} requests in a row ({hits} hits), {name}: {seconds:.2f} s")
    return out


if __name__ == "__main__":
    run(parse_args())
