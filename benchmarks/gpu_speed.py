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

import argparse
import contextlib
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the engine, and benchmarks/reports when the tests import this module
sys.path[:0] = [folder for folder in (ROOT, HERE) if folder not in sys.path]

import torch  # noqa: E402

import reports  # noqa: E402  (the JSON summary every benchmark writes)

PRESETS = {
    "real": dict(dim=1536, layers=30, ffn=8960, latent=(1, 16, 21, 60, 104), text_len=512, steps=50, probe=5,
                 resume=25, block_size=128, noop_steps=6, repeats=3, kernel_reps=10),
    "smoke": dict(dim=256, layers=2, ffn=512, latent=(1, 16, 4, 16, 16), text_len=512, steps=10, probe=2,
                  resume=5, block_size=32, noop_steps=3, repeats=2, kernel_reps=3),
}
TEXT_DIM = 4096
HEAD_DIM = 128
PROMPT = "gpu speed benchmark request"


def host_arguments(doc: str) -> argparse.ArgumentParser:
    """The arguments every benchmark of this setup takes: --out, --smoke, --comfyui, --device."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-friendly size (2 layers, dim 256, N=10)")
    parser.add_argument("--comfyui", default=None, help="ComfyUI checkout (holds comfy/)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    return parser


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


# ---- host --------------------------------------------------------------------------------------

def comfyui_checkout(explicit=None):
    """The first ComfyUI checkout (holding comfy/) of --comfyui, $COMFYUI_PATH, .host/ComfyUI, /opt/ComfyUI."""
    for path in (explicit, os.environ.get("COMFYUI_PATH"), os.path.join(ROOT, ".host", "ComfyUI"), "/opt/ComfyUI"):
        if path and os.path.isfile(os.path.join(path, "comfy", "model_base.py")):
            return os.path.abspath(path)
    return None


def find_comfyui(explicit):
    path = comfyui_checkout(explicit)
    if path is None:
        raise SystemExit("gpu_speed: no ComfyUI checkout found (--comfyui, $COMFYUI_PATH, .host/ComfyUI, /opt/ComfyUI)")
    return path


def import_comfy(path, cpu):
    """Imports the parts of ComfyUI the sampler path needs, with its argument parser seeing only --cpu."""
    if path not in sys.path:
        sys.path.insert(0, path)
    saved = sys.argv
    sys.argv = [saved[0]] + (["--cpu"] if cpu else [])
    try:
        import comfy.options
        comfy.options.enable_args_parsing()
        import comfy.model_management  # noqa: F401  (parses the arguments above)
        import comfy.latent_formats  # noqa: F401
        import comfy.model_base  # noqa: F401
        import comfy.model_patcher  # noqa: F401
        import comfy.sample  # noqa: F401
        import comfy.samplers  # noqa: F401
        import comfy.supported_models_base  # noqa: F401
    finally:
        sys.argv = saved
    try:
        import comfyui_version
        version = str(comfyui_version.__version__)
    except Exception:
        version = "unknown"
    return version


def build_model(preset, device, dtype, seed):
    """ComfyUI's WAN21 model (WanModel inside) with random weights, wrapped in a ModelPatcher.

    The config class copies comfy.supported_models.WAN21_T2V's fields (importing that module would
    import every text encoder, and with them transformers)."""
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_management as mm
    import comfy.model_patcher
    import comfy.supported_models_base

    class Wan21T2V(comfy.supported_models_base.BASE):
        unet_config = {"image_model": "wan2.1", "model_type": "t2v"}
        sampling_settings = {"shift": 8.0}
        unet_extra_config = {}
        latent_format = comfy.latent_formats.Wan21
        memory_usage_factor = 0.9
        supported_inference_dtypes = [torch.float16, torch.bfloat16, torch.float32]

        def __init__(self, unet_config):
            super().__init__(unet_config)
            self.memory_usage_factor = self.unet_config.get("dim", 2000) / 2222

        def get_model(self, state_dict, prefix="", device=None):
            return comfy.model_base.WAN21(self, device=device)

    dim = preset["dim"]
    unet = dict(image_model="wan2.1", model_type="t2v", dim=dim, out_dim=16, num_heads=dim // HEAD_DIM,
                ffn_dim=preset["ffn"], num_layers=preset["layers"], patch_size=(1, 2, 2), freq_dim=256,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, in_dim=16, text_dim=TEXT_DIM)
    config = Wan21T2V(unet)
    config.set_inference_dtype(dtype, None)
    base = config.get_model({}, "", device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in base.diffusion_model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.fill_(1.0)
            elif "norm" in name and name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    params = sum(p.numel() for p in base.diffusion_model.parameters())
    patcher = comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(),
                                               offload_device=mm.unet_offload_device())
    return patcher, params


# ---- timing ------------------------------------------------------------------------------------

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def timed(timer=None):
    """CUDA-synchronised wall clock around a block: yields a dict whose "seconds" is set when the block ends.
    With a StepTimer, the timer restarts at the block's start, so its first step is timed from there."""
    if timer is not None:
        timer.reset()
    sync()
    span = {"start": time.perf_counter()}
    if timer is not None:
        timer.marks.append((-1, span["start"]))
    yield span
    sync()
    span["seconds"] = time.perf_counter() - span["start"]


