"""Tests of carnator_engine.attention.sparse (CPU; the flex parts skip without CUDA)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from carnator_engine.attention import sparse as sa  # noqa: E402
from carnator_engine.attention.sparse import (  # noqa: E402
    BlockSparseAttention,
    block_sparse_attention,
    densify,
    density,
    pooled_block_attention,
    select_connectivity,
    token_blocks_from_mask,
)

needs_cuda = pytest.mark.gpu   # the flex path (tests/conftest.py skips it without a CUDA GPU)


def qkv(B=1, H=2, L=70, D=16, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
            for _ in range(3)]


def random_conn(nqb, nkb, p=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    conn = torch.rand(nqb, nkb, generator=g) < p
    conn[torch.arange(nqb), torch.arange(nqb) * nkb // nqb] = True
    return conn


def reference_f64(q, k, v, conn, block_size):
    """Exact attention in float64 with an explicit -inf mask."""
    q, k, v = q.double(), k.double(), v.double()
    qb = torch.arange(q.shape[2]) // block_size
    kb = torch.arange(k.shape[2]) // block_size
    allowed = conn[qb][:, kb]
    bias = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s, dim=-1) @ v


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("L,bs", [(64, 16), (70, 16), (70, 32)])
def test_full_connectivity_equals_dense_sdpa(L, bs):
    q, k, v = qkv(L=L)
    nb = sa.num_blocks(L, bs)
    full = torch.ones(nb, nb, dtype=torch.bool)
    out = block_sparse_attention(q, k, v, full, bs)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("L,bs,seed", [(70, 16, 1), (96, 8, 2), (200, 64, 3)])
def test_random_sparse_equals_f64_reference(L, bs, seed):
    q, k, v = qkv(B=2, L=L, seed=seed)
    nb = sa.num_blocks(L, bs)
    conn = random_conn(nb, nb, 0.3, seed)
    out = block_sparse_attention(q, k, v, conn, bs)
    ref = reference_f64(q, k, v, conn, bs)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # and it really is sparse: differs from dense attention
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v), atol=1e-3)


def test_cross_lengths_and_scale():
    q, _, _ = qkv(L=40, seed=4)
    _, k, v = qkv(L=72, seed=5)
    conn = random_conn(sa.num_blocks(40, 16), sa.num_blocks(72, 16), 0.5, 6)
    out = block_sparse_attention(q, k, v, conn, 16, scale=0.5)
    qb, kb = torch.arange(40) // 16, torch.arange(72) // 16
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                         attn_mask=conn[qb][:, kb], scale=0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# summary and connectivity
# ---------------------------------------------------------------------------


def test_pooled_rows_sum_to_one_and_match_manual():
    q, k, _ = qkv(B=2, H=3, L=70, D=8, seed=7)
    bs = 16
    pooled = pooled_block_attention(q, k, bs)
    nb = sa.num_blocks(70, bs)
    assert pooled.shape == (nb, nb) and pooled.dtype == torch.float32
    torch.testing.assert_close(pooled.sum(-1), torch.ones(nb), atol=1e-6, rtol=0)
    # manual: mean over the real tokens of each block (last block has 6)
    qp = torch.stack([q[:, :, i * bs:(i + 1) * bs].mean(2) for i in range(nb)], 2)
    kp = torch.stack([k[:, :, i * bs:(i + 1) * bs].mean(2) for i in range(nb)], 2)
    manual = torch.softmax(qp @ kp.transpose(-1, -2) / math.sqrt(8), -1).mean((0, 1))
    torch.testing.assert_close(pooled, manual, atol=1e-6, rtol=1e-5)


def test_pooled_reads_a_strided_low_precision_view_like_its_float_copy():
    # q and k arrive as [B, L, heads, D] transposed to [B, heads, L, D] (a view), in bf16 on a GPU: pooled in
    # float32 from the view, with the partial last block averaged over its real tokens
    q, k, _ = qkv(B=1, H=4, L=70, D=8, seed=3)
    q_view, k_view = (t.transpose(1, 2).contiguous().transpose(1, 2).bfloat16() for t in (q, k))
    assert not q_view.is_contiguous()
    torch.testing.assert_close(pooled_block_attention(q_view, k_view, 16),
                               pooled_block_attention(q_view.float().contiguous(), k_view.float().contiguous(), 16),
                               atol=1e-6, rtol=1e-5)


def test_connectivity_recorder_reads_no_value_back_mid_step(monkeypatch):
    # a Python bool or float of a tensor is a device synchronisation on a GPU: one per block would stall the miss's
    # recorded step (measured at 480p x 81 frames: benchmarks/miss_profile.py)
    from carnator_engine.attention.connectivity import ConnectivityRecorder
    q, k, _ = qkv(B=1, H=2, L=64, D=8, seed=5)
    recorder = ConnectivityRecorder(record_step=1, block_size=16, mass=0.9, max_density=0.5)
    reads = []
    for name in ("__bool__", "__float__", "item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    for block in range(3):
        recorder.self_attention(1, block, q, k)
    monkeypatch.undo()
    assert reads == []
    tables = recorder.tensors()
    assert sorted(tables) == ["0", "1", "2", "block_size"]
    assert all(t.dtype == torch.bool and t.shape == (4, 4) for name, t in tables.items() if name != "block_size")
    reference = sa.select_connectivity(pooled_block_attention(q, k, 16), mass=0.9, max_density=0.5)
    assert torch.equal(tables["1"], reference)


def _reference_select(row, mass):
    order = sorted(range(len(row)), key=lambda j: -row[j])
    kept, acc = set(), 0.0
    for j in order:
        if acc >= mass:
            break
        kept.add(j)
        acc += row[j]
    return kept


@pytest.mark.parametrize("mass", [0.3, 0.5, 0.9, 0.99])
def test_select_connectivity_reaches_mass_and_keeps_diagonal(mass):
    g = torch.Generator().manual_seed(11)
    att = torch.softmax(torch.randn(12, 12, generator=g) * 3, dim=-1)
    conn = select_connectivity(att, mass=mass)
    assert conn.dtype == torch.bool and conn.shape == (12, 12)
    assert bool(conn.diagonal().all())
    assert bool(((att * conn).sum(-1) >= mass - 1e-6).all())
    for i in range(12):
        want = _reference_select(att[i].double().tolist(), mass) | {i}
        assert set(torch.nonzero(conn[i]).flatten().tolist()) == want


def test_select_connectivity_options():
    att = torch.full((4, 6), 1 / 6)
    att[:, 5] += 1.0  # one dominant key block; unnormalised rows are fine
    conn = select_connectivity(att, mass=0.5)
    assert conn.sum().item() == 4 * 1 + 4  # dominant block + diagonal (never col 5 here)
    conn3 = select_connectivity(att, mass=0.5, min_blocks_per_row=3)
    assert bool((conn3.sum(-1) >= 3).all())
    assert bool(select_connectivity(att, mass=1.0).all())
    # non-square: diagonal is j = i * nkb // nqb
    assert conn[torch.arange(4), torch.arange(4) * 6 // 4].all()


def test_select_connectivity_density_budget_caps_near_uniform_rows():
    # near-uniform attention (random weights) needs ~90 % of the blocks for mass 0.9; the budget caps it
    g = torch.Generator().manual_seed(3)
    att = torch.softmax(torch.randn(20, 20, generator=g) * 0.05, dim=-1)
    assert select_connectivity(att, mass=0.9).float().mean() > 0.8
    capped = select_connectivity(att, mass=0.9, max_density=0.3)
    assert bool(capped.diagonal().all())
    assert bool((capped.sum(-1) <= 6 + 1).all())  # ceil(0.3 * 20) largest blocks, plus the diagonal
    top = torch.argsort(att, dim=-1, descending=True, stable=True)[:, :6]
    assert bool(capped.gather(-1, top).all())  # the kept blocks are each row's largest
    # a concentrated row stays under the budget: the cap never adds blocks
    peaked = torch.eye(20) * 10 + 0.01
    assert torch.equal(select_connectivity(peaked, mass=0.9, max_density=0.3), select_connectivity(peaked, mass=0.9))


def test_densify_rows_and_cols():
    conn = torch.eye(6, dtype=torch.bool)
    before = conn.clone()
    qmask = torch.tensor([False, True, False, False, False, False])
    out = densify(conn, dense_query_blocks=qmask, dense_key_blocks=[4])
    assert torch.equal(conn, before)  # input untouched
    assert bool(out[1].all()) and bool(out[:, 4].all())
    expect = before.clone()
    expect[1, :] = True
    expect[:, 4] = True
    assert torch.equal(out, expect)
    assert torch.equal(densify(conn), conn)
    assert torch.equal(densify(conn, dense_key_blocks=torch.tensor([0, 5])).sum(0),
                       torch.tensor([6, 1, 1, 1, 1, 6]))


def test_token_blocks_from_mask_and_density():
    m = torch.zeros(70, dtype=torch.bool)
    m[17] = True
    m[69] = True
    assert token_blocks_from_mask(m, 16).tolist() == [False, True, False, False, True]
    conn = torch.zeros(5, 5, dtype=torch.bool)
    conn[4, 4] = True  # the partial 6-token block with itself
    assert density(conn) == pytest.approx(1 / 25)
    assert density(conn, block_size=16, q_len=70) == pytest.approx(36 / 4900)
    assert density(torch.ones(5, 5, dtype=torch.bool), 16, 70) == pytest.approx(1.0)


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def test_validation_errors():
    q, k, v = qkv(L=70)
    good = torch.ones(5, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"shape \(4, 4\).*need \(5, 5\)"):
        block_sparse_attention(q, k, v, torch.ones(4, 4, dtype=torch.bool), 16)
    with pytest.raises(ValueError, match="must be torch.bool"):
        block_sparse_attention(q, k, v, good.float(), 16)
    empty = good.clone()
    empty[2] = False
    with pytest.raises(ValueError, match=r"no allowed key block \(first: \[2\]\)"):
        block_sparse_attention(q, k, v, empty, 16)
    with pytest.raises(ValueError, match="4-D tensor"):
        block_sparse_attention(q[0], k, v, good, 16)
    with pytest.raises(ValueError, match="block_size"):
        block_sparse_attention(q, k, v, good, 0)
    with pytest.raises(ValueError, match="backend"):
        block_sparse_attention(q, k, v, good, 16, backend="triton")
    for bad in (0, 0.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"mass must be in \(0, 1\]"):
            select_connectivity(torch.ones(3, 3) / 3, mass=bad)
    for bad in (0, 1.01, -1, float("nan"), True):
        with pytest.raises(ValueError, match=r"max_density must be a number in \(0, 1\]"):
            select_connectivity(torch.ones(3, 3) / 3, mass=0.5, max_density=bad)
    with pytest.raises(ValueError, match="2-D"):
        select_connectivity(torch.ones(3), mass=0.5)
    with pytest.raises(ValueError, match="torch.bool"):
        token_blocks_from_mask(torch.zeros(10), 4)
    with pytest.raises(ValueError, match="shape"):
        densify(good, dense_query_blocks=torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="outside"):
        densify(good, dense_key_blocks=[7])


# ---------------------------------------------------------------------------
# per-transformer-block state
# ---------------------------------------------------------------------------


def test_block_sparse_attention_class_attend_and_density():
    q, k, v = qkv(L=70, seed=12)
    conn = random_conn(5, 5, 0.2, 13)
    plan = BlockSparseAttention({3: conn}, block_size=16, seq_len=70)
    torch.testing.assert_close(plan.attend(0, q, k, v), F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(plan.attend(3, q, k, v), block_sparse_attention(q, k, v, conn, 16))
    assert plan.mean_density() == pytest.approx(density(conn, 16, 70))
    plan.set_dense_blocks(dense_query_blocks=[1], dense_key_blocks=torch.tensor([0, 0, 0, 0, 1], dtype=torch.bool))
    dense_conn = densify(conn, [1], [4])
    torch.testing.assert_close(plan.attend(3, q, k, v), reference_f64(q, k, v, dense_conn, 16).float(),
                               atol=1e-5, rtol=1e-5)
    assert plan.mean_density() == pytest.approx(density(dense_conn, 16, 70))
    with pytest.raises(ValueError, match="need"):
        plan.attend(3, *qkv(L=40))


def test_a_plan_that_allows_every_block_attends_densely_and_a_small_mask_is_expanded_once(monkeypatch):
    """A table densified to all True (a hit whose target region spans the clip) skips nothing: the plan runs dense
    attention, not a masked kernel that computes every block anyway (on a CPU 1.4x the dense time, mask
    included); a partial table's token mask is expanded at its first call only, not at every step."""
    expanded = []
    real = sa.expand_token_mask
    monkeypatch.setattr(sa, "expand_token_mask", lambda *a: expanded.append(a) or real(*a))
    q, k, v = qkv(L=70, seed=21)
    conn = random_conn(5, 5, 0.3, 22)
    plan = BlockSparseAttention({0: torch.ones(5, 5, dtype=torch.bool), 1: conn}, block_size=16)
    for _ in range(3):
        torch.testing.assert_close(plan.attend(0, q, k, v), F.scaled_dot_product_attention(q, k, v))
        torch.testing.assert_close(plan.attend(1, q, k, v), reference_f64(q, k, v, conn, 16).float(),
                                   atol=1e-5, rtol=1e-5)
    assert len(expanded) == 1
    plan.set_dense_blocks(dense_query_blocks=[0, 1, 2, 3, 4])     # now every pair of block 1 is allowed too
    torch.testing.assert_close(plan.attend(1, q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert len(expanded) == 1


def _token_mask_of_block_mask(bm, table, block_size, Lq, Lk):
    """Rebuild the token mask a BlockMask (tile 128) describes."""
    T = sa.FLEX_TILE
    out = torch.zeros(Lq, Lk, dtype=torch.bool)
    qi, ki = torch.arange(Lq), torch.arange(Lk)
    kv_n, kv_i = bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0]
    fn, fi = bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0]
    for t in range(kv_n.shape[0]):
        rows = slice(t * T, min((t + 1) * T, Lq))
        for j in fi[t, : fn[t]].tolist():
            out[rows, j * T:(j + 1) * T] = True
        for j in kv_i[t, : kv_n[t]].tolist():
            cols = slice(j * T, min((j + 1) * T, Lk))
            out[rows, cols] |= table[qi[rows] // block_size][:, ki[cols] // block_size]
    return out


@pytest.mark.skipif(not sa._HAS_FLEX, reason="flex_attention not in this torch")
@pytest.mark.parametrize("bs,L", [(128, 1000), (256, 1000), (64, 1000), (192, 700), (100, 390)])
def test_flex_block_mask_describes_the_table(bs, L):
    nb = sa.num_blocks(L, bs)
    conn = random_conn(nb, nb, 0.4, bs)
    mask_mod = (lambda b, h, q, kv: None) if bs % sa.FLEX_TILE else None
    bm = sa.build_block_mask(conn, bs, L, L, mask_mod=mask_mod)
    assert bm.seq_lengths == (L, L)
    got = _token_mask_of_block_mask(bm, conn, bs, L, L)
    assert torch.equal(got, sa.expand_token_mask(conn, bs, L, L))
    if bs % sa.FLEX_TILE == 0:
        assert int(bm.kv_num_blocks.sum()) == 0  # everything is a full block: no mask_mod


@needs_cuda
@pytest.mark.parametrize("bs,L", [(128, 1000), (64, 1000)])
def test_flex_matches_masked_sdpa_cuda(bs, L):
    q, k, v = qkv(L=L, D=64, dtype=torch.bfloat16, device="cuda", seed=bs)
    nb = sa.num_blocks(L, bs)
    conn = random_conn(nb, nb, 0.3, bs)
    out = block_sparse_attention(q, k, v, conn, bs, backend="flex")
    ref = reference_f64(q.cpu(), k.cpu(), v.cpu(), conn, bs)
    err = (out.cpu().double() - ref).norm() / ref.norm()
    assert err < 1e-2, float(err)


def test_fa4_backend_names_what_it_needs_where_it_cannot_run():
    q, k, v = qkv(L=300)     # float32 on the CPU: never an FA4 problem
    conn = torch.ones(3, 3, dtype=torch.bool)
    assert not sa.fa4_attention.supports(q, 128)
    with pytest.raises(ValueError, match="flash-attn-4 package, a Hopper GPU"):
        block_sparse_attention(q, k, v, conn, 128, backend="fa4")
    with pytest.raises(ValueError, match="flash-attn-4 package, a Hopper GPU"):
        BlockSparseAttention({0: conn}, block_size=128, backend="fa4").attend(0, q, k, v)
    auto = block_sparse_attention(q, k, v, conn, 128, backend="auto")
    assert torch.allclose(auto, F.scaled_dot_product_attention(q, k, v), atol=1e-5)


def test_fa4_runs_only_on_gpus_whose_kernel_runs_the_block_tables(monkeypatch):
    """Hopper: datacenter Blackwell's FA4 kernel refuses 128-row query blocks, consumer Blackwell's (12.x) takes a
    block table and ignores it (a hit would attend densely), Ada and Ampere have none."""
    capability = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    for capability["now"], runs in (((8, 9), False), ((9, 0), True), ((10, 0), False), ((11, 0), False),
                                    ((12, 0), False)):
        assert sa.fa4_attention._runs_on(torch.device("cuda", 0)) is runs, capability
    assert not sa.fa4_attention._runs_on(torch.device("cpu"))


class _FA4Interface:
    """flash-attn-4's interface where its kernel cannot run (an unsupported GPU, a broken install): every call
    raises `error`."""

    def __init__(self, error: Exception):
        self.error, self.calls = error, 0

    def flash_attn_func(self, *args, **kwargs):
        self.calls += 1
        raise self.error


@pytest.fixture
def fa4_that_fails(monkeypatch):
    """FA4 installed and on a GPU it claims (here the CPU) but failing; this process's failure record isolated."""
    def install(error: Exception) -> _FA4Interface:
        interface = _FA4Interface(error)
        monkeypatch.setattr(sa.fa4_attention, "_interface", lambda: (interface, lambda **fields: fields))
        monkeypatch.setattr(sa.fa4_attention, "_runs_on", lambda device: True)
        monkeypatch.setattr(sa.fa4_attention, "_FAILURE", [])
        return interface
    return install


def test_fa4_that_fails_warns_once_and_a_hit_attends_on_the_next_exact_kernel(fa4_that_fails, recwarn):
    interface = fa4_that_fails(ValueError("Unsupported compute capability: 130"))
    q, k, v = qkv(L=384, D=128, dtype=torch.bfloat16)
    conn = random_conn(3, 3, 0.5)
    expected = block_sparse_attention(q, k, v, conn, 128, backend="sdpa")
    attention = BlockSparseAttention({0: conn}, block_size=128)
    for _ in range(2):
        assert torch.equal(attention.attend(0, q, k, v), expected)
        assert torch.equal(block_sparse_attention(q, k, v, conn, 128), expected)
    assert interface.calls == 1        # not tried again in this process
    failed = [str(w.message) for w in recwarn if "FlashAttention-4 failed" in str(w.message)]
    assert len(failed) == 1 and "Unsupported compute capability: 130" in failed[0], failed
    with pytest.raises(ValueError, match="failed earlier in this process .ValueError: Unsupported compute capab"):
        block_sparse_attention(q, k, v, conn, 128, backend="fa4")     # asked for by name, it says why not


def test_fa4_out_of_memory_goes_to_the_callers_and_fa4_stays_in_use(fa4_that_fails):
    interface = fa4_that_fails(torch.OutOfMemoryError("CUDA out of memory"))
    q, k, v = qkv(L=256, D=128, dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError):
        BlockSparseAttention({0: torch.eye(2, dtype=torch.bool)}, block_size=128).attend(0, q, k, v)
    assert interface.calls == 1 and sa.fa4_attention._FAILURE == [] and sa.fa4_attention.supports(q)


def test_a_region_step_on_fa4_that_fails_attends_with_the_hosts_kernel(fa4_that_fails):
    from carnator_engine.region import RegionTokens
    fa4_that_fails(RuntimeError("cute DSL compile error"))
    q, k, v = qkv(L=256, D=128, dtype=torch.bfloat16)
    region = RegionTokens(torch.ones(256, dtype=torch.bool), frozenset({0}), fa4=True)
    host = []
    with pytest.warns(RuntimeWarning, match="FlashAttention-4 failed"):
        out = region.attend(0, q, k, v, lambda *qkv_: host.append(1) or F.scaled_dot_product_attention(*qkv_),
                            host_sdpa=True)
    assert host == [1] and torch.equal(out, F.scaled_dot_product_attention(q, k, v))


@needs_cuda
@pytest.mark.parametrize("L", [1000, 1024])
def test_fa4_matches_f64_reference_cuda(L):
    if torch.cuda.get_device_capability()[0] < 9 or sa.fa4_attention._interface() is None:
        pytest.skip("needs flash-attn-4 (the gpu extra) and a Hopper-or-newer GPU")
    q, k, v = qkv(L=L, D=128, dtype=torch.bfloat16, device="cuda", seed=L)
    nb = sa.num_blocks(L, 128)
    conn = random_conn(nb, nb, 0.3, 5)
    out = block_sparse_attention(q, k, v, conn, 128, backend="fa4")
    ref = reference_f64(q.cpu(), k.cpu(), v.cpu(), conn, 128)
    assert float((out.cpu().double() - ref).norm() / ref.norm()) < 1e-2
    plan = BlockSparseAttention({0: conn}, block_size=128, backend="auto")
    assert torch.equal(plan.attend(0, q, k, v), out)


@needs_cuda
def test_fa4_dense_is_exact_attention_of_fewer_queries_over_every_key_cuda():
    """attention.fa4.dense (a region step's target over the whole clip, CarnatorConfig.region_fa4): queries and keys
    of different lengths, [B, H, L, D] views of [B, L, H*D] projections as the hosts make them."""
    if not sa.fa4_attention.supports(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("needs flash-attn-4 (the gpu extra) and a Hopper-or-newer GPU")
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, length, 4 * 128, generator=generator, device="cuda", dtype=torch.bfloat16)
               .view(2, length, 4, 128).transpose(1, 2) for length in (300, 1000, 1000))
    out = sa.fa4_attention.dense(q, k, v)
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert out.shape == q.shape and float((out.double() - reference).norm() / reference.norm()) < 1e-2


