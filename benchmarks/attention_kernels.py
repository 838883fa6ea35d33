"""Kernel benchmark: dense SDPA vs the block-sparse kernels (carnator_engine.attention.sparse): FlexAttention, and
with --fa4 FlashAttention-4's (the optional flash-attn-4 package, the `gpu` extra; Hopper GPUs).

Default size is Wan2.1-1.3B self-attention at 480p, 81 frames: B=1, 12 heads, D=128,
L = 21 x 30 x 52 = 32760 tokens, bf16, block 128.

1. Correctness: flex block-sparse output against the dense masked SDPA reference
   (whole tensor, relative error) and both against a float64 reference on sampled
   query rows; a few small shapes with other block sizes (64, 192, 256) too.
2. Timing (CUDA events, median of --runs after --warmup): dense SDPA (flash, cuDNN,
   default pick), flex with an all-True table, and flex at densities 0.1/0.2/0.3/0.5
   for a random table (diagonal kept) and a "local window" band table.
3. With --fa4: the FlashAttention-4 kernel as a hit runs it (BlockSparseAttention, backend fa4) at each density
   and all-True, random tables: its first call (the compile), its error against masked SDPA, its timings; where
   flash-attn-4 cannot run, each row says why.
4. With --region-shares: a region step's target attention (CarnatorConfig.region_fa4), the first share of the
   queries over every key, by the default SDPA and by FA4 dense (attention.fa4.dense), each row its error and times.
--skip-flex leaves out the FlexAttention parts (correctness at the benchmark size, flex timings, its options).

Prints a table and writes JSON (--out, default benchmarks/out/attention_kernels.json).
``--smoke`` runs a tiny CPU-sized problem through the same code (used by the tests).

    PYTHONUNBUFFERED=1 python3 benchmarks/attention_kernels.py --out $OUT/attention_kernels.json
    python3 benchmarks/attention_kernels.py --fa4 --no-extra-checks --out $OUT/fa4.json     # with flash-attn-4
    python3 benchmarks/attention_kernels.py --fa4 --skip-flex --region-shares 0.1,0.3 --out $OUT/fa4_region.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [folder for folder in (str(ROOT), str(ROOT / "benchmarks")) if folder not in sys.path]

from carnator_engine.attention import fa4 as fa4_attention  # noqa: E402
from carnator_engine.attention import sparse as sa  # noqa: E402
from gpu_host import time_fn  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "attention_kernels.json"

KERNEL_OPTION_VARIANTS = [
    {},  # torch's H100 default for bf16, D=128: BLOCK_M=128, BLOCK_N=64, 3 stages, 8 warps
    {"ROWS_GUARANTEED_SAFE": True},  # every row has a key block (validated)
    {"USE_TMA": True},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "USE_TMA": True,
     "ROWS_GUARANTEED_SAFE": True},
    {"BACKEND": "FLASH"},  # flash-attention cute-dsl backend, if installed there
]


# ----------------------------------------------------------------------------
# connectivities
# ----------------------------------------------------------------------------


def random_connectivity(nb: int, target: float, gen: torch.Generator) -> torch.Tensor:
    """Each row keeps its diagonal plus round(target*nb)-1 other random key blocks."""
    per_row = max(1, min(nb, round(target * nb)))
    scores = torch.rand(nb, nb, generator=gen)
    scores.fill_diagonal_(2.0)  # diagonal always first
    top = scores.topk(per_row, dim=-1).indices
    conn = torch.zeros(nb, nb, dtype=torch.bool)
    conn.scatter_(-1, top, True)
    return conn


def band_connectivity(nb: int, target: float) -> torch.Tensor:
    """Local window |i - j| <= w, w chosen so the density is closest to target."""
    i = torch.arange(nb)
    dist = (i[:, None] - i[None, :]).abs()
    best = min(range(nb), key=lambda w: abs(float((dist <= w).float().mean()) - target))
    return dist <= best


# ----------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def ref_rows_f64(q, k, v, conn, block_size, rows, scale):
    """float64 attention for the query tokens `rows`, with an explicit -inf mask."""
    qs = q[:, :, rows].double()
    s = torch.matmul(qs, k.double().transpose(-1, -2)) * scale
    if conn is not None:
        kb = torch.arange(k.shape[2], device=q.device) // block_size
        allowed = conn.to(q.device)[rows // block_size][:, kb]
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.double())


def dense_backends(cuda: bool):
    """(name, context factory) for the dense SDPA variants worth timing."""
    if not cuda:
        return [("sdpa_default", None)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = [("sdpa_flash", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        out.append(("sdpa_cudnn", lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION])))
    out.append(("sdpa_default", None))
    return out


def _with(ctx, fn):
    if ctx is None:
        return fn()
    with ctx():
        return fn()


def fa4_rows(q, k, v, tables: dict, bs: int, runs: int, warmup: int, cuda: bool) -> list:
    """FlashAttention-4's block-sparse kernel as a hit runs it, one row per {target density: table}: its first call
    (the compile), its error against masked SDPA and its timings, or why it cannot run here ("error")."""
    rows = []
    for target, table in tables.items():
        row = {"target_density": target, "density": sa.density(table, bs, q.shape[2])}
        plan = sa.BlockSparseAttention({0: table}, block_size=bs, backend="fa4")
        try:
            started = time.perf_counter()
            out = plan.attend(0, q, k, v)
            if cuda:
                torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - started
            row["rel_err_vs_sdpa_masked"] = rel_err(out, sa.block_sparse_attention(q, k, v, table, bs, backend="sdpa"))
            row.update(time_fn(lambda: plan.attend(0, q, k, v), runs, warmup, cuda))
        except (RuntimeError, ValueError, ImportError) as exc:     # no flash-attn-4, an older GPU, a CPU
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(f"  fa4 d={row['density']:.3f}: " + (row["error"] if "error" in row else f"{row['median_ms']:.3f} ms"),
              flush=True)
        rows.append(row)
    return rows


def region_rows(q, k, v, shares: list, runs: int, warmup: int, cuda: bool) -> list:
    """A region step's target attention, one row per query share: the first share of the queries over every key by
    the default SDPA and by FA4 dense (its error against SDPA), or why FA4 cannot run here ("error")."""
    rows = []
    for share in shares:
        part = q[:, :, : max(1, round(share * q.shape[2]))]
        row = {"query_share": share, "queries": int(part.shape[2]),
               "sdpa": time_fn(lambda: F.scaled_dot_product_attention(part, k, v), runs, warmup, cuda)}
        if not fa4_attention.supports(part):
            row["error"] = "flash-attn-4 cannot run here (it needs the package, a Hopper GPU, 16-bit floats)"
        else:
            row["rel_err_fa4_vs_sdpa"] = rel_err(fa4_attention.dense(part, k, v),
                                                 F.scaled_dot_product_attention(part, k, v))
            row["fa4"] = time_fn(lambda: fa4_attention.dense(part, k, v), runs, warmup, cuda)
            row["fa4_vs_sdpa"] = row["fa4"]["median_ms"] / row["sdpa"]["median_ms"]
        print(f"  region share {share}: sdpa {row['sdpa']['median_ms']:.3f} ms, " +
              (row["error"] if "error" in row else f"fa4 {row['fa4']['median_ms']:.3f} ms"), flush=True)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--smoke", action="store_true", help="tiny problem on CPU (for tests)")
    p.add_argument("--frames", type=int, default=21)
    p.add_argument("--height", type=int, default=30)
    p.add_argument("--width", type=int, default=52)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--densities", default="0.1,0.2,0.3,0.5")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-extra-checks", action="store_true", help="skip the small other-block-size checks")
    p.add_argument("--fa4", action="store_true", help="also the FlashAttention-4 block-sparse kernel (flash-attn-4)")
    p.add_argument("--region-shares", default="",
                   help="query shares of a region step's target attention, SDPA against FA4 dense (empty: none)")
    p.add_argument("--skip-flex", action="store_true", help="leave out the FlexAttention correctness and timings")
    args = p.parse_args(argv)
    try:
        args.region_shares = [float(x) for x in args.region_shares.split(",") if x.strip()]
    except ValueError:
        p.error(f"--region-shares {args.region_shares!r}: give shares such as 0.1,0.3")
    if any(not 0 < share <= 1 for share in args.region_shares):
        p.error(f"--region-shares {args.region_shares}: each share must be in (0, 1]")
    if args.smoke:
        args.frames, args.height, args.width = 3, 4, 5  # L = 60, last block partial
        args.heads, args.dim, args.block = 2, 16, 16
        args.runs, args.warmup = 3, 1
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    # this script compiles more flex variants than a normal process (dynamo's default is 8)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    B, H, D, bs = 1, args.heads, args.dim, args.block
    L = args.frames * args.height * args.width
    nb = sa.num_blocks(L, bs)
    scale = 1.0 / math.sqrt(D)
    densities = [float(x) for x in args.densities.split(",") if x]
    gen = torch.Generator().manual_seed(args.seed)
    backend = "flex" if cuda else "sdpa"
    sparse_name = "flex" if cuda else "sdpa_masked"

    result: dict = {
        "config": {
            "B": B, "heads": H, "D": D, "L": L, "frames": args.frames, "height": args.height,
            "width": args.width, "block_size": bs, "num_blocks": nb, "dtype": str(dtype),
            "runs": args.runs, "warmup": args.warmup, "smoke": args.smoke,
        },
        "env": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "flex_available": sa.flex_available(),
        },
        "correctness": {},
        "timing": [],
    }
    if cuda:
        result["config"]["flex_kernel_options"] = sa.default_kernel_options(dev)
        try:
            import triton

            result["env"]["triton"] = triton.__version__
        except Exception:
            pass
    print(f"device: {result['env']['device']}  torch {torch.__version__}  L={L} heads={H} D={D} "
          f"block={bs} ({nb} blocks) {dtype}", flush=True)

    def rand_qkv(seed):
        g = torch.Generator(device=dev).manual_seed(seed)
        return [torch.randn(B, H, L, D, device=dev, dtype=dtype, generator=g) for _ in range(3)]

    def sparse(q, k, v, conn):
        return sa.block_sparse_attention(q, k, v, conn, bs, backend=backend)

    full = torch.ones(nb, nb, dtype=torch.bool)
    if not args.skip_flex:      # sections 1 and 1b check the flex kernel
        # -- 1. correctness at the benchmark size (fresh inputs) -------------------
        t0 = time.perf_counter()
        q, k, v = rand_qkv(args.seed + 1)
        rows = torch.cat([
            torch.arange(0, min(L, 64)),                                    # first block
            torch.randint(0, L, (128,), generator=gen),                     # random rows
            torch.arange(max(0, L - 64), L),                                # partial last block
        ]).to(dev)
        checks = {}
        for cname, conn in (("random_d0.3", random_connectivity(nb, 0.3, gen)),
                            ("band_d0.3", band_connectivity(nb, 0.3))):
            out = sparse(q, k, v, conn)
            ref_masked = sa.block_sparse_attention(q, k, v, conn, bs, backend="sdpa")
            ref64 = ref_rows_f64(q, k, v, conn, bs, rows, scale)
            checks[cname] = {
                "density": sa.density(conn, bs, L),
                "finite": bool(torch.isfinite(out).all()),
                f"rel_err_{sparse_name}_vs_sdpa_masked": rel_err(out, ref_masked),
                f"rel_err_{sparse_name}_vs_f64_rows": rel_err(out[:, :, rows], ref64),
                "rel_err_sdpa_masked_vs_f64_rows": rel_err(ref_masked[:, :, rows], ref64),
            }
            del out, ref_masked, ref64
        dense_out = F.scaled_dot_product_attention(q, k, v)
        checks["dense_sdpa_vs_f64_rows"] = rel_err(dense_out[:, :, rows], ref_rows_f64(q, k, v, None, bs, rows, scale))
        checks[f"rel_err_{sparse_name}_all_true_vs_dense_sdpa"] = rel_err(sparse(q, k, v, full), dense_out)
        del q, k, v, dense_out
        result["correctness"]["main"] = checks
        print(f"correctness (main size) in {time.perf_counter() - t0:.1f}s: {json.dumps(checks, indent=1)}", flush=True)

        # -- 1b. other block sizes, small shapes (flex tiling paths) ---------------
        if cuda and not args.no_extra_checks:
            extra = {}
            for ebs, el in ((64, 1500), (192, 1500), (256, 1500)):
                g = torch.Generator(device=dev).manual_seed(ebs)
                eq, ek, ev = [torch.randn(1, 2, el, 64, device=dev, dtype=dtype, generator=g) for _ in range(3)]
                enb = sa.num_blocks(el, ebs)
                conn = random_connectivity(enb, 0.35, gen)
                t1 = time.perf_counter()
                out = sa.block_sparse_attention(eq, ek, ev, conn, ebs, backend="flex")
                erows = torch.arange(el, device=dev)
                extra[f"block{ebs}_L{el}"] = {
                    "rel_err_flex_vs_f64": rel_err(out, ref_rows_f64(eq, ek, ev, conn, ebs, erows, 1 / 8)),
                    "rel_err_sdpa_masked_vs_f64": rel_err(
                        sa.block_sparse_attention(eq, ek, ev, conn, ebs, backend="sdpa"),
                        ref_rows_f64(eq, ek, ev, conn, ebs, erows, 1 / 8)),
                    "first_call_s": time.perf_counter() - t1,
                }
            result["correctness"]["other_block_sizes"] = extra
            print(f"correctness (other block sizes): {json.dumps(extra, indent=1)}", flush=True)

    # -- 2. timing -------------------------------------------------------------
    q, k, v = rand_qkv(args.seed + 2)
    dense_flops = 4.0 * B * H * L * L * D
    rows_out = []

    def record(name, density_val, pattern, t, extra=None):
        row = {"kernel": name, "pattern": pattern, "density": density_val, **t}
        row["tflops_effective"] = dense_flops * density_val / (t["median_ms"] * 1e-3) / 1e12
        if extra:
            row.update(extra)
        rows_out.append(row)
        print(f"  {name:<18} {pattern:<8} d={density_val:.3f}  median {t['median_ms']:.3f} ms", flush=True)

    for name, ctx in dense_backends(cuda):
        try:
            fn = lambda ctx=ctx: _with(ctx, lambda: F.scaled_dot_product_attention(q, k, v))
            record(name, 1.0, "dense", time_fn(fn, args.runs, args.warmup, cuda))
        except Exception as exc:  # a backend may be missing on this build
            print(f"  {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
    # the same dense kernel again: the spread between two timings of one version
    name0, ctx0 = dense_backends(cuda)[0]
    try:
        fn = lambda: _with(ctx0, lambda: F.scaled_dot_product_attention(q, k, v))
        record(name0 + "_again", 1.0, "dense", time_fn(fn, args.runs, args.warmup, cuda))
    except Exception:
        pass

    if not args.skip_flex:
        def sparse_variants(conn):
            """(name, fn): the kernel alone (BlockMask built beforehand) and the whole call."""
            if cuda:
                kernel = sa.prepare_flex(q, k, v, conn, bs)
                return [("flex_kernel", lambda: kernel(q, k, v)), ("flex_call", lambda: sparse(q, k, v, conn))]
            return [(sparse_name, lambda: sparse(q, k, v, conn))]

        for name, fn in sparse_variants(full):
            record(name, 1.0, "all", time_fn(fn, args.runs, args.warmup, cuda), {"target_density": 1.0})
        for d in densities:
            for pattern, conn in (("random", random_connectivity(nb, d, gen)), ("band", band_connectivity(nb, d))):
                real_d = sa.density(conn, bs, L)
                extra = {"target_density": d}
                if cuda:
                    conn_dev = conn.to(dev)
                    tb = time_fn(lambda: sa.build_block_mask(conn_dev, bs, L, L), args.runs, 2, cuda)
                    extra["block_mask_build_ms"] = tb["median_ms"]
                for name, fn in sparse_variants(conn):
                    record(name, real_d, pattern, time_fn(fn, args.runs, args.warmup, cuda), extra)
        # the plan object: BlockMask built once per transformer block, as on a cache hit
        conn = random_connectivity(nb, 0.3, gen)
        plan = sa.BlockSparseAttention({0: conn}, block_size=bs, seq_len=L)
        record("plan_attend", sa.density(conn, bs, L), "random",
               time_fn(lambda: plan.attend(0, q, k, v), args.runs, args.warmup, cuda))

    if args.fa4:
        result["fa4"] = fa4_rows(q, k, v, {d: random_connectivity(nb, d, gen) for d in densities} | {1.0: full},
                                 bs, args.runs, args.warmup, cuda)
        for row in result["fa4"]:
            if "median_ms" in row:
                record("fa4_plan", row["density"], "random", row)

    # flex kernel options (same tables; each variant is checked before it is timed)
    if cuda and not args.skip_flex:
        tuning = []
        conn_check = random_connectivity(nb, 0.3, gen)
        ref = sa.block_sparse_attention(q, k, v, conn_check, bs, backend="sdpa")
        for opts in KERNEL_OPTION_VARIANTS:
            entry = {"kernel_options": opts}
            try:
                t1 = time.perf_counter()
                out = sa.prepare_flex(q, k, v, conn_check, bs, kernel_options=opts)(q, k, v)
                torch.cuda.synchronize()
                entry["first_call_s"] = time.perf_counter() - t1
                entry["rel_err_vs_sdpa_masked"] = rel_err(out, ref)
                del out
                for d in (0.1, 0.3, 1.0):
                    conn = random_connectivity(nb, d, gen) if d < 1 else full
                    kern = sa.prepare_flex(q, k, v, conn, bs, kernel_options=opts)
                    entry[f"median_ms_d{d}"] = time_fn(lambda: kern(q, k, v), args.runs, args.warmup, cuda)["median_ms"]
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            tuning.append(entry)
            print(f"  options {opts}: {entry}", flush=True)
        del ref
        result["flex_kernel_options"] = tuning

    # what the exact fallback costs at one density (dense work plus an L x L mask)
    if not args.skip_flex:
        conn = random_connectivity(nb, 0.3, gen)
        record("sdpa_masked", sa.density(conn, bs, L), "random",
               time_fn(lambda: sa.block_sparse_attention(q, k, v, conn, bs, backend="sdpa"),
                       max(3, args.runs // 3), 2, cuda))
    if args.region_shares:
        result["region"] = region_rows(q, k, v, args.region_shares, args.runs, args.warmup, cuda)

    dense_times = [r["median_ms"] for r in rows_out if r["pattern"] == "dense"]
    best_dense = min(dense_times)
    flash = next((r["median_ms"] for r in rows_out if r["kernel"] == "sdpa_flash"), best_dense)
    for r in rows_out:
        r["speedup_vs_best_dense"] = best_dense / r["median_ms"]
        r["speedup_vs_flash"] = flash / r["median_ms"]
    result["timing"] = rows_out
    result["best_dense_ms"] = best_dense

    # -- table -----------------------------------------------------------------
    print()
    print(f"{result['env']['device']} | L={L} H={H} D={D} {dtype} block={bs} | median of {args.runs}")
    print(f"{'kernel':<20}{'pattern':<9}{'density':>8}{'median ms':>11}{'p90 ms':>9}{'TFLOP/s':>9}"
          f"{'x flash':>9}{'x best':>8}{'mask ms':>9}")
    for r in rows_out:
        mask_ms = f"{r['block_mask_build_ms']:>9.3f}" if "block_mask_build_ms" in r else f"{'':>9}"
        print(f"{r['kernel']:<20}{r['pattern']:<9}{r['density']:>8.3f}{r['median_ms']:>11.3f}"
              f"{r['p90_ms']:>9.3f}{r['tflops_effective']:>9.1f}{r['speedup_vs_flash']:>9.2f}"
              f"{r['speedup_vs_best_dense']:>8.2f}{mask_ms}")
    for entry in result.get("flex_kernel_options", []):
        if "error" in entry:
            print(f"options {entry['kernel_options']}: {entry['error'][:100]}")
        else:
            print(f"options {entry['kernel_options']}: err {entry['rel_err_vs_sdpa_masked']:.2e}  "
                  + "  ".join(f"d{d}: {entry[f'median_ms_d{d}']:.3f} ms" for d in (0.1, 0.3, 1.0)))
    print("correctness (relative error):")
    for group in result["correctness"].values():
        for name, val in group.items():
            if isinstance(val, dict):
                print(f"  {name}: " + ", ".join(
                    f"{kk}={vv:.2e}" if isinstance(vv, float) and kk.startswith("rel") else f"{kk}={vv}"
                    for kk, vv in val.items()))
            else:
                print(f"  {name}: {val:.2e}")

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