class StepTimer:
    """Sampler callback: the time of each step (CUDA synchronised at every step end)."""

    def __init__(self):
        self.marks = []

    def reset(self):
        self.marks = []

    def __call__(self, step, x0, x, total):
        sync()
        self.marks.append((int(step), time.perf_counter()))

    def durations(self, first_step=1):
        """(step, seconds) of each step whose previous step ended in the same sub-run, from first_step on."""
        out = []
        for (s0, t0), (s1, t1) in zip(self.marks, self.marks[1:]):
            if s1 == s0 + 1 and s1 >= first_step:
                out.append((s1, t1 - t0))
        return out

    def step_seconds(self, first_step=1):
        return [d for _, d in self.durations(first_step)]


def elapsed_logger(started):
    """log(message): the message printed at once, after the seconds since `started`."""
    def log(message):
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", flush=True)
    return log


def median(values):
    return float(statistics.median(values)) if values else float("nan")


def kernel_ms(fn, reps):
    """Median of CUDA-event timings after 2 warm-ups (wall clock on CPU): attention_kernels.time_fn."""
    from attention_kernels import time_fn  # benchmarks/ is this script's own folder
    return float(time_fn(fn, reps, 2, torch.cuda.is_available())["median_ms"])


# ---- connectivities ----------------------------------------------------------------------------

def band_connectivity(tokens, block_size, target):
    """Band (local window along the frame-major token order) whose token-weighted density is nearest target."""
    from carnator_engine.sparse_attention import density, num_blocks
    nb = num_blocks(tokens, block_size)
    idx = torch.arange(nb)
    best = None
    for half in range(nb):
        table = (idx[:, None] - idx[None, :]).abs() <= half
        d = density(table, block_size, tokens)
        if best is None or abs(d - target) < abs(best[1] - target):
            best = (table, d)
        if d >= target:
            break
    return best


# ---- the measurements --------------------------------------------------------------------------

def noop_self_attention(func, *args, **kwargs):
    """optimized_attention_override that skips self-attention (q returned as its output)."""
    q, k = args[0], args[1]
    if not kwargs.get("skip_reshape", False) and q.dim() == 3 and q.shape[1] == k.shape[1]:
        return q
    return func(*args, **kwargs)


def plain_sample(model, noise, sigmas, positive, negative, seed, callback=None, cfg=1.0):
    import comfy.sample
    import comfy.samplers
    sampler = comfy.samplers.sampler_object("euler")
    return comfy.sample.sample_custom(model, noise, cfg, sampler, sigmas, positive, negative, torch.zeros_like(noise),
                                      callback=callback, disable_pbar=True, seed=seed)