@needs_cuda
def test_plan_attend_cuda_reuses_block_mask():
    L, bs = 1000, 128
    q, k, v = qkv(L=L, D=64, dtype=torch.bfloat16, device="cuda", seed=3)
    conn = random_conn(8, 8, 0.3, 3)
    plan = BlockSparseAttention({5: conn}, block_size=bs, dense_query_blocks=[2], backend="flex")
    out = plan.attend(5, q, k, v)
    assert len(plan._runners) == 1
    torch.testing.assert_close(plan.attend(5, q, k, v), out, atol=0, rtol=0)
    assert len(plan._runners) == 1
    ref = reference_f64(q.cpu(), k.cpu(), v.cpu(), densify(conn, [2]), bs)
    assert float((out.cpu().double() - ref).norm() / ref.norm()) < 1e-2


def test_default_kernel_options(monkeypatch):
    assert sa.default_kernel_options("cpu") == {}
    monkeypatch.setattr(sa, "DEFAULT_FLEX_KERNEL_OPTIONS", {"BLOCK_N": 32})
    assert sa.default_kernel_options("cpu") == {"BLOCK_N": 32}


@pytest.mark.skipif(not sa._HAS_FLEX, reason="flex_attention not in this torch")
def test_flex_refuses_past_recompile_limit(monkeypatch):
    monkeypatch.setattr(sa, "_recompile_limit", lambda: len(sa._FLEX_CACHE))
    q, k, v = qkv(L=40, D=8, seed=9)
    with pytest.raises(RuntimeError, match="recompile_limit"):
        sa.prepare_flex(q, k, v, torch.ones(1, 1, dtype=torch.bool), 64)


