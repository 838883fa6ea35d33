"""Block-sparse attention from cached connectivity.

On a cache hit, Carnator runs the remaining denoising steps with the block-sparse
attention *connectivity* recorded from an earlier, similar generation: which key
blocks each query block attends to.  This module holds the whole life of such a
connectivity:

* summarise a generation's attention cheaply (:func:`pooled_block_attention`),
* turn the summary into a boolean block table (:func:`select_connectivity`),
* open it up where a target region must be recomputed densely (:func:`densify`,
  :func:`token_blocks_from_mask`),
* run exact attention restricted to the allowed blocks
  (:func:`block_sparse_attention`), and
* keep one table per transformer block with explicit state
  (:class:`BlockSparseAttention`; stored as boolean tables by
  :mod:`carnator_engine.attention.connectivity`).

Conventions
-----------
Token sequences are frame-major (frames x h x w flattened) and q/k/v are
``[B, heads, L, D]``.  A *block* is ``block_size`` consecutive tokens; the last
block may be partial; ``nb = ceil(L / block_size)``.  A connectivity is a
``torch.bool`` tensor ``[nqb, nkb]``: ``True`` where query block ``i`` may attend
key block ``j``.  Inside an allowed block pair every token pair is allowed, so the
result is *exact* attention under a block-granular mask, not an approximation of
it.

Backends of :func:`block_sparse_attention`
------------------------------------------
* ``"sdpa"`` (CPU, reference, fallback): ``scaled_dot_product_attention`` with the
  boolean token mask expanded from the block table.  Memory grows as ``Lq * Lk``.
* ``"flex"`` (CUDA): ``torch.nn.attention.flex_attention`` with a ``BlockMask``
  built directly from the block table via ``BlockMask.from_kv_blocks`` (no
  ``Lq x Lk`` mask is ever built).  The kernel tile is 128 tokens:

  - ``block_size`` a multiple of 128: each connectivity block is split into
    128-token tiles and every allowed tile is a *full* block (the kernel skips the
    mask function entirely; a partial last tile is bounded by the kernel itself).
  - any other ``block_size`` (e.g. 64): no padding of q/k/v.  A 128-tile pair is
    *full* when all block pairs it overlaps are allowed, *partial* when only some
    are; partial tiles evaluate a ``mask_mod`` that indexes the block table
    (``table[q // block_size, kv // block_size]``), so the result stays exact.  This
    is slower than a multiple of 128; prefer 128.

  The compiled flex kernel is cached per (B, heads, Lq, Lk, D, dtype, device,
  block_size, tiling path); the BlockMask is rebuilt from the table on every call
  (a few small tensor ops), so any connectivity can be passed without a
  recompile.  Compilation is ``torch.compile(flex_attention, dynamic=False)``.  All
  entries are graphs of the same function, so they count against dynamo's
  ``recompile_limit`` (8 by default); past it dynamo would run flex eagerly (an
  ``Lq x Lk`` score matrix), so a new shape beyond the limit falls back to masked
  SDPA with a warning instead.  :class:`BlockSparseAttention` also keeps each
  block's BlockMask, since its table is fixed across steps (building one costs
  ~2 ms of host time on an H200 for a 256x256 table, comparable to the kernel).
* ``"fa4"`` (CUDA, Hopper, optional ``flash-attn-4`` package): FlashAttention-4's block-sparse
  kernel (:mod:`carnator_engine.attention.fa4`), every allowed block a full block; ``block_size`` a
  multiple of 128, bf16/fp16, head size <= 128.  On an H200 it runs a 0.3-density table in 0.27 of dense
  cuDNN's time where flex needs 0.40.
* ``"auto"`` (default): fa4 where it runs, else flex on CUDA when it is importable and compiles, else sdpa
  (a warning is issued once per shape if flex failed, once per process if fa4 did: then it is not tried again).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from . import fa4 as fa4_attention

try:  # flex_attention exists from torch 2.5; keep the module importable without it
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    _HAS_FLEX = True
except Exception:  # pragma: no cover - depends on the torch build
    BlockMask = None  # type: ignore[assignment]
    flex_attention = None  # type: ignore[assignment]
    _HAS_FLEX = False

__all__ = [
    "FLEX_TILE",
    "BlockSparseAttention",
    "block_sparse_attention",
    "build_block_mask",
    "densify",
    "density",
    "expand_token_mask",
    "flex_available",
    "num_blocks",
    "DEFAULT_FLEX_KERNEL_OPTIONS",
    "HOPPER_FLEX_KERNEL_OPTIONS",
    "default_kernel_options",
    "pooled_block_attention",
    "prepare_flex",
    "select_connectivity",
    "token_blocks_from_mask",
    "tiled_block_size",
    "with_dense_tail",
]

FLEX_TILE = 128
"""Token tile of the flex kernel's sparse block (BlockMask BLOCK_SIZE)."""



