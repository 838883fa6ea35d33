"""Block-sparse and dense attention on FlashAttention-4 (the `flash-attn-4` package, CuTe DSL kernels).

Optional: installed with the `gpu` extra. On an H200 (bf16, D=128, L=32760, block 128) it runs a 0.3-density
table in 3.16 ms against 11.70 ms for dense cuDNN attention (0.27 of dense) where flex_attention needs 4.67-5.09
ms (0.40-0.43): benchmarks/results/kernels/fa4_h200.json.

Every allowed block pair is a *full* block for the kernel (no mask function), so the result is exact
attention under the block table, as with the other backends. Tokens past the sequence end in a partial last
block are bounded by the kernel's own sequence length. `dense` runs the same kernel without a table (a region
step's target over every key: benchmarks/results/kernels/fa4_h200.json has it at 9.83 ms where cuDNN took 11.70).

Where it runs: Hopper (compute capability 9.x), where it is measured. Read in flash-attn-4 4.0's source, not
measured: on datacenter Blackwell (10.x, 11.x) its kernel takes query blocks of q_stage x tile_m = 256 rows at
these lengths (config.py, block_sparsity.py) and refuses Carnator's 128-row tables; on consumer Blackwell (12.x:
RTX 50-series) it runs an Ampere-style kernel that takes the table and ignores it (flash_fwd.py's
FlashAttentionForwardSm80), so a hit would attend densely. A kernel that fails to compile or launch is not tried
again in the process: the callers' other exact kernels run instead.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

KERNEL_BLOCK = 128
"""The SM90 kernel's KV tile for D <= 128: a block table's block size must be a multiple of it."""

BLOCK_TABLE_ARCHS = (9,)
"""The compute capabilities (major) whose FA4 kernel runs Carnator's block tables (the module's docstring says why
not 10-12)."""

_FAILURE: list = []   # why FA4 failed in this process, once it has: then it is not tried again


class Failed(RuntimeError):
    """FA4 could not run (compile or launch) and will not be tried again in this process; the caller runs another
    exact kernel."""


@functools.lru_cache(maxsize=1)
def _interface():
    try:
        from flash_attn.cute import interface
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
    except Exception:  # not installed, or its CUDA libraries do not load here
        return None
    return interface, BlockSparseTensorsTorch


def installed() -> bool:
    """True when the flash-attn-4 package and its CUDA libraries load here (a benchmark records which kernel ran)."""
    return _interface() is not None


def supports(q: torch.Tensor, block_size: int = KERNEL_BLOCK) -> bool:
    """True when FA4 can run this problem: installed, a GPU of BLOCK_TABLE_ARCHS, 16-bit floats, D a multiple of
    16 up to 128 (the head sizes whose tiles match the 128-token blocks), blocks of whole tiles, and no failure of
    FA4 in this process so far."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if block_size % KERNEL_BLOCK or q.shape[-1] % 16 or q.shape[-1] > 128:
        return False
    return _runs_on(q.device) and installed() and not _FAILURE


def failure() -> str | None:
    """Why FA4 failed in this process (then the other kernels ran), or None (a benchmark's report says it)."""
    return _FAILURE[0] if _FAILURE else None


def _runs_on(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] in BLOCK_TABLE_ARCHS


def dense_or(fallback: Callable) -> Callable:
    """`fn(q, k, v)`: `dense` where FA4 runs, `fallback(q, k, v)` (the same exact attention) where it does not or
    once it has failed."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if supports(q):
            try:
                return dense(q, k, v)
            except Failed:
                pass
        return fallback(q, k, v)
    return attend


def prepare(table: torch.Tensor, block_size: int, scale: float | None) -> Callable:
    """The kernel's index tensors for a validated block table, built once -> `fn(q, k, v)` on [B, H, L, D]."""
    interface, BlockSparseTensorsTorch = _interface()
    counts = table.sum(dim=-1, dtype=torch.int32)
    # allowed key blocks first, in ascending order: the kernel reads the first `count` of each row
    indices = torch.argsort((~table).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    nqb, nkb = table.shape
    full_counts = counts.view(1, 1, nqb).contiguous()
    full_indices = indices.view(1, 1, nqb, nkb).contiguous()
    sparse = BlockSparseTensorsTorch(
        mask_block_cnt=torch.zeros_like(full_counts), mask_block_idx=torch.zeros_like(full_indices),
        full_block_cnt=full_counts, full_block_idx=full_indices, block_size=(block_size, block_size))

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return _attend(interface, q, k, v, scale, sparse)

    return run


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Exact attention of q [B, H, Lq, D] over k, v [B, H, Lk, D] (Lq may differ from Lk) -> [B, H, Lq, D];
    only where `supports(q)`."""
    return _attend(_interface()[0], q, k, v, scale, None)


def _attend(interface, q, k, v, scale, sparse) -> torch.Tensor:
    # [B, H, L, D] views of the hosts' [B, L, H*D] projections are [B, L, H, D] in memory already
    q4, k4, v4 = (t.transpose(1, 2) for t in (q, k, v))
    q4, k4, v4 = (t if t.stride(-1) == 1 else t.contiguous() for t in (q4, k4, v4))
    try:
        out, _ = interface.flash_attn_func(q4, k4, v4, softmax_scale=scale, block_sparse_tensors=sparse)
    except torch.OutOfMemoryError:
        raise                 # the memory, not the kernel: the callers' memory fallbacks take it
    except Exception as error:  # a kernel this GPU or package cannot compile or launch
        why = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"
        if not _FAILURE:
            _FAILURE.append(why)
            warnings.warn(f"FlashAttention-4 failed on q {tuple(q.shape)} {q.dtype} ({why}); the other exact "
                          "attention kernels run instead until the process restarts", RuntimeWarning, stacklevel=3)
        raise Failed(why) from error
    return out.transpose(1, 2)
