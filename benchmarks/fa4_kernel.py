"""FlashAttention-4 (flash-attn-4, CuTe DSL) block-sparse attention against dense cuDNN on an H200, at the size of
Wan2.1-1.3B self-attention (480p x 81 frames: B=1, 12 heads, D=128, L=32760, bf16, block 128): correctness
against masked SDPA and the median of 30 CUDA-event timings per density. Writes JSON to the path it is given.

The device has no flash-attn-4: its wheels travel with the call (benchmarks/RESULTS.md, "Kernels", says how).
"""
import json
import site
import statistics
import sys
import time
import traceback

site.addsitedir("/tmp/site")
import torch
import torch.nn.functional as F

out_path = sys.argv[1]
res = {"env": {"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}}
B, H, D, bs = 1, 12, 128, 128
L = 21 * 30 * 52
nb = -(-L // bs)
dev = "cuda"
g = torch.Generator(device="cpu").manual_seed(0)
q = torch.randn(B, H, L, D, generator=g).to(dev, torch.bfloat16)
k = torch.randn(B, H, L, D, generator=g).to(dev, torch.bfloat16)
v = torch.randn(B, H, L, D, generator=g).to(dev, torch.bfloat16)


def timeit(fn, runs=30, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def conn_random(d):
    per = max(1, round(d * nb))
    s = torch.rand(nb, nb, generator=g); s.fill_diagonal_(2.0)
    c = torch.zeros(nb, nb, dtype=torch.bool); c.scatter_(-1, s.topk(per, -1).indices, True)
    return c


from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    res["cudnn_dense_ms"] = timeit(lambda: F.scaled_dot_product_attention(q, k, v))
res["default_dense_ms"] = timeit(lambda: F.scaled_dot_product_attention(q, k, v))
print(res, flush=True)

try:
    import flash_attn.cute.interface as fa
    qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))   # [B, L, H, D]
    t0 = time.time(); o = fa.flash_attn_func(qf, kf, vf)
    o = o[0] if isinstance(o, tuple) else o
    torch.cuda.synchronize(); res["fa4_dense_compile_s"] = time.time() - t0
    ref = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    res["fa4_dense_relerr"] = float((o.float() - ref.float()).norm() / ref.float().norm())
    res["fa4_dense_ms"] = timeit(lambda: fa.flash_attn_func(qf, kf, vf))
    print(res, flush=True)
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from carnator_engine.attention import sparse as sa
    for d in (0.1, 0.2, 0.3, 0.5, 1.0):
        c = conn_random(d) if d < 1 else torch.ones(nb, nb, dtype=torch.bool)
        plan = sa.BlockSparseAttention({0: c}, block_size=bs, backend="fa4")   # what a hit runs, per block
        row = {"density": float(c.float().mean())}
        try:
            t0 = time.time()
            o = plan.attend(0, q, k, v)
            torch.cuda.synchronize(); row["compile_s"] = time.time() - t0
            tok = torch.arange(L, device=dev) // bs
            mask = c.to(dev)[tok][:, tok]
            refm = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            row["relerr_vs_masked_sdpa"] = float((o.float() - refm.float()).norm() / refm.float().norm())
            del mask, refm
            row["ms"] = timeit(lambda: plan.attend(0, q, k, v))
            row["vs_cudnn"] = row["ms"] / res["cudnn_dense_ms"]
        except Exception:
            row["error"] = traceback.format_exc()[-1500:]
        res.setdefault("fa4_sparse", []).append(row)
        print(row, flush=True)
except Exception:
    res["fa4_error"] = traceback.format_exc()[-3000:]
    print(res["fa4_error"], flush=True)

json.dump(res, open(out_path, "w"), indent=1)