# ----------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------


def num_blocks(length: int, block_size: int) -> int:
    """``ceil(length / block_size)``."""
    return -(-int(length) // int(block_size))


def _check_block_size(block_size: Any) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise ValueError(
            f"block_size must be a positive int (tokens per block), got {block_size!r}"
        )
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive int (tokens per block), got {block_size}")
    return int(block_size)


TILED_BLOCK_SIZES = "16, 32, 64 or a multiple of 128"
"""The block sizes :func:`tiled_block_size` takes, as its error names them."""


def tiled_block_size(block_size: Any) -> int:
    """``block_size``, or a ValueError naming the sizes a generation's connectivity may be recorded at: 16, 32 or
    64 tokens (whole fractions of flex's 128-token tile, so a tile's mask is a few whole blocks) or a multiple of
    128 (whole tiles, every allowed tile a full one; FA4 takes only these). Any other size (7, 100) makes nearly
    every tile a partly masked one, which flex runs through the mask function at a fraction of its speed, and FA4
    cannot run at all; below 16 the tables grow to millions of blocks a transformer block."""
    size = _check_block_size(block_size)
    if size % FLEX_TILE and size not in (16, 32, 64):
        raise ValueError(f"block_size={size} is not a size the block-sparse attention tiles: use "
                         f"{TILED_BLOCK_SIZES} tokens")
    return size


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a 4-D tensor [B, heads, L, D], got {got}; "
                "reshape from [B, L, heads*D] with .view(B, L, heads, D).transpose(1, 2)"
            )
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, heads and D "
            "([B, heads, L, D])"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must share B, heads and L "
            "([B, heads, L, D])"
        )


def _block_sizes(length: int, block_size: int, device=None) -> torch.Tensor:
    """Real number of tokens in each block (the last one may be partial)."""
    nb = num_blocks(length, block_size)
    sizes = torch.full((nb,), float(block_size), dtype=torch.float64, device=device)
    if nb:
        sizes[-1] = length - (nb - 1) * block_size
    return sizes


def _diagonal_index(nqb: int, nkb: int, device=None) -> torch.Tensor:
    """Key block on the 'diagonal' of each query block (``i`` when square)."""
    return (torch.arange(nqb, device=device) * nkb) // max(nqb, 1)


def _block_pool(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Mean of x [B, H, L, D] over each block of tokens -> float32 [B, H, nb, D]. Summed in float32 straight from
    x's strided view: a float copy (and a padded one) of a video's q and k cost more than the pooling itself."""
    L = x.shape[2]
    full = L // block_size
    parts = []
    if full:
        parts.append(x[:, :, :full * block_size].unflatten(2, (full, block_size)).sum(3, dtype=torch.float32))
    if L > full * block_size:
        parts.append(x[:, :, full * block_size:].sum(2, keepdim=True, dtype=torch.float32))
    sums = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    counts = _block_sizes(L, block_size, device=x.device).to(torch.float32)
    return sums / counts.view(1, 1, -1, 1)


def _as_block_mask_vector(blocks: Any, nb: int, what: str, device) -> torch.Tensor:
    """Accept a BoolTensor[nb] or an iterable / LongTensor of block indices."""
    if isinstance(blocks, torch.Tensor) and blocks.dtype == torch.bool:
        if blocks.dim() != 1 or blocks.shape[0] != nb:
            raise ValueError(
                f"{what} as a bool mask must have shape ({nb},) (one entry per block), "
                f"got {tuple(blocks.shape)}; build it with token_blocks_from_mask"
            )
        return blocks.to(device)
    idx = torch.as_tensor(list(blocks) if not isinstance(blocks, torch.Tensor) else blocks)
    if idx.numel() == 0:
        return torch.zeros(nb, dtype=torch.bool, device=device)
    if idx.dtype.is_floating_point or idx.dtype == torch.bool or idx.dim() != 1:
        raise ValueError(
            f"{what} must be a BoolTensor[{nb}] or a 1-D sequence of integer block indices, "
            f"got dtype {idx.dtype} shape {tuple(idx.shape)}"
        )
    if int(idx.min()) < -nb or int(idx.max()) >= nb:
        raise ValueError(
            f"{what} has block indices outside [0, {nb}) "
            f"(min {int(idx.min())}, max {int(idx.max())})"
        )
    out = torch.zeros(nb, dtype=torch.bool, device=device)
    out[idx.to(device=device, dtype=torch.long)] = True
    return out


# ----------------------------------------------------------------------------
# attention structure summary and connectivity
# ----------------------------------------------------------------------------


def pooled_block_attention(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-level attention summary ``[nqb, nkb]`` (float32, rows sum to 1).

    q and k are mean-pooled within each block (a partial last block is averaged over
    its real tokens), then ``softmax(q_pool @ k_pool^T / sqrt(D))`` over key blocks,
    averaged over batch and heads.  Costs ``O(nqb * nkb * D)``, never ``Lq * Lk``.
    """
    block_size = _check_block_size(block_size)
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, heads, L, D]")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must share B, heads and D"
        )
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError("q and k need at least one token")
    with torch.no_grad():
        qp = _block_pool(q, block_size)
        kp = _block_pool(k, block_size)
        scores = torch.matmul(qp, kp.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores, dim=-1)
        return probs.mean(dim=(0, 1)).to(torch.float32)