class SparseCounter:
    """Counts BlockSparseAttention.attend calls (proof the cached sparse plan ran)."""

    def __init__(self):
        from carnator_engine import sparse_attention
        self.cls = sparse_attention.BlockSparseAttention
        self.original = self.cls.attend
        self.calls = 0
        counter = self

        def attend(plan, block_index, q, k, v, scale=None, **joint):
            counter.calls += 1
            return counter.original(plan, block_index, q, k, v, scale, **joint)

        self.cls.attend = attend

    def restore(self):
        self.cls.attend = self.original


def carnator_hit(runner, store, config, noise, sigmas, resume_step, seed):
    """probe -> lookup -> gate -> (resume at k) -> write-back; returns timings and facts. The request is the miss's
    a hair off (noise x 1.0001): the identical one would be an exact repeat, answered without the gate."""
    from carnator_engine import pipeline
    from carnator_engine.connectivity import plan_from_tensors
    from carnator_engine.localize import latent_mask

    noise = noise * (1 + 1e-4)
    with timed() as probe_span:
        probed = pipeline.probe(runner, noise, sigmas, config)
    with timed() as gate_span:
        candidates = pipeline.lookup(store, probed, config)
        decision = pipeline.decide(probed, candidates, config)
    if not decision.reuse:
        raise RuntimeError("the gate rejected the nearly repeated request: " + "; ".join(decision.reasons))
    gate_step = decision.resume_step
    forced = gate_step != resume_step
    if forced:
        if resume_step not in store.record(decision.entry_id).checkpoint_steps:
            raise RuntimeError(f"entry has no checkpoint at step {resume_step}")
        decision.resume_step = resume_step
        decision.reasons.append(f"benchmark: resume step forced from {gate_step} to {resume_step}")
    with warnings.catch_warnings(record=True) as caught, timed() as resume_span:
        warnings.simplefilter("always")
        counter = SparseCounter()
        try:
            result = pipeline.resume(runner, probed, decision, store, config, PROMPT, seed)
        finally:
            counter.restore()
    payload = store.trajectory(store.record(decision.entry_id))
    fhw = probed.latent.shape[-3:]
    target = (latent_mask(decision.target_cells, fhw) if decision.target_cells is not None
              else torch.zeros(tuple(fhw), dtype=torch.bool))
    plan = plan_from_tensors(payload.connectivity, runner.layout.tokens_from_latent_mask(target))
    return {
        "seconds": probe_span["seconds"] + gate_span["seconds"] + resume_span["seconds"],
        "probe_s": probe_span["seconds"], "lookup_gate_s": gate_span["seconds"],
        "resume_and_write_s": resume_span["seconds"],
        "write_back_s": result.seconds.get("write_back"), "resume_step": decision.resume_step,
        "gate_resume_step": gate_step, "forced_resume_step": forced, "model_calls": result.model_calls,
        "plan_blocks": len(plan), "plan_mean_density": plan.mean_density(),
        "target_fraction": float(target.float().mean()), "sparse_attend_calls": counter.calls,
        "warnings": flex_warnings(caught) + list(result.warnings),
        "decision_numbers": decision.numbers,
    }, result, probed


def rel_diff(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def sdpa_ms(qkv, reps):
    """Dense SDPA with the backend priority ComfyUI's attention_pytorch uses on CUDA (cuDNN first)."""
    import torch.nn.functional as F
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        priority = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]

        def fn():
            with sdpa_kernel(priority, set_priority=True):
                return F.scaled_dot_product_attention(*qkv)
        fn()
    except Exception:
        def fn():
            return F.scaled_dot_product_attention(*qkv)
    return kernel_ms(fn, reps)


def flex_warnings(caught):
    return [str(w.message)[:300] for w in caught if "flex" in str(w.message).lower() or "sdpa" in str(w.message).lower()]


def ideal_speedup(n, p, k, a, d):
    return n / (p + (n - k) * (1.0 - a + a * d))


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

    from carnator_engine import sparse_attention as sa
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
        from carnator_engine.connectivity import plan_from_tensors
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
