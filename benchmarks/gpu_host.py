#!/usr/bin/env python3
"""What the GPU benchmarks share: the host (ComfyUI found and imported), a Wan2.1-architecture model of a
preset size, the timers, the plain and Carnator sampling paths they compare, and the ideal-speedup formula.

Each GPU benchmark script (gpu_compose, gpu_backbones, few_step, gate_transfer, miss_profile, region_profile,
write_back, attention_kernels) imports from here; gate_transfer and few_step also build their models with gpu_backbones."""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the engine, and benchmarks/reports when the tests import this module
sys.path[:0] = [folder for folder in (ROOT, HERE) if folder not in sys.path]

import torch  # noqa: E402

import reports  # noqa: E402

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


def shares_list(text):
    """'0.1,0.3' -> [0.1, 0.3] (--region-shares): target shares in (0, 1)."""
    shares = [float(part) for part in text.split(",") if part.strip()]
    if any(not 0 < share < 1 for share in shares):
        raise argparse.ArgumentTypeError(f"target shares must lie in (0, 1), got {text!r}")
    return shares


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
        raise SystemExit("no ComfyUI checkout found (--comfyui, $COMFYUI_PATH, .host/ComfyUI, /opt/ComfyUI)")
    return path


def import_comfy(path, cpu, comfy_args=()):
    """Imports the parts of ComfyUI the sampler path needs, with its argument parser seeing only --cpu and
    `comfy_args` (its memory flags, e.g. --reserve-vram 55.2 --lowvram: a creator's card made by ComfyUI itself)."""
    if path not in sys.path:
        sys.path.insert(0, path)
    saved = sys.argv
    sys.argv = [saved[0]] + (["--cpu"] if cpu else []) + list(comfy_args)
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


def machine_facts(device, version: str) -> dict:
    """What a GPU report names beside its figures: the card, torch, ComfyUI, and whether FlashAttention-4 loaded (the
    sparse and region steps' kernel where it does)."""
    from carnator_engine.attention import fa4
    cuda = torch.device(device).type == "cuda"
    return {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "comfyui_version": version, "fa4_installed": cuda and fa4.installed()}


def write_report(path: str, out: dict) -> None:
    """reports.write, with whether FlashAttention-4 failed in the run so far (then the figures after its failure are
    the other kernels')."""
    from carnator_engine.attention import fa4
    reports.write(path, {**out, "fa4_failure": fa4.failure()})


def build_model(preset, device, dtype, seed, weight_dtype=None, init_device=None):
    """ComfyUI's WAN21 model (WanModel inside) with random weights, wrapped in a ModelPatcher.

    `weight_dtype` (e.g. torch.float8_e4m3fn): the weights stored in it and cast to `dtype` per layer, as UNETLoader's
    weight_dtype loads them. `init_device`: where the random values are drawn before they are copied into the weights
    (the GPU draws a 14B model built on the host in seconds; default: `device`).

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
    if weight_dtype is None:
        config.set_inference_dtype(dtype, None)
    else:
        config.set_inference_dtype(weight_dtype, dtype)
    base = config.get_model({}, "", device=device)
    init_device = device if init_device is None else init_device
    generator = torch.Generator(device=init_device).manual_seed(seed)
    with torch.no_grad():
        for name, param in base.diffusion_model.named_parameters():
            if "norm" in name and name.endswith(".weight"):
                param.fill_(1.0)
            elif "norm" in name and name.endswith(".bias"):
                param.zero_()
            else:   # drawn in a dtype normal_ takes (fp8 takes none), then copied in
                draw = dtype if param.dtype.itemsize == 1 else param.dtype
                param.copy_(torch.empty(param.shape, dtype=draw, device=init_device).normal_(0.0, 0.02,
                                                                                             generator=generator))
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


def time_fn(fn, runs: int, warmup: int, cuda: bool) -> dict:
    """Timings of `runs` calls of fn after `warmup` untimed ones, in ms: CUDA events on the GPU, wall clock else."""
    for _ in range(warmup):
        fn()
    times = []
    if cuda:
        torch.cuda.synchronize()
        for _ in range(runs):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    else:
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "min_ms": times[0],
        "p90_ms": times[min(len(times) - 1, int(0.9 * len(times)))],
        "runs": runs,
    }


def kernel_ms(fn, reps):
    """Median of CUDA-event timings after 2 warm-ups (wall clock on CPU)."""
    return float(time_fn(fn, reps, 2, torch.cuda.is_available())["median_ms"])


# ---- connectivities ----------------------------------------------------------------------------

def band_connectivity(tokens, block_size, target):
    """Band (local window along the frame-major token order) whose token-weighted density is nearest target."""
    from carnator_engine.attention.sparse import density, num_blocks
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


def with_easycache(model, threshold: float, start: float = 0.15, end: float = 0.95):
    """The MODEL with ComfyUI's EasyCache node applied (reuse_threshold, start and end percent)."""
    from comfy_extras.nodes_easycache import EasyCacheNode
    return EasyCacheNode.execute(model, threshold, start, end, False)[0]