def select_connectivity(
    block_attention: torch.Tensor, mass: float = 0.9, min_blocks_per_row: int = 1, max_density: float = 1.0,
    check_values: bool = True,
) -> torch.Tensor:
    """Smallest per-row set of key blocks whose pooled mass reaches ``mass``, capped at ``max_density``.

    Rows are normalised to sum to 1 first (so averaged or unnormalised summaries
    work too).  A row keeps at most ``ceil(max_density * nkb)`` of its largest blocks
    (a budget: near-uniform attention would otherwise need almost every block to
    reach the mass, and a kernel that visits 90 % of the blocks saves nothing), at least
    ``min_blocks_per_row``, and always the diagonal block (``j = i * nkb // nqb``).
    Ties are broken towards the lower key index.  ``check_values=False`` skips the finite and non-negative check
    (two device synchronisations, mid-step on a GPU) for a summary known to hold probabilities: pooled_block_attention's.
    """
    if isinstance(mass, bool) or not isinstance(mass, (int, float, np.floating, np.integer)):
        raise ValueError(f"mass must be a number in (0, 1], got {mass!r}")
    mass = float(mass)
    if not (0.0 < mass <= 1.0):  # also rejects NaN
        raise ValueError(
            f"mass must be in (0, 1] (fraction of each row's pooled attention to keep), got {mass}"
        )
    if isinstance(max_density, bool) or not isinstance(max_density, (int, float, np.floating, np.integer)) \
            or not 0.0 < float(max_density) <= 1.0:
        raise ValueError(f"max_density must be a number in (0, 1] (share of key blocks a row may keep), "
                         f"got {max_density!r}")
    if isinstance(min_blocks_per_row, bool) or not isinstance(min_blocks_per_row, (int, np.integer)):
        raise ValueError(f"min_blocks_per_row must be an int >= 0, got {min_blocks_per_row!r}")
    if min_blocks_per_row < 0:
        raise ValueError(f"min_blocks_per_row must be an int >= 0, got {min_blocks_per_row}")
    if not isinstance(block_attention, torch.Tensor) or block_attention.dim() != 2:
        got = tuple(block_attention.shape) if isinstance(block_attention, torch.Tensor) else type(block_attention).__name__
        raise ValueError(
            f"block_attention must be a 2-D tensor [nqb, nkb] (see pooled_block_attention), got {got}"
        )
    if block_attention.dtype == torch.bool or not block_attention.dtype.is_floating_point:
        raise ValueError(
            f"block_attention must be a floating tensor of block masses, got {block_attention.dtype}"
        )
    nqb, nkb = block_attention.shape
    if nqb == 0 or nkb == 0:
        raise ValueError(f"block_attention is empty: shape {(nqb, nkb)}")
    p = block_attention.detach().to(torch.float64)
    if check_values and (not bool(torch.isfinite(p).all()) or bool((p < 0).any())):
        raise ValueError("block_attention must be finite and non-negative")
    row_sum = p.sum(dim=-1, keepdim=True)
    p = torch.where(row_sum > 0, p / row_sum.clamp_min(1e-300), torch.full_like(p, 1.0 / nkb))

    order = torch.argsort(p, dim=-1, descending=True, stable=True)
    sorted_p = torch.gather(p, -1, order)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # exclusive prefix sum
    # keep a block while the mass gathered before it is still short of the goal
    # (a 1e-9 slack so that mass=1.0 is reachable despite rounding)
    keep_sorted = mass_before < mass - 1e-9
    rank = torch.arange(nkb, device=p.device)
    keep_sorted &= rank < math.ceil(float(max_density) * nkb - 1e-9)
    keep_sorted |= rank < min_blocks_per_row
    conn = torch.zeros((nqb, nkb), dtype=torch.bool, device=p.device)
    conn.scatter_(-1, order, keep_sorted)
    rows = torch.arange(nqb, device=p.device)
    conn[rows, _diagonal_index(nqb, nkb, device=p.device)] = True
    return conn.to(block_attention.device)