# ---------------------------------------------------------------------------
# benchmark smoke run
# ---------------------------------------------------------------------------


def test_benchmark_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("attention_kernels", ROOT / "benchmarks" / "attention_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ak.json"
    result = mod.main(["--smoke", "--fa4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["config"]["smoke"] is True
    assert data["timing"] and all(r["median_ms"] > 0 for r in data["timing"])
    main = result["correctness"]["main"]
    assert main["random_d0.3"]["rel_err_sdpa_masked_vs_f64_rows"] < 1e-5
    # FlashAttention-4 cannot run on a CPU: each of its rows says why instead of failing the benchmark
    assert [row["target_density"] for row in data["fa4"]] == [0.1, 0.2, 0.3, 0.5, 1.0]
    assert all("flash-attn-4" in row["error"] for row in data["fa4"])


def test_benchmark_smoke_region_rows_without_flex(tmp_path):
    """attention_kernels.py --skip-flex --region-shares: the dense kernels and the region step's target attention
    (SDPA against FA4 dense, each row why FA4 cannot run on a CPU), no flex part."""
    spec = importlib.util.spec_from_file_location("attention_kernels", ROOT / "benchmarks" / "attention_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ak.json"
    mod.main(["--smoke", "--skip-flex", "--region-shares", "0.1,0.3", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["correctness"] == {} and {row["pattern"] for row in data["timing"]} == {"dense"}
    assert [row["query_share"] for row in data["region"]] == [0.1, 0.3]
    assert [row["queries"] for row in data["region"]] == [6, 18]          # of L = 60 smoke tokens
    assert all(row["sdpa"]["median_ms"] > 0 and "flash-attn-4" in row["error"] for row in data["region"])
    with pytest.raises(SystemExit):
        mod.main(["--smoke", "--region-shares", "1.5"])
