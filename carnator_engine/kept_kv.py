"""Where a region-only resume keeps the other tokens' keys and values, within the GPU memory the host has.

A full step captures, per transformer block and forward, the keys and values of the whole clip ([B, heads, L(+T), D],
tokens in their own order; with region_sparse_keys only the rows the target reaches, so blocks differ in size); each
region step writes its target rows (and a joint model's text rows) into them and attends. Kept on the GPU for every
block they would add 2 x tokens x model width values per block (about 6 GB for Wan 2.1 1.3B at 480p x 81, more than
doubling its peak), so on a GPU they are captured into pinned host memory, and at the first region step `plan`
decides, from the memory the host reports, which blocks go back to the GPU for the whole run (resident) and which are
streamed: copied into one of two GPU buffers on a side CUDA stream while the block before them computes (what block
swap does for weights). When not even two buffers fit, the region-only resume falls back to whole-clip resume and
says why. On the CPU the host memory is the device's: the tensors stay where they are.

Kept tensors keep the memory order the model made them in (a [B, L, heads x D] projection seen as [B, heads, L, D]):
the host's attention then reads them as it reads its own, without a copy per block. With `eight_bit`
(CarnatorConfig.region_kv_8bit) each is kept as int8 with one float32 scale per row (a token of a head): half the host
memory, the pinning and the bytes streamed per region step, dequantized on the device block by block (by
kernels.dequantize with CarnatorConfig.region_kv_triton, in one pass).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .gate import RegionFallback
from .kernels import dequantize as dequantize_kernel

GIB = 1 << 30
RESERVE = 256 << 20      # device bytes the plan never counts on: the allocator's rounding, a kernel's workspace
# The most of the host memory available when a run begins that its kept keys and values may take: the host (ComfyUI
# offloading models, block swap) keeps the rest. Pinned memory stays locked in torch's cache after a run, for the
# next run to reuse.
HOST_SHARE = 0.5
# Elements quantized at once: bounds the float32 temporaries of a capture (16 MiB) beside a full step's activations.
QUANTIZE_CHUNK = 1 << 22


@dataclass(frozen=True)
class MemoryReading:
    """Device memory in bytes when the region steps begin."""
    in_use: int         # allocated now (weights, latents; the full step's activations are gone)
    high_water: int     # the most this process has had allocated (a full step's peak, or more)
    free: int           # what the host says it can still give


class TorchMemory:
    """The device's memory as torch (or, through `free_memory`, the host, e.g. ComfyUI's
    model_management.get_free_memory) reports it; None off CUDA (the host memory is the device's). `paged`: why no
    kept block may stay on the device ("" when they may): the host pages weights in on demand (ComfyUI's dynamic
    VRAM) and plans without the tensors a node holds there, so every kept block is streamed from host memory."""

    def __init__(self, free_memory: Optional[Callable] = None, paged: str = ""):
        self._free_memory = free_memory
        self.paged = paged

    def read(self, device: torch.device) -> Optional[MemoryReading]:
        if device.type != "cuda":
            return None
        return MemoryReading(int(torch.cuda.memory_allocated(device)), int(torch.cuda.max_memory_allocated(device)),
                             self.free(device))

    def free(self, device: torch.device) -> int:
        """Bytes the host can still give on `device` (torch's cache of freed blocks included)."""
        if self._free_memory is not None:
            return int(self._free_memory(device))
        return int(torch.cuda.mem_get_info(device)[0]) + int(torch.cuda.memory_reserved(device)) \
            - int(torch.cuda.memory_allocated(device))

    @staticmethod
    def host_available() -> int:
        try:
            import psutil
            return int(psutil.virtual_memory().available)
        except ImportError:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def placement(order: list, sizes: dict, reading: MemoryReading, share: float, margin: float,
              working: Optional[int] = None, resident_allowed: bool = True) -> tuple:
    """(keys resident on the device, None) or (None, why not even streaming fits); none resident unless
    `resident_allowed` (every block streamed).

    The region steps may take the device up to what this process already needed (its high-water mark, a full step's
    peak) plus `margin` of it, and never beyond what the host reports free. Out of that come the region step's own
    activations (its token `share` of a full step's), `working`: what one block's attention holds beside the kept
    ones (the attention's copy of its keys and values, and their dequantized form when they are kept in 8 bits;
    the largest block's size by default) and, when any block is streamed, two stream buffers; the rest holds
    resident blocks in capture order."""
    total = sum(sizes.values())
    largest = max(sizes.values())
    ceiling = min(reading.high_water * (1 + margin), reading.in_use + reading.free - RESERVE)
    activations = share * max(0, reading.high_water - reading.in_use)
    working = largest if working is None else working
    room = ceiling - reading.in_use - activations - working
    if total <= room and resident_allowed:
        return set(order), None
    stream = 2 * largest
    if stream > room:
        return None, RegionFallback(
            "not enough GPU memory for region-only resume",
            f"not enough GPU memory for region-only resume: streaming the kept keys and values needs "
            f"{(stream + working) / GIB:.2f} GiB beside the model, {max(0.0, room + working) / GIB:.2f} GiB is left "
            "within the memory this request already used; whole-clip resume")
    resident, used = set(), stream
    for key in order if resident_allowed else ():
        if used + sizes[key] <= room:
            resident.add(key)
            used += sizes[key]
    return resident, None


def host_budget(available: int, cached: int) -> int:
    """The most one run's kept keys and values may take of the host: HOST_SHARE of what it has available, counting the
    pinned memory torch keeps `cached` from earlier runs (the run takes it from there)."""
    return int(HOST_SHARE * (available + cached))


def _no_host_memory(detail: str) -> RegionFallback:
    note = "not enough host memory to keep the other tokens' keys and values"
    return RegionFallback(note, f"{note} ({detail}); whole-clip resume")


def _copy(dst: torch.Tensor, src: torch.Tensor, stream) -> Optional[object]:
    """dst.copy_(src) after the work queued so far; on a CUDA side stream, returning its event (None: done)."""
    if stream is None:
        dst.copy_(src)
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    for tensor in (dst, src):
        if tensor.is_cuda:
            tensor.record_stream(stream)     # the allocator keeps it until the side stream is done with it
    return event


def empty_in_layout(like: torch.Tensor, dtype: Optional[torch.dtype] = None, device=None,
                    pin_memory: bool = False) -> torch.Tensor:
    """An empty tensor of `like`'s shape whose memory order is `like`'s (dimensions by stride, outermost first), on
    `device` (the host by default), pinned with `pin_memory`: a copy between the two is one contiguous transfer, and a
    [B, L, heads x D] projection seen as [B, heads, L, D] stays viewable as [B, L, heads x D]."""
    order = sorted(range(like.dim()), key=lambda dim: -like.stride(dim))    # stable: ties keep their order
    base = torch.empty([like.shape[dim] for dim in order], dtype=dtype or like.dtype, device=device,
                       pin_memory=pin_memory)
    return base.permute([order.index(dim) for dim in range(like.dim())])


def _view_in(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first elements of the 1-D `flat`, seen in `like`'s shape and memory order (like is dense)."""
    return flat[:like.numel()].as_strided(like.shape, like.stride())


def quantize_rows(x: torch.Tensor) -> tuple:
    """x [..., D] -> (int8 values and float32 scales [..., 1], both in x's memory order): x ~= values x scale, one
    scale per row (a token of a head), its largest magnitude mapped to 127. Chunked along the rows so that the float32
    temporaries stay small beside a full step's activations."""
    values = empty_in_layout(x, torch.int8, x.device)
    # in x's memory order too: dequantize_rows then reads values and scales in step (one contiguous pass over both)
    scales = empty_in_layout(x[..., :1], torch.float32, x.device)
    row_size = max(1, x[..., 0, :].numel())
    rows = max(1, QUANTIZE_CHUNK // row_size)
    tiny = torch.finfo(torch.float32).tiny
    for start in range(0, x.shape[-2], rows):
        part = x[..., start:start + rows, :].to(torch.float32, copy=True)    # divided in place below
        scale = scales[..., start:start + rows, :]
        torch.amax(part.abs(), dim=-1, keepdim=True, out=scale)
        scale.div_(127).clamp_(min=tiny)
        values[..., start:start + rows, :].copy_(part.div_(scale).round_())
    return values, scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                    kernel: bool = False) -> torch.Tensor:
    """quantize_rows' inverse, in `dtype` and `values`' memory order (computed in float32, stored as `dtype`); with
    `kernel`, on a GPU, by kernels.dequantize where it runs (the same result in one pass), else by torch."""
    out = empty_in_layout(values, dtype, values.device)
    if kernel and values.is_cuda and dequantize_kernel.supports(values, scales) and \
            dequantize_kernel.dequantize_rows(values, scales, out):
        return out
    return torch.mul(values, scales, out=out)


class KeptKeysValues:
    """The keys and values of one region-only run, per (block, forward): captured at full steps, fetched at region
    steps. `memory` reads the device's memory (TorchMemory by default); `margin` is the share of the process's
    high-water mark the region steps may add; `eight_bit` keeps them as int8 with a scale per row (quantize_rows),
    `kernel` dequantizes them with kernels.dequantize on a GPU where it runs."""

    # bytes of pinned host memory runs of this process have held at once: torch caches them after a run (counted as
    # in use by the host), and the next run's captures of the same sizes take them from that cache
    pinned_high_water = 0

    def __init__(self, memory=None, margin: float = 0.05, eight_bit: bool = False, kernel: bool = False):
        self.memory = memory if memory is not None else TorchMemory()
        self.margin = float(margin)
        self.eight_bit = bool(eight_bit)
        self.kernel = bool(kernel)
        self._host_budget: Optional[int] = None   # set at the run's first capture
        self._kept_bytes = 0
        # key -> its parts, (keys, values) or with eight_bit (keys, their scales, values, their scales): pinned host
        # memory (CUDA, streamed) or the device's (resident)
        self._held: dict = {}
        self._dtype: Optional[torch.dtype] = None    # the keys' and values' own dtype (what fetch returns)
        self._order: list = []       # keys in capture order (the order region steps fetch them)
        self._resident: set = set()
        self._next: dict = {}        # key -> the streamed key fetched after it (prefetched while it computes)
        self._pending: list = []     # capture copies not yet waited for
        self._stream = None
        # the stream buffers: one flat tensor per part on the device, as large as the largest streamed block's, so
        # blocks that keep different numbers of rows (region_sparse_keys) share them; _views: the block each one holds
        self._buffers = [None, None]
        self._views = [None, None]
        self._holds = [None, None]   # the key each buffer holds or is loading
        self._ready = [None, None]   # its copy's event
        self._current = 0            # the buffer the last streamed fetch returned (in use by its attention)
        self.device: Optional[torch.device] = None
        self.planned = False
        self.placed = {"resident": 0, "streamed": 0}    # bytes per placement (reports, tests)

    def __len__(self) -> int:
        return len(self._held)

    def release(self) -> None:
        """Drops everything (the end of the region steps, a new expert's capture, a fallback)."""
        if self._stream is not None:
            self._stream.synchronize()
        self._held.clear()
        self._order.clear()
        self._resident.clear()
        self._next.clear()
        self._pending.clear()
        self._buffers, self._views, self._holds, self._ready = [None, None], [None, None], [None, None], [None, None]
        self.planned = False
        self._host_budget, self._kept_bytes = None, 0

    # ---- the full step ----

    def capture(self, key, k: torch.Tensor, v: torch.Tensor) -> Optional[RegionFallback]:
        """Keeps (k, v) of `key`; None or why it cannot (the host's memory): then nothing is kept."""
        self.device, self._dtype = k.device, k.dtype
        parts = (*quantize_rows(k.detach()), *quantize_rows(v.detach())) if self.eight_bit else (k.detach(),
                                                                                                   v.detach())
        need = sum(part.numel() * part.element_size() for part in parts)
        pinning = k.device.type == "cuda"
        if self._host_budget is None:
            self._host_budget = host_budget(self.memory.host_available(),
                                            KeptKeysValues.pinned_high_water if pinning else 0)
        if self._kept_bytes + need > self._host_budget:
            return _no_host_memory(f"more than {self._host_budget / GIB:.2f} GiB, {HOST_SHARE:.0%} of what the host "
                                   "has available")
        if not pinning:
            self._kept_bytes += need
            self._keep(key, parts if self.eight_bit else tuple(part.clone() for part in parts))
            return None
        try:
            held = tuple(empty_in_layout(part, pin_memory=True) for part in parts)
        except RuntimeError as error:      # the host would not pin more (its memory, a container's limit)
            return _no_host_memory(f"pinning {need / GIB:.2f} GiB more failed: {str(error).splitlines()[0][:120]}")
        self._kept_bytes += need
        KeptKeysValues.pinned_high_water = max(KeptKeysValues.pinned_high_water, self._kept_bytes)
        if self._stream is None:
            self._stream = torch.cuda.Stream(k.device)
        self._pending += [_copy(dst, src, self._stream) for dst, src in zip(held, parts)]
        while len(self._pending) > 2 * len(parts):   # two blocks' copies in flight at most: their sources stay allocated
            self._pending.pop(0).synchronize()
        self._keep(key, held)
        return None

    def _keep(self, key, held: tuple) -> None:
        if key not in self._held:
            self._order.append(key)
        self._held[key] = held

    # ---- the region steps ----

    def plan(self, share: float) -> Optional[RegionFallback]:
        """Places every kept block, resident or streamed; None or why region-only cannot run in this memory."""
        for event in self._pending:
            event.synchronize()
        self._pending.clear()
        self.planned = True
        reading = self.memory.read(self.device) if self.device is not None else None
        sizes = {key: sum(t.numel() * t.element_size() for t in held) for key, held in self._held.items()}
        if reading is None or not sizes:
            resident, why = set(sizes), None
        else:
            working = None      # 16 bits: the attention's copy of the largest block
            if self.eight_bit:  # and its dequantized keys and values beside that copy
                element = torch.empty((), dtype=self._dtype).element_size()
                working = 2 * max(sum(part.numel() for part in held[::2]) for held in self._held.values()) * element
            resident, why = placement(self._order, sizes, reading, share, self.margin, working,
                                      not getattr(self.memory, "paged", ""))
        if why:
            return why
        self._resident = resident
        for key in resident:
            if self._held[key][0].device != self.device:      # .to keeps each part's memory order
                self._held[key] = tuple(part.to(self.device, non_blocking=True) for part in self._held[key])
        streamed = [key for key in self._order if key not in resident]
        self._next = {key: next((s for s in self._order[i + 1:] + self._order[:i + 1] if s not in resident), None)
                      for i, key in enumerate(self._order)}
        self.placed = {"resident": sum(sizes[key] for key in resident),
                       "streamed": sum(sizes[key] for key in streamed)}
        return None

    def fetch(self, key):
        """(keys, values) of `key` on the device in their own dtype, ready for this step's rows to be written in (not
        into the kept ones when they are kept in 8 bits); None if not kept."""
        held = self._held.get(key)
        if held is None:
            return None
        if key in self._resident:
            out = held
        else:
            index = self._holds.index(key) if key in self._holds else self._load(key, 1 - self._current)
            self._current = index
            if self._ready[index] is not None:
                torch.cuda.current_stream(self.device).wait_event(self._ready[index])
            out = self._views[index]
        following = self._next.get(key)
        if following is not None and following not in self._holds:
            self._load(following, 1 - self._current)
        if self.eight_bit:
            return tuple(dequantize_rows(values, scales, self._dtype, self.kernel)
                         for values, scales in (out[:2], out[2:]))
        return out

    def _load(self, key, index: int) -> int:
        parts = self._held[key]
        flat = self._buffers[index]
        if flat is None or any(buffer.numel() < part.numel() for buffer, part in zip(flat, parts)):
            streamed = [self._held[other] for other in [key, *self._order] if other not in self._resident]
            flat = self._buffers[index] = tuple(
                torch.empty(max(held[i].numel() for held in streamed), dtype=part.dtype, device=self.device)
                for i, part in enumerate(parts))
        buffer = self._views[index] = tuple(_view_in(whole, part) for whole, part in zip(flat, parts))
        self._holds[index] = key
        for part, into in zip(parts, buffer):
            self._ready[index] = _copy(into, part, self._stream)   # the last copy's event: the stream runs in order
        return index