def densify(
    connectivity: torch.Tensor,
    dense_query_blocks: Any = None,
    dense_key_blocks: Any = None,
) -> torch.Tensor:
    """Open up the table where a target region is recomputed densely.

    Rows of ``dense_query_blocks`` become all True (the region sees everything) and
    columns of ``dense_key_blocks`` become all True (everyone sees the region).  Each
    may be a ``BoolTensor[nb]`` (e.g. from :func:`token_blocks_from_mask`), a sequence
    of block indices, or None.  Returns a new tensor; the input is not modified.
    """
    _check_connectivity_type(connectivity)
    out = connectivity.clone()
    nqb, nkb = out.shape
    if dense_query_blocks is not None:
        rows = _as_block_mask_vector(dense_query_blocks, nqb, "dense_query_blocks", out.device)
        out[rows, :] = True
    if dense_key_blocks is not None:
        cols = _as_block_mask_vector(dense_key_blocks, nkb, "dense_key_blocks", out.device)
        out[:, cols] = True
    return out


def with_dense_tail(connectivity: torch.Tensor, block_size: int, video_tokens: int, q_len: int,
                    kv_len: int) -> torch.Tensor:
    """A video connectivity extended to a joint sequence (the video's tokens first, then others, e.g. text): every
    block holding any token past ``video_tokens`` is dense as a query and as a key, so those tokens attend and are
    attended in full; blocks of video tokens alone keep the video table."""
    video_blocks = video_tokens // block_size
    table = torch.ones(num_blocks(q_len, block_size), num_blocks(kv_len, block_size), dtype=torch.bool,
                       device=connectivity.device)
    table[:video_blocks, :video_blocks] = connectivity[:video_blocks, :video_blocks]
    return table