def plain_sample(model, noise, sigmas, positive, negative, seed, callback=None, cfg=1.0):
    import comfy.sample
    import comfy.samplers
    sampler = comfy.samplers.sampler_object("euler")
    return comfy.sample.sample_custom(model, noise, cfg, sampler, sigmas, positive, negative, torch.zeros_like(noise),
                                      callback=callback, disable_pbar=True, seed=seed)


class SparseCounter:
    """Counts BlockSparseAttention.attend calls (proof the cached sparse plan ran)."""

    def __init__(self):
        from carnator_engine.attention import sparse as sparse_attention
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


class Peak:
    """Peak GPU memory allocated inside the block (0 on the CPU)."""

    def __enter__(self):
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        sync()
        self.bytes = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        return False


def forced_target(layout, latent_shape, share):
    """[F, H, W] latent target: the top rows of every frame, as many as make `share` of the tokens together with the
    region-only halo below them (random weights give no target region of their own)."""
    from carnator_engine.resume import REGION_HALO
    frames, rows, cols = layout.token_grid(latent_shape)
    token_rows = max(1, round(share * rows) - REGION_HALO[1])
    mask = torch.zeros(tuple(latent_shape[-3:]), dtype=torch.bool)
    mask[:, : token_rows * layout.patch_size[1]] = True
    return mask


def region_hits(runner, store, config, noise, sigmas, resume_step, seed, shares, log, difference, suffix=""):
    """{"region hit 30%": facts, ...}: the region-only hit (CarnatorConfig.region_only) at each target share, its peak
    memory, the share and verdict the resume stage reached, and difference(its latent) (a dict); each hit's own
    entry removed after it (the next resumes from the miss's). A share named again is timed again ("region hit 30%
    #2"): the first region-only hit of a process pins host memory and compiles kernels, the next shows a session's."""
    import dataclasses
    region_config = dataclasses.replace(config, region_only=True, region_max_share=0.6)
    cases = {}
    for share in shares:
        with Peak() as peak:
            facts, result, _ = carnator_hit(runner, store, region_config, noise, sigmas, resume_step, seed,
                                            target_share=share)
        entry_id = result.entry_id
        if entry_id:
            store.delete(entry_id)
        numbers = result.decision.numbers
        name = f"region hit {share:.0%}{suffix}"
        repeats = sum(1 for case in cases if case == name or case.startswith(f"{name} #"))
        name = f"{name} #{repeats + 1}" if repeats else name
        cases[name] = {**facts, "peak_bytes": peak.bytes, "region_only": numbers.get("region_only"),
                       "region_share": numbers.get("region_share"), "region_steps": numbers.get("region_steps"),
                       "region_key_share": numbers.get("region_key_share"),
                       "region_resident_bytes": numbers.get("region_resident_bytes"),
                       "region_streamed_bytes": numbers.get("region_streamed_bytes"),
                       "region_reason": next((r for r in reversed(result.decision.reasons) if "region" in r or
                                              "whole-clip" in r), ""), **difference(result.latent)}
        log(f"{name}: {facts['seconds']:.2f} s, region-only {numbers.get('region_only')}, token share "
            f"{numbers.get('region_share')}, key share {numbers.get('region_key_share')}, peak "
            f"{peak.bytes / 2**30:.1f} GiB, kept keys and values "
            f"{(numbers.get('region_resident_bytes') or 0) / 2**30:.2f} GiB resident, "
            f"{(numbers.get('region_streamed_bytes') or 0) / 2**30:.2f} GiB streamed")
    return cases


def carnator_hit(runner, store, config, noise, sigmas, resume_step, seed, target_share=None):
    """probe -> lookup -> gate -> (resume at k) -> write-back; returns timings and facts. The request is the miss's
    a hair off (noise x 1.0001): the identical one would be an exact repeat, answered without the gate. With
    `target_share`, the target region is forced to that share of the tokens (forced_target)."""
    from carnator_engine import pipeline
    from carnator_engine.attention.connectivity import plan_from_tensors
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
    forced = resume_step is not None and gate_step != resume_step   # None: the gate's own resume step
    if forced:
        if resume_step not in store.record(decision.entry_id).checkpoint_steps:
            raise RuntimeError(f"entry has no checkpoint at step {resume_step}")
        decision.resume_step = resume_step
        decision.reasons.append(f"benchmark: resume step forced from {gate_step} to {resume_step}")
    if target_share is not None:
        decision.target_cells = forced_target(runner.layout, probed.latent.shape, target_share)
        decision.cell_map = None      # the forced target alone: nothing added where the random weights differ
        decision.reasons.append(f"benchmark: target region forced to {target_share:.0%} of the tokens")
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
