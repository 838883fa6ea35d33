"""One pass from 8-bit rows and their scales to the model's dtype (kept_kv's kept keys and values).

torch's int8 x float32 -> bfloat16 multiply with a broadcast scale runs at about a quarter of an H100's memory
bandwidth (0.215 ms for one block's keys at Wan 1.3B's 480p x 81, 14 ms of a region step): it reads the scales per
element and converts through a float32 temporary. The kernel reads each row's scale once and writes the result
directly, in the same arithmetic (int8 -> float32, times the float32 scale, rounded to the nearest even in the
output dtype), so its output equals torch's bit for bit.

Rows are taken in memory order: the values must be dense with the head dimension innermost, and the scales
[..., 1] laid out in the same order (kept_kv.quantize_rows makes them so); `supports` says when that holds.
"""
from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger("carnator")
ROWS_PER_PROGRAM = 32
_failed: list = []      # the first error of a launch that could not compile or run here: torch's multiply from then on


@functools.lru_cache(maxsize=1)
def _kernel():
    """The jitted kernel, or None without Triton (built on first use: TRITON_INTERPRET set by then is honoured)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def dequantize(values, scales, out, rows, width: tl.constexpr, width_pow2: tl.constexpr,
                   rows_per_program: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * rows_per_program + tl.arange(0, rows_per_program)
        column = tl.arange(0, width_pow2)
        row_ok = row < rows
        mask = row_ok[:, None] & (column[None, :] < width)
        offsets = row[:, None] * width + column[None, :]
        scale = tl.load(scales + row, mask=row_ok, other=0.0)
        quantized = tl.load(values + offsets, mask=mask, other=0)
        result = quantized.to(tl.float32) * scale[:, None]
        tl.store(out + offsets, result.to(out.dtype.element_ty), mask=mask)

    return dequantize


def _fills_its_memory(tensor: torch.Tensor) -> bool:
    """True when `tensor`'s elements cover its memory without gaps or overlaps (in any order of its dimensions)."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):      # innermost first
        if tensor.shape[dim] != 1 and tensor.stride(dim) != expected:
            return False
        expected *= tensor.shape[dim]
    return True


def supports(values: torch.Tensor, scales: torch.Tensor) -> bool:
    """True when the kernel can run here: Triton present, int8 values dense with the last dimension innermost, and
    float32 scales [..., 1] holding one value per row in the values' row order."""
    if values.dtype != torch.int8 or scales.dtype != torch.float32 or values.dim() != scales.dim():
        return False
    if tuple(scales.shape) != (*values.shape[:-1], 1) or values.stride(-1) != 1 or values.numel() == 0:
        return False
    if not _fills_its_memory(values) or not _fills_its_memory(scales):
        return False
    width = values.shape[-1]
    same_rows = all(values.shape[dim] == 1 or values.stride(dim) == scales.stride(dim) * width
                    for dim in range(values.dim() - 1))
    return same_rows and not _failed and _kernel() is not None


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """values x scales into `out` (the values' shape and memory order, a float dtype) where `supports` holds; False
    when the kernel cannot compile or run on this machine (said once in the log; the caller computes it with torch)."""
    import triton     # present: `supports` built the kernel
    rows, width = values.numel() // values.shape[-1], values.shape[-1]
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    try:      # a block's extent must be a power of two: the row is padded to one and masked
        _kernel()[grid](values, scales, out, rows, width, triton.next_power_of_2(width), ROWS_PER_PROGRAM)
    except Exception as error:     # a Triton without a compiler for this GPU, a driver it does not know
        _failed.append(error)
        log.warning("carnator: the 8-bit dequantize kernel does not run here (%s); torch dequantizes instead",
                    (str(error).splitlines() or [type(error).__name__])[0][:160])
        return False
    return True