def token_blocks_from_mask(token_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """``BoolTensor[nb]``: a block is marked if any of its tokens is."""
    block_size = _check_block_size(block_size)
    if not isinstance(token_mask, torch.Tensor) or token_mask.dim() != 1:
        got = tuple(token_mask.shape) if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
        raise ValueError(
            f"token_mask must be a 1-D tensor [L] over the frame-major token sequence, got {got}; "
            "flatten a [frames, h, w] mask with .flatten()"
        )
    if token_mask.dtype != torch.bool:
        raise ValueError(
            f"token_mask must be torch.bool, got {token_mask.dtype}; threshold it first (mask > 0.5)"
        )
    L = token_mask.shape[0]
    nb = num_blocks(L, block_size)
    pad = nb * block_size - L
    m = F.pad(token_mask, (0, pad), value=False) if pad else token_mask
    return m.view(nb, block_size).any(dim=-1)


def density(
    connectivity: torch.Tensor,
    block_size: int | None = None,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> float:
    """Fraction of allowed (query, key) pairs.

    With ``block_size`` and the sequence lengths (``q_len``; ``kv_len`` defaults to
    ``q_len``), each block pair is weighted by its real token count, so a partial
    last block counts for what it holds.  Without them, all blocks weigh the same
    (exact when the length is a multiple of block_size).
    """
    _check_connectivity_type(connectivity)
    nqb, nkb = connectivity.shape
    if nqb == 0 or nkb == 0:
        return 0.0
    c = connectivity.to(torch.float64)
    if block_size is None or q_len is None:
        return float(c.mean())
    block_size = _check_block_size(block_size)
    kv_len = q_len if kv_len is None else kv_len
    if num_blocks(q_len, block_size) != nqb or num_blocks(kv_len, block_size) != nkb:
        raise ValueError(
            f"connectivity {(nqb, nkb)} does not match q_len={q_len}, kv_len={kv_len}, "
            f"block_size={block_size} (expected {(num_blocks(q_len, block_size), num_blocks(kv_len, block_size))})"
        )
    wq = _block_sizes(q_len, block_size, device=c.device)
    wk = _block_sizes(kv_len, block_size, device=c.device)
    return float((wq @ c @ wk) / (float(q_len) * float(kv_len)))


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


def _check_connectivity_type(connectivity: Any) -> None:
    if not isinstance(connectivity, torch.Tensor):
        raise ValueError(
            f"connectivity must be a torch.bool tensor [nqb, nkb], got {type(connectivity).__name__}"
        )
    if connectivity.dtype != torch.bool:
        raise ValueError(
            f"connectivity must be torch.bool, got {connectivity.dtype}; "
            "build it with select_connectivity or convert with `conn > 0`"
        )
    if connectivity.dim() != 2:
        raise ValueError(
            f"connectivity must be 2-D [nqb, nkb], got shape {tuple(connectivity.shape)}"
        )


def _check_connectivity(connectivity: Any, q_len: int, kv_len: int, block_size: int) -> None:
    _check_connectivity_type(connectivity)
    want = (num_blocks(q_len, block_size), num_blocks(kv_len, block_size))
    if tuple(connectivity.shape) != want:
        raise ValueError(
            f"connectivity has shape {tuple(connectivity.shape)} but q/k with L_q={q_len}, "
            f"L_k={kv_len} and block_size={block_size} need {want} "
            "(ceil(L_q/block_size), ceil(L_k/block_size)); rebuild the connectivity at this "
            "resolution and block_size, or check that the cached plan belongs to this latent shape"
        )
    empty = ~connectivity.any(dim=1)
    if bool(empty.any()):
        rows = torch.nonzero(empty).flatten()[:8].tolist()
        raise ValueError(
            f"connectivity has {int(empty.sum())} query block row(s) with no allowed key block "
            f"(first: {rows}); every row needs at least one key block - keep the diagonal "
            "(select_connectivity does) or densify those rows"
        )


# ----------------------------------------------------------------------------
# the attention itself
# ----------------------------------------------------------------------------


def expand_token_mask(connectivity: torch.Tensor, block_size: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Token-level boolean mask ``[q_len, kv_len]`` of a block table (True = attend)."""
    dev = connectivity.device
    qb = torch.arange(q_len, device=dev) // block_size
    kb = torch.arange(kv_len, device=dev) // block_size
    return connectivity[qb][:, kb]


def _sdpa_block_sparse(q, k, v, connectivity, block_size, scale):
    mask = expand_token_mask(connectivity.to(q.device), block_size, q.shape[2], k.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


BACKENDS = ("auto", "fa4", "flex", "sdpa")
# Token masks up to this many entries (4 MiB of bools) are kept per block by BlockSparseAttention for the masked SDPA
# fallback; a larger one (a real video's) is expanded at each call, as keeping one per block would hold gigabytes.
_KEPT_TOKEN_MASK = 1 << 22


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")


def flex_available() -> bool:
    """True when flex_attention can be used (importable and a CUDA device present)."""
    return _HAS_FLEX and torch.cuda.is_available()


def _tile_overlap(length: int, block_size: int, tile: int, device) -> torch.Tensor:
    """``[ntiles, nblocks]`` True where tile t and block b share a real token."""
    nt = num_blocks(length, tile)
    nb = num_blocks(length, block_size)
    t0 = torch.arange(nt, device=device) * tile
    t1 = torch.clamp(t0 + tile, max=length)
    b0 = torch.arange(nb, device=device) * block_size
    b1 = torch.clamp(b0 + block_size, max=length)
    return (torch.maximum(t0[:, None], b0[None, :]) < torch.minimum(t1[:, None], b1[None, :]))


def _tiles_to_kv_blocks(tiles: torch.Tensor):
    """[nqt, nkt] bool -> (num_blocks [1,1,nqt] int32, indices [1,1,nqt,nkt] int32)."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    # allowed tiles first, each group in ascending key order
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


@dataclass
class _FlexEntry:
    """One compiled flex kernel with the buffers its mask function reads."""

    compiled: Any
    mask_mod: Any = None
    table: torch.Tensor | None = None  # block table read by mask_mod (partial tiles)
    failed: bool = False


_FLEX_CACHE: dict[tuple, _FlexEntry] = {}

DEFAULT_FLEX_KERNEL_OPTIONS: dict | None = None
"""kernel_options for flex_attention when a call gives none.  None: chosen per device
by :func:`default_kernel_options`; a dict (``{}`` = torch's own defaults) overrides."""

HOPPER_FLEX_KERNEL_OPTIONS: dict = {"USE_TMA": True}
"""Measured on an H200 (torch 2.11, bf16, D=128, L=32760): TMA loads cut the flex
kernel time by 6-8% at densities 0.1/0.3/1.0 with identical output
(benchmarks/results/kernels/attention_kernels_h200.json, ``flex_kernel_options``)."""


def default_kernel_options(device: torch.device | str) -> dict:
    """flex kernel_options used when none are given for tensors on ``device``."""
    if DEFAULT_FLEX_KERNEL_OPTIONS is not None:
        return dict(DEFAULT_FLEX_KERNEL_OPTIONS)
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        return dict(HOPPER_FLEX_KERNEL_OPTIONS)
    return {}


def _recompile_limit() -> int:
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", 8)))


def _flex_entry(key: tuple, needs_mask_mod: bool, table_shape, device, block_size: int) -> _FlexEntry:
    entry = _FLEX_CACHE.get(key)
    if entry is not None:
        return entry
    # every entry is one more compiled graph of flex_attention's code; past dynamo's
    # recompile limit it would run flex *eagerly* (an Lq x Lk score matrix per head),
    # so refuse instead and let the caller fall back to masked SDPA
    if len(_FLEX_CACHE) >= _recompile_limit():
        raise RuntimeError(
            f"{len(_FLEX_CACHE)} flex kernels are compiled already (torch._dynamo.config."
            "recompile_limit); raise that limit to compile one for another shape"
        )
    compiled = torch.compile(flex_attention, dynamic=False)
    entry = _FlexEntry(compiled=compiled)
    if needs_mask_mod:
        table = torch.zeros(table_shape, dtype=torch.bool, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return table[q_idx // block_size, kv_idx // block_size]

        entry.mask_mod = mask_mod
        entry.table = table
    _FLEX_CACHE[key] = entry
    return entry


def build_block_mask(
    connectivity: torch.Tensor,
    block_size: int,
    q_len: int,
    kv_len: int,
    mask_mod=None,
):
    """flex ``BlockMask`` (tile 128) of a block table, built from the table directly.

    With ``block_size % 128 == 0`` every allowed tile is a full block and
    ``mask_mod`` is not needed.  Otherwise tiles that are only partly allowed become
    partial blocks and need ``mask_mod`` (indexing the table); pass one.
    """
    if not _HAS_FLEX:
        raise RuntimeError("torch.nn.attention.flex_attention is not available in this torch build")
    dev = connectivity.device
    nqt, nkt = num_blocks(q_len, FLEX_TILE), num_blocks(kv_len, FLEX_TILE)
    if block_size % FLEX_TILE == 0:
        r = block_size // FLEX_TILE
        full = connectivity.repeat_interleave(r, dim=0).repeat_interleave(r, dim=1)[:nqt, :nkt]
        partial = torch.zeros_like(full)
    else:
        rq = _tile_overlap(q_len, block_size, FLEX_TILE, dev).to(torch.float32)
        rk = _tile_overlap(kv_len, block_size, FLEX_TILE, dev).to(torch.float32)
        allowed = rq @ connectivity.to(torch.float32) @ rk.T  # allowed block pairs per tile pair
        total = rq.sum(1)[:, None] * rk.sum(1)[None, :]
        full = allowed >= total
        partial = (allowed > 0) & ~full
        if mask_mod is None and bool(partial.any()):
            raise ValueError(
                f"block_size={block_size} is not a multiple of {FLEX_TILE}: partly allowed tiles "
                "need a mask_mod that indexes the block table"
            )
    kv_n, kv_i = _tiles_to_kv_blocks(partial)
    full_n, full_i = _tiles_to_kv_blocks(full)
    return BlockMask.from_kv_blocks(
        kv_n,
        kv_i,
        full_n,
        full_i,
        BLOCK_SIZE=FLEX_TILE,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )


_WARNED: set = set()


def prepare_flex(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    connectivity: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    kernel_options: Mapping[str, Any] | None = None,
):
    """Build the BlockMask of a (validated) table once -> ``fn(q, k, v)`` running flex.

    The compiled kernel comes from the per-shape cache; the returned callable holds
    the BlockMask, so repeated calls with the same table skip the mask build (for
    ``block_size`` not a multiple of 128 it re-copies the table into the kernel's
    mask buffer on each call).  Raises if flex is unavailable; no validation here.
    ``kernel_options`` (flex's, e.g. ``{"USE_TMA": True}``) default to
    :func:`default_kernel_options` (TMA on Hopper, torch's defaults elsewhere).
    """
    if not _HAS_FLEX:
        raise RuntimeError("torch.nn.attention.flex_attention is not available in this torch build")
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    multiple = block_size % FLEX_TILE == 0
    # the mask_mod table covers the padded tile range so no index can fall outside it
    table_shape = (
        num_blocks(num_blocks(Lq, FLEX_TILE) * FLEX_TILE, block_size),
        num_blocks(num_blocks(Lk, FLEX_TILE) * FLEX_TILE, block_size),
    )
    opts = default_kernel_options(q.device) if kernel_options is None else dict(kernel_options)
    key = (B, H, Lq, Lk, D, v.shape[-1], q.dtype, str(q.device), block_size, multiple,
           tuple(sorted(opts.items())))
    entry = _flex_entry(key, not multiple, table_shape, q.device, block_size)
    if entry.failed:
        raise RuntimeError(f"flex_attention failed earlier for {key}")
    conn = connectivity.to(q.device)
    block_mask = build_block_mask(conn, block_size, Lq, Lk, mask_mod=entry.mask_mod)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if entry.table is not None:
            entry.table.zero_()
            entry.table[: conn.shape[0], : conn.shape[1]].copy_(conn)
        try:
            return entry.compiled(q, k, v, block_mask=block_mask, scale=scale,
                                  kernel_options=opts or None)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:
            entry.failed = True
            raise

    run.key = key  # type: ignore[attr-defined]
    return run


def _warn_flex_failure(q: torch.Tensor, k: torch.Tensor, block_size: int, exc: Exception) -> None:
    key = (tuple(q.shape), tuple(k.shape), q.dtype, block_size)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(
            f"flex_attention failed for q {tuple(q.shape)} block_size={block_size} "
            f"({type(exc).__name__}: {str(exc)[:300]}); using masked SDPA instead",
            RuntimeWarning,
            stacklevel=4,
        )


def _flex_block_sparse(q, k, v, connectivity, block_size, scale, kernel_options=None):
    """flex output, or None (with a warning once per shape) when flex fails."""
    try:
        return prepare_flex(q, k, v, connectivity, block_size, scale, kernel_options)(q, k, v)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # compile or launch failure: fall back to exact SDPA
        _warn_flex_failure(q, k, block_size, exc)
        return None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    connectivity: torch.Tensor,
    block_size: int,
    *,
    scale: float | None = None,
    backend: str = "auto",
    validate: bool = True,
    kernel_options: Mapping[str, Any] | None = None,
) -> torch.Tensor:
    """Exact attention restricted to the allowed block pairs -> ``[B, heads, Lq, Dv]``.

    ``backend``: ``"auto"`` (fa4 where it runs, else flex on CUDA, else masked SDPA), ``"fa4"`` and
    ``"flex"`` (raise where unavailable), ``"sdpa"`` (masked SDPA everywhere).  ``scale`` defaults to
    ``1/sqrt(D)``.  ``validate=False`` skips the table checks (they synchronise a
    CUDA device); use it only for a table that was validated before.
    ``kernel_options`` go to flex_attention (see :func:`prepare_flex`).
    """
    block_size = _check_block_size(block_size)
    _check_qkv(q, k, v)
    _check_backend(backend)
    if validate:
        _check_connectivity(connectivity, q.shape[2], k.shape[2], block_size)
    if backend == "fa4" and not fa4_attention.supports(q, block_size):
        failed = fa4_attention.failure()
        why = f"failed earlier in this process ({failed})" if failed else (
            "needs the flash-attn-4 package, a Hopper GPU, bf16/fp16 tensors, a head size <= 128 and a block size "
            "that is a multiple of 128")
        raise ValueError(f"backend='fa4' {why}; use backend='auto' to fall back")
    if backend in ("auto", "fa4") and fa4_attention.supports(q, block_size):
        try:
            return fa4_attention.prepare(connectivity.to(q.device), block_size, scale)(q, k, v)
        except fa4_attention.Failed:
            if backend == "fa4":
                raise
    if backend == "flex" and not (flex_available() and q.is_cuda):
        raise ValueError(
            "backend='flex' needs torch.nn.attention.flex_attention and CUDA tensors; "
            "use backend='auto' to fall back to masked SDPA"
        )
    if backend != "sdpa" and _HAS_FLEX and q.is_cuda:
        out = _flex_block_sparse(q, k, v, connectivity, block_size, scale, kernel_options)
        if out is not None:
            return out
        if backend == "flex":
            raise RuntimeError("flex_attention failed for this shape (see the warning above)")
    return _sdpa_block_sparse(q, k, v, connectivity, block_size, scale)


# ----------------------------------------------------------------------------
# per-transformer-block state
# ----------------------------------------------------------------------------


class BlockSparseAttention:
    """Cached block-sparse connectivity of one transformer, one table per block.

    State is explicit: ``connectivities`` maps a transformer block index to its
    ``BoolTensor[nqb, nkb]``; ``dense_query_blocks`` / ``dense_key_blocks`` (None, a
    ``BoolTensor[nb]`` or block indices) mark the target region that is recomputed
    densely (applied with :func:`densify` when attending).  ``seq_len`` (optional)
    lets :meth:`mean_density` weigh partial blocks exactly.

    ``attend(block_index, q, k, v)`` runs :func:`block_sparse_attention` with the
    block's densified table, or plain SDPA when the block has none.  Densified,
    validated tables are cached per (block, device), and on CUDA the flex BlockMask
    of each block too (built once, ~1 MB of index tensors per 256x256 table, kept on
    the device).  Changing a table or the dense regions
    via :meth:`set_connectivity` / :meth:`set_dense_blocks` clears those caches.
    """

    def __init__(
        self,
        connectivities: Mapping[int, torch.Tensor] | None = None,
        block_size: int = 128,
        dense_query_blocks: Any = None,
        dense_key_blocks: Any = None,
        seq_len: int | None = None,
        backend: str = "auto",
        kernel_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.block_size = _check_block_size(block_size)
        _check_backend(backend)
        self.backend = backend
        self.kernel_options = None if kernel_options is None else dict(kernel_options)
        self.dense_query_blocks = dense_query_blocks
        self.dense_key_blocks = dense_key_blocks
        self.seq_len = None if seq_len is None else int(seq_len)
        self.connectivities: dict[int, torch.Tensor] = {}
        self._prepared: dict[tuple, torch.Tensor] = {}  # (block, device, Lq, Lk) -> table
        self._runners: dict[tuple, Any] = {}  # (block, shapes, ...) -> prepare_flex runner
        for idx, conn in (connectivities or {}).items():
            self.set_connectivity(idx, conn)

    def set_connectivity(self, block_index: int, connectivity: torch.Tensor) -> None:
        _check_connectivity_type(connectivity)
        self.connectivities[int(block_index)] = connectivity.detach()
        self._prepared = {k: v for k, v in self._prepared.items() if k[0] != int(block_index)}
        self._runners = {k: v for k, v in self._runners.items() if k[0] != int(block_index)}

    def set_dense_blocks(self, dense_query_blocks: Any = None, dense_key_blocks: Any = None) -> None:
        self.dense_query_blocks = dense_query_blocks
        self.dense_key_blocks = dense_key_blocks
        self._prepared.clear()
        self._runners.clear()

    def effective_connectivity(self, block_index: int) -> torch.Tensor:
        """The block's table after densify (what attend() uses)."""
        return densify(
            self.connectivities[int(block_index)], self.dense_query_blocks, self.dense_key_blocks
        )

    # -- running ---------------------------------------------------------------

    def _prepared_table(self, block_index: int, q: torch.Tensor, k: torch.Tensor,
                        video_tokens: int | None = None) -> torch.Tensor:
        key = (int(block_index), str(q.device), q.shape[2], k.shape[2], video_tokens)
        table = self._prepared.get(key)
        if table is None:
            table = self.effective_connectivity(block_index)
            if video_tokens is not None:
                table = with_dense_tail(table, self.block_size, video_tokens, q.shape[2], k.shape[2])
            table = table.to(q.device)
            _check_connectivity(table, q.shape[2], k.shape[2], self.block_size)
            self._prepared[key] = table
        return table

    def attend(
        self,
        block_index: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        video_tokens: int | None = None,
    ) -> torch.Tensor:
        """``video_tokens``: the table covers only the first ``video_tokens`` of q and k (joint attention over
        video then text tokens); the rest attend and are attended densely (:func:`with_dense_tail`)."""
        if int(block_index) not in self.connectivities:
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        _check_qkv(q, k, v)
        table = self._prepared_table(block_index, q, k, video_tokens)
        # the table is fixed for this block and these shapes, so the kernel's index tensors are built once
        rkey = (int(block_index), str(q.device), tuple(q.shape), tuple(k.shape), v.shape[-1], q.dtype, scale,
                video_tokens)
        if self.backend == "auto" and self._allows_every_block(rkey, table):
            # nothing to skip (a target region that densified the whole table): dense attention is the same
            # result, and faster than any masked or block-sparse kernel
            return F.scaled_dot_product_attention(q, k, v, scale=scale)
        if self.backend in ("auto", "fa4") and fa4_attention.supports(q, self.block_size):
            run = self._runners.get(rkey + ("fa4",))
            if run is None:
                run = self._runners[rkey + ("fa4",)] = fa4_attention.prepare(table, self.block_size, scale)
            try:
                return run(q, k, v)
            except fa4_attention.Failed:   # warned once; flex or SDPA from now on
                if self.backend == "fa4":
                    raise
        if self.backend == "fa4":
            return block_sparse_attention(q, k, v, table, self.block_size, scale=scale, backend="fa4",
                                          validate=False)  # raises, naming what fa4 needs
        if self.backend != "sdpa" and _HAS_FLEX and q.is_cuda:
            run = self._runners.get(rkey)
            if run is None:
                try:
                    run = prepare_flex(q, k, v, table, self.block_size, scale, self.kernel_options)
                except Exception as exc:
                    if self.backend == "flex":
                        raise
                    _warn_flex_failure(q, k, self.block_size, exc)
                    run = False
                self._runners[rkey] = run
            if run:
                return run(q, k, v)
        if self.backend == "flex" or q.shape[2] * k.shape[2] > _KEPT_TOKEN_MASK:
            fallback = "sdpa" if q.is_cuda else self.backend  # backend='flex' on CPU raises
            return block_sparse_attention(
                q, k, v, table, self.block_size, scale=scale, backend=fallback, validate=False
            )
        mask = self._runners.get(rkey + ("sdpa",))
        if mask is None:    # a small table's token mask: expanded once, not at every step
            mask = self._runners[rkey + ("sdpa",)] = expand_token_mask(table, self.block_size, q.shape[2],
                                                                       k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    def _allows_every_block(self, rkey: tuple, table: torch.Tensor) -> bool:
        full = self._runners.get(rkey + ("full",))
        if full is None:    # read once per table (on a GPU, reading it waits for the device)
            full = self._runners[rkey + ("full",)] = bool(table.all())
        return full

    __call__ = attend

    def mean_density(self) -> float:
        """Mean effective (densified) density over the blocks that have a table.

        1.0 when no block has one (everything runs dense).
        """
        if not self.connectivities:
            return 1.0
        vals = []
        for idx in sorted(self.connectivities):
            conn = self.effective_connectivity(idx)
            if self.seq_len is not None and num_blocks(self.seq_len, self.block_size) == conn.shape[0] == conn.shape[1]:
                vals.append(density(conn, self.block_size, self.seq_len))
            else:
                vals.append(density(conn))
        return float(sum(vals) / len(vals))

    def __len__(self) -> int:
        return len(self.connectivities)

    def __repr__(self) -> str:
        return (
            f"BlockSparseAttention(blocks={len(self)}, block_size={self.block_size}, "
            f"mean_density={self.mean_density():.3f})"
        )
