#!/usr/bin/env python3
"""Plain vs Carnator miss vs hit at the real architecture sizes of the other backbones, through the ComfyUI adapter.

Random weights in bf16, ComfyUI 0.3.64's own model classes inside their model_base classes and a ModelPatcher
(Wan 1.3B built as benchmarks/gpu_host.py builds it), euler / simple / cfg 1,
N = 20 steps, probe p = 2 (p/N = 0.1), resume k = 10 (k/N = 0.5), attention blocks of 128 tokens, the miss
recording its connectivity under a 0.3 density budget. The gate runs with its defaults (no overrides); when its own
resume step differs from k the hit is forced to k and the JSON says so.

  wan2.2-a14b   two Wan2.1-14B-architecture experts (dim 5120, 40 layers, 40 heads, ffn 13824), the low-noise
                expert from step 10 (the Wan 2.2 A14B template's switch at half the steps); 480p x 49 frames:
                latent [1, 16, 13, 60, 104], 20280 tokens
  hunyuan-13b   HunyuanVideo-13B architecture (hidden 3072, 24 heads, 20 double- + 40 single-stream blocks), the
                same latent (20280 video tokens) and 256 text tokens in the joint attention
  ltxv-2b       LTX-Video-2B architecture (2048 wide, 32 heads, 28 blocks), 1216x704 x 121 frames:
                latent [1, 128, 16, 22, 38], 13376 tokens
Reductions against the models' usual settings (to fit one H200 in about 8 minutes): 20 steps instead of 40-50;
49 frames instead of 81 (Wan) or 129 at 720p (HunyuanVideo). `--video FRAMESxHEIGHTxWIDTH` sets another clip size
for the backbones of a run (`--only`), e.g. `--only ltxv-2b --video 257x704x1216`.

Per backbone: plain ComfyUI sampling (both experts split at the switch for Wan 2.2, as the template's two
KSamplerAdvanced do), the attention share a (self-attention a no-op), a Carnator miss on an empty store, a hit (the
miss's request, noise x 1.0001), the gate's answer for a new seed and for another conditioning (probe + lookup +
gate only), overhead, ideal N / (p + (N-k)(1-a+a d)), and peak GPU memory of plain, miss and hit.

  python3 benchmarks/gpu_backbones.py --out $OUT/gpu_backbones.json            # one H200
  python3 benchmarks/gpu_backbones.py --smoke --out /tmp/backbones.json        # tiny, CPU
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import gpu_host as gs  # noqa: E402

TEXT_DIM = 4096
BACKBONES = {
    "wan2.2-a14b": dict(kind="wan", dim=5120, layers=40, ffn=13824, latent=(1, 16, 13, 60, 104), text_len=512),
    "hunyuan-13b": dict(kind="hunyuan", hidden=3072, depth=20, single=40, latent=(1, 16, 13, 60, 104), text_len=256),
    "ltxv-2b": dict(kind="ltxv", heads=32, layers=28, latent=(1, 128, 16, 22, 38), text_len=128),
}
SMOKE = {
    "wan2.2-a14b": dict(kind="wan", dim=256, layers=1, ffn=256, latent=(1, 16, 2, 8, 8), text_len=16),
    "hunyuan-13b": dict(kind="hunyuan", hidden=256, depth=1, single=1, latent=(1, 16, 2, 8, 8), text_len=16),
    "ltxv-2b": dict(kind="ltxv", heads=2, layers=1, latent=(1, 128, 2, 4, 8), text_len=16),
}


# per latent kind: (channels, frames per latent frame, pixels per latent cell, latent cells per token side): ComfyUI's
# latent formats, and the models' patching (Wan and HunyuanVideo patch 2 x 2 cells into a token, LTX-Video 1 x 1)
VIDEO_LATENTS = {"wan": (16, 4, 8, 2), "hunyuan": (16, 4, 8, 2), "ltxv": (128, 8, 32, 1)}


def video_latent(kind: str, frames: int, height: int, width: int) -> tuple:
    """The [1, C, T, H, W] latent of a `frames` x `height` x `width` clip for a backbone kind, as its VAE makes it."""
    channels, per_frame, per_cell, patch = VIDEO_LATENTS[kind]
    cell = per_cell * patch
    if frames < 1 or (frames - 1) % per_frame:
        raise SystemExit(f"--video: {kind} takes 1 + {per_frame} k frames (e.g. {1 + per_frame * 12}), got {frames}")
    if height % cell or width % cell or height <= 0 or width <= 0:
        raise SystemExit(f"--video: {kind} takes a height and width that are multiples of {cell}, got {height}x{width}")
    return (1, channels, 1 + (frames - 1) // per_frame, height // per_cell, width // per_cell)


def with_video(specs: dict, video, names=None) -> dict:
    """The real-size specs, those of `names` (default: all) with the latent of `video` ("FRAMESxHEIGHTxWIDTH")
    instead of their default size: a size one backbone's VAE cannot make does not stop a run of the others."""
    if not video:
        return specs
    try:
        frames, height, width = (int(part) for part in video.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--video takes FRAMESxHEIGHTxWIDTH (e.g. 81x480x832), got {video!r}") from None
    return {name: {**spec, "latent": video_latent(spec["kind"], frames, height, width)}
            if names is None or name in names else spec for name, spec in specs.items()}


def common_parser(description, backbones):
    """The arguments every per-backbone benchmark takes: output, smoke, which backbones, the host, N, p and seed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny models, CPU-friendly")
    parser.add_argument("--only", default=",".join(backbones), help="comma-separated backbones to run")
    parser.add_argument("--comfyui", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--probe", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--video", default=None,
                        help="FRAMESxHEIGHTxWIDTH for every backbone run, e.g. 81x480x832 (default: each backbone's "
                             "reduced size above; ignored with --smoke)")
    return parser


def parse_args(argv=None):
    parser = common_parser(__doc__.split("\n\n")[0], BACKBONES)
    parser.add_argument("--resume", type=int, default=10)
    parser.add_argument("--max-density", type=float, default=0.3)
    parser.add_argument("--region-shares", type=gs.shares_list, default=[0.1, 0.3, 0.5],
                        help="target shares of the region-only hits, e.g. 0.1,0.3,0.5 (empty: none; a share "
                             "given twice is timed twice: the first hit of a process pays its one-time costs)")
    parser.add_argument("--block-size", type=int, default=None, help="default 128 (32 with --smoke)")
    parser.add_argument("--quick", action="store_true", help="plain, miss, hit and the region hits only: no attention "
                        "share (nor the ideal speedup), no new-seed and other-conditioning probes")
    return parser.parse_args(argv)


# ---- models ------------------------------------------------------------------------------------

def _randomize(module, seed, device):
    """Norm scales 1, norm biases 0, everything else N(0, 0.02), as gpu_host.build_model does for Wan."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name and name.endswith((".weight", ".scale")):
                param.fill_(1.0)
            elif "norm" in name and name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _patcher(config_class, unet, device, dtype, seed):
    import comfy.model_management as mm
    import comfy.model_patcher
    config = config_class(unet)
    config.set_inference_dtype(dtype, None)
    base = config.get_model({}, "", device=device)
    _randomize(base.diffusion_model, seed, device)
    params = sum(p.numel() for p in base.diffusion_model.parameters())
    return comfy.model_patcher.ModelPatcher(base, load_device=mm.get_torch_device(),
                                            offload_device=mm.unet_offload_device()), params


def _config_class(image_model, shift, latent_format, memory_usage_factor, model_class):
    """A ComfyUI model config with the fields of its comfy.supported_models class (importing that module would
    import every text encoder, and with them transformers)."""
    import comfy.supported_models_base

    class Config(comfy.supported_models_base.BASE):
        unet_config = {"image_model": image_model}
        sampling_settings = {"shift": shift}
        unet_extra_config = {}
        supported_inference_dtypes = [torch.bfloat16, torch.float32]

        def get_model(self, state_dict, prefix="", device=None):
            return model_class(self, device=device)

    Config.latent_format, Config.memory_usage_factor = latent_format, memory_usage_factor
    return Config


def build_hunyuan(spec, device, dtype, seed):
    """ComfyUI's HunyuanVideo in model_base.HunyuanVideo (config as supported_models.HunyuanVideo)."""
    import comfy.latent_formats
    import comfy.model_base
    config = _config_class("hunyuan_video", 7.0, comfy.latent_formats.HunyuanVideo, 1.8, comfy.model_base.HunyuanVideo)
    hidden = spec["hidden"]
    unet = dict(image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=TEXT_DIM,
                hidden_size=hidden, mlp_ratio=4.0, num_heads=hidden // 128, depth=spec["depth"],
                depth_single_blocks=spec["single"], axes_dim=[16, 56, 56], theta=256, patch_size=[1, 2, 2],
                qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False)
    return _patcher(config, unet, device, dtype, seed)


def build_ltxv(spec, device, dtype, seed):
    """ComfyUI's LTXVModel in model_base.LTXV (config as supported_models.LTXV)."""
    import comfy.latent_formats
    import comfy.model_base
    config = _config_class("ltxv", 2.37, comfy.latent_formats.LTXV, 5.5, comfy.model_base.LTXV)
    heads = spec["heads"]
    unet = dict(image_model="ltxv", in_channels=128, cross_attention_dim=heads * 64, attention_head_dim=64,
                num_attention_heads=heads, caption_channels=TEXT_DIM, num_layers=spec["layers"])
    return _patcher(config, unet, device, dtype, seed)


def build(spec, device, dtype, seed):
    """(models, parameters): one model, or for Wan the experts its spec names (Wan 2.2 A14B: two, the default)."""
    if spec["kind"] == "wan":
        preset = dict(dim=spec["dim"], layers=spec["layers"], ffn=spec["ffn"])
        experts = [gs.build_model(preset, device, dtype, seed + i) for i in range(spec.get("experts", 2))]
        return [model for model, _ in experts], sum(params for _, params in experts)
    builder = build_hunyuan if spec["kind"] == "hunyuan" else build_ltxv
    model, params = builder(spec, device, dtype, seed)
    if spec["kind"] == "ltxv" and device.type == "cpu":
        model.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = masked_sdpa
    return [model], params


def conditioning(spec, seed):
    """CONDITIONING shaped as each backbone's text encoders give it (HunyuanVideo: llama states + CLIP-L pooled;
    LTX-Video: T5 states + their attention mask, which its forward requires)."""
    generator = torch.Generator().manual_seed(seed)
    options = {"hunyuan": lambda: {"pooled_output": torch.randn(1, 768, generator=generator)},
               "ltxv": lambda: {"attention_mask": torch.ones(1, 1, spec["text_len"])}}.get(spec["kind"], dict)()
    return [[torch.randn(1, spec["text_len"], TEXT_DIM, generator=generator), options]]


def masked_sdpa(func, *args, **kwargs):
    """On the CPU ComfyUI attends sub-quadratically, which rejects LTX-Video's text mask: PyTorch SDPA instead (on
    GPUs it is ComfyUI's default)."""
    import comfy.ldm.modules.attention as attention
    return attention.attention_pytorch(*args, **kwargs)


# ---- measurements ------------------------------------------------------------------------------

def noop_self_attention(func, *args, **kwargs):
    """gpu_host.noop_self_attention for both q/k/v layouts: split heads [B, H, L, D] (HunyuanVideo's joint
    attention) and merged [B, L, H*D]; any attention whose queries and keys have one length is skipped."""
    q, k = args[0], args[1]
    if kwargs.get("skip_reshape", False) and q.dim() == 4 and q.shape[2] == k.shape[2]:
        return q if kwargs.get("skip_output_reshape", False) else q.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    return gs.noop_self_attention(func, *args, **kwargs)


def plain(models, switch, noise, sigmas, positive, negative, seed, callback=None, cfg=1.0):
    """Plain ComfyUI sampling; with two experts, the template's split: the first returns its latent with the
    leftover noise, the second continues it without adding noise."""
    import comfy.sample
    import comfy.samplers
    if len(models) == 1:
        return gs.plain_sample(models[0], noise, sigmas, positive, negative, seed, callback, cfg)
    first = gs.plain_sample(models[0], noise, sigmas[:switch + 1], positive, negative, seed, callback, cfg)
    sampler = comfy.samplers.sampler_object("euler")
    return comfy.sample.sample_custom(models[1], torch.zeros_like(noise), cfg, sampler, sigmas[switch:], positive,
                                      negative, first, callback=callback, disable_pbar=True, seed=seed)


Peak = gs.Peak


def attention_share(model, noise, sigmas, positive, negative, seed, timer, step_s):
    """The share a of a plain step that self-attention takes: 1 - (a step with it a no-op) / (a plain step)."""
    noop = model.clone()
    options = noop.model_options.setdefault("transformer_options", {})
    previous = options.get("optimized_attention_override")

    def skip_self_attention(func, *qkv, **kwargs):          # the rest still goes through any installed override
        chained = (lambda *a, **kw: previous(func, *a, **kw)) if previous is not None else func
        return noop_self_attention(chained, *qkv, **kwargs)
    options["optimized_attention_override"] = skip_self_attention
    with gs.timed(timer):
        gs.plain_sample(noop, noise, sigmas[:4], positive, negative, seed, callback=timer)
    return max(0.0, min(1.0, 1.0 - gs.median(timer.step_seconds()) / step_s))


def refused(runner, store, config, noise, sigmas):
    """The gate's answer to a request (probe + lookup + gate): (reuse, resume step, numbers, first reasons)."""
    from carnator_engine import pipeline
    probed = pipeline.probe(runner, noise, sigmas, config)
    decision = pipeline.decide(probed, pipeline.lookup(store, probed, config), config)
    return {"reuse": decision.reuse, "resume_step": decision.resume_step, "numbers": decision.numbers,
            "reasons": decision.reasons[:5]}


def measure(name, spec, args, device, dtype, log):
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.observer import GenerationObserver
    from carnator_engine.attention.connectivity import plan_from_tensors
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore
    n, p, k = args.steps, args.probe, args.resume
    block_size = args.block_size or (32 if args.smoke else 128)
    started = time.perf_counter()
    models, params = build(spec, device, dtype, args.seed)
    gs.sync()
    out = {"params": params, "latent": list(spec["latent"]), "build_s": time.perf_counter() - started}
    log(f"{name}: {params / 1e9:.3f} B parameters built in {out['build_s']:.1f} s")
    generator = torch.Generator().manual_seed(args.seed)
    noise = torch.randn(spec["latent"], generator=generator)
    positive, negative = conditioning(spec, args.seed + 1), conditioning(spec, args.seed + 2)
    timer = gs.StepTimer()
    switch = n // 2 if len(models) == 2 else None
    experts = {} if switch is None else {"low_noise_model": models[1], "switch_step": switch}
    runner = ComfyRunner(models[0], positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                         seed=args.seed, step_callback=timer, **experts)
    sigmas = runner.sigmas
    tokens = math.prod(runner.layout.token_grid(noise.shape))
    out.update(tokens=tokens, switch_step=switch, blocks=runner.backbone.num_blocks)

    with gs.timed() as span:                                       # cuDNN plans, allocator, weights on the device
        for model in models:
            gs.plain_sample(model, noise, sigmas[:3], positive, negative, args.seed)
    out["warmup_s"] = span["seconds"]

    with Peak() as peak, gs.timed(timer) as span:
        reference = plain(models, switch, noise, sigmas, positive, negative, args.seed, callback=timer)
    full_s, step_s = span["seconds"], gs.median(timer.step_seconds())
    out["plain"] = {"seconds": full_s, "step_median_s": step_s, "peak_bytes": peak.bytes}
    log(f"{name}: plain {full_s:.2f} s (step {step_s * 1e3:.0f} ms), peak {peak.bytes / 2**30:.1f} GiB")

    a = math.nan if args.quick else attention_share(models[0], noise, sigmas, positive, negative, args.seed, timer,
                                                    step_s)
    out["attention_share"] = a

    # "hit" is the whole-clip hit; the region-only cases turn region_only on with their forced targets
    config = CarnatorConfig(probe_steps=p, block_size=block_size, max_density=args.max_density, region_only=False)
    root = tempfile.mkdtemp(prefix="carnator_backbones_")
    try:
        store = CarnatorStore(os.path.join(root, name), size_limit_bytes=64 << 30)
        with Peak() as peak, gs.timed(timer) as span:
            miss = generate(runner, noise, sigmas, store, config, gs.PROMPT, args.seed)
        if miss.decision.reuse or miss.entry_id is None:
            raise RuntimeError(f"expected a stored miss, got {miss.summary()}")
        out["miss"] = {"seconds": span["seconds"], "peak_bytes": peak.bytes, "model_calls": miss.model_calls,
                       "rel_diff_vs_plain": gs.rel_diff(runner.to_latent_format(miss.latent), reference),
                       "parts_s": miss.seconds}
        log(f"{name}: miss {span['seconds']:.2f} s, rel diff vs plain {out['miss']['rel_diff_vs_plain']:.2e}")

        connectivity = store.trajectory(store.record(miss.entry_id)).connectivity
        with gs.timed() as span:                                   # FlexAttention compile for this shape
            runner.run(noise * float(sigmas[n - 2]), sigmas, n - 2, n,
                       GenerationObserver(sparse=plan_from_tensors(connectivity, torch.zeros(tokens, dtype=torch.bool))))
        out["sparse_warmup_s"] = span["seconds"]

        with Peak() as peak:
            facts, result, _ = gs.carnator_hit(runner, store, config, noise, sigmas, k, args.seed)
        facts.update(peak_bytes=peak.bytes, rel_diff_vs_miss=gs.rel_diff(result.latent, miss.latent))
        out["hit"] = facts
        d = facts["plan_mean_density"]
        out["summary"] = {
            "speedup_vs_plain": full_s / facts["seconds"], "ideal": gs.ideal_speedup(n, p, k, a, d), "density": d,
            "attention_share": a,
            "probe_lookup_gate_extra_pct": 100.0 * (facts["probe_s"] - p * step_s + facts["lookup_gate_s"]) / full_s,
            "miss_extra_pct": 100.0 * (out["miss"]["seconds"] - full_s) / full_s,
            "peak_miss_vs_plain_pct": _pct(out["miss"]["peak_bytes"], out["plain"]["peak_bytes"]),
            "peak_hit_vs_plain_pct": _pct(peak.bytes, out["plain"]["peak_bytes"]),
        }
        log(f"{name}: hit {facts['seconds']:.2f} s = {out['summary']['speedup_vs_plain']:.2f}x (ideal "
            f"{out['summary']['ideal']:.2f}x, a {a:.3f}, d {d:.3f}), k {facts['resume_step']} (gate "
            f"{facts['gate_resume_step']})")
        store.delete(result.entry_id)     # the region hits resume from the miss's entry, as the hit did
        out["region"] = gs.region_hits(runner, store, config, noise, sigmas, k, args.seed, args.region_shares, log,
                                       lambda latent: {"rel_diff_vs_miss": gs.rel_diff(latent, miss.latent)})
        for case in out["region"].values():
            case.update(speedup_vs_plain=full_s / case["seconds"],
                        peak_vs_plain_pct=_pct(case["peak_bytes"], out["plain"]["peak_bytes"]))

        if args.quick:
            return out
        other_seed = torch.randn(spec["latent"], generator=torch.Generator().manual_seed(args.seed + 100))
        out["new_seed"] = refused(runner, store, config, other_seed, sigmas)
        other = runner.with_step_callback(None)
        other.positive = conditioning(spec, args.seed + 7)
        other.request_fingerprint = "other-conditioning"
        out["other_conditioning"] = refused(other, store, config, noise, sigmas)
        log(f"{name}: new seed reuse={out['new_seed']['reuse']}, other conditioning "
            f"reuse={out['other_conditioning']['reuse']}")
    finally:
        del models, runner
        release(root)
    return out


def release(root):
    """After a backbone: its store folder and its models' device memory, before the next one is built."""
    shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    if torch.cuda.is_available():
        import comfy.model_management as mm
        mm.unload_all_models()
        mm.soft_empty_cache()


def measure_each(args, specs, measure, device, dtype, log, out, save=lambda: None):
    """measure(name, spec, args, device, dtype, log) for every backbone of --only into out["results"]; a backbone
    that fails records its traceback and the next one still runs."""
    for name in [name for name in args.only.split(",") if name]:
        if name not in specs:
            raise SystemExit(f"unknown backbone {name!r}: choose among {', '.join(specs)}")
        try:
            out["results"][name] = measure(name, specs[name], args, device, dtype, log)
        except Exception:
            out["results"][name] = {"error": traceback.format_exc()}
            log(f"{name} FAILED:\n{out['results'][name]['error']}")
        save()


def _pct(value, base):
    return 100.0 * (value - base) / base if base else 0.0


def print_table(out):
    print(f"\nCarnator across backbones: {out['device']}, torch {out['torch']}, ComfyUI {out['comfyui_version']}, "
          f"N={out['steps']} p={out['probe']} k={out['resume']}, max_density {out['max_density']}, default gate")
    print("| backbone | params | tokens | plain s | miss s | hit s | speedup | ideal | a | d | probe+gate extra | "
          "peak plain / miss / hit GiB | new seed | other cond |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, res in out["results"].items():
        if "error" in res:
            print(f"| {name} | error: {res['error'].strip().splitlines()[-1][:80]} |")
            continue
        s = res["summary"]
        gib = [res[key]["peak_bytes"] / 2**30 for key in ("plain", "miss", "hit")]
        print(f"| {name} | {res['params'] / 1e9:.2f} B | {res['tokens']} | {res['plain']['seconds']:.2f} | "
              f"{res['miss']['seconds']:.2f} | {res['hit']['seconds']:.2f} | {s['speedup_vs_plain']:.2f}x | "
              f"{s['ideal']:.2f}x | {s['attention_share']:.3f} | {s['density']:.3f} | "
              f"{s['probe_lookup_gate_extra_pct']:.2f} % | {gib[0]:.1f} / {gib[1]:.1f} / {gib[2]:.1f} | "
              f"{verdict(res.get('new_seed'))} | {verdict(res.get('other_conditioning'))} |")
    print_region_table({f"{name} {case_name}": case for name, res in out["results"].items()
                        for case_name, case in res.get("region", {}).items()})


def verdict(answer):
    return "" if answer is None else "HIT" if answer["reuse"] else "refused"


def print_region_table(cases):
    """The region-only hits: seconds, speedup, the token share reached, the verdict, peak memory against plain."""
    if not cases:
        return
    print("| region-only hit | seconds | vs plain | token share | region-only | peak vs plain |")
    print("|---|---|---|---|---|---|")
    for name, case in cases.items():
        print(f"| {name} | {case['seconds']:.2f} | {case['speedup_vs_plain']:.2f}x | {case['region_share']} | "
              f"{case['region_only']} | {case['peak_vs_plain_pct']:+.1f} % |")


def run(args):
    n, p, k = args.steps, args.probe, args.resume
    if not 1 <= p < k < n:
        raise SystemExit(f"need 1 <= probe < resume < steps, got p={p}, k={k}, N={n}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    path = gs.find_comfyui(args.comfyui)
    version = gs.import_comfy(path, cpu=not cuda)
    started = time.perf_counter()
    specs = SMOKE if args.smoke else with_video(BACKBONES, args.video, args.only.split(","))
    out = {**gs.machine_facts(device, version), "dtype": str(dtype), "steps": n, "probe": p,
           "resume": k, "max_density": args.max_density, "gate_overrides": {}, "smoke": args.smoke, "results": {}}

    def save():
        gs.write_report(args.out, out)

    measure_each(args, specs, measure, device, dtype, gs.elapsed_logger(started), out, save)
    out["total_seconds"] = time.perf_counter() - started
    save()
    print_table(out)
    return out


if __name__ == "__main__":
    run(parse_args())
