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
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .gate import RegionFallback

GIB = 1 << 30
RESERVE = 256 << 20      # device bytes the plan never counts on: the allocator's rounding, a kernel's workspace
# The most of the host memory available when a run begins that its kept keys and values may take: the host (ComfyUI
# offloading models, block swap) keeps the rest. Pinned memory stays locked in torch's cache after a run, for the
# next run to reuse.
HOST_SHARE = 0.5


@dataclass(frozen=True)
class MemoryReading:
    """Device memory in bytes when the region steps begin."""
    in_use: int         # allocated now (weights, latents; the full step's activations are gone)
    high_water: int     # the most this process has had allocated (a full step's peak, or more)
    free: int           # what the host says it can still give


class TorchMemory:
    """The device's memory as torch (or, through `free_memory`, the host, e.g. ComfyUI's
    model_management.get_free_memory) reports it; None off CUDA (the host memory is the device's)."""

    def __init__(self, free_memory: Optional[Callable] = None):
        self._free_memory = free_memory

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


def placement(order: list, sizes: dict, reading: MemoryReading, share: float, margin: float) -> tuple:
    """(keys resident on the device, None) or (None, why not even streaming fits).

    The region steps may take the device up to what this process already needed (its high-water mark, a full step's
    peak) plus `margin` of it, and never beyond what the host reports free. Out of that come the region step's own
    activations (its token `share` of a full step's) and, when any block is streamed, two stream buffers and the
    attention's copy of one block's keys and values; the rest holds resident blocks in capture order."""
    total = sum(sizes.values())
    largest = max(sizes.values())
    ceiling = min(reading.high_water * (1 + margin), reading.in_use + reading.free - RESERVE)
    activations = share * max(0, reading.high_water - reading.in_use)
    room = ceiling - reading.in_use - activations - largest      # the attention's own copy of one block's keys
    if total <= room:
        return set(order), None
    stream = 2 * largest
    if stream > room:
        return None, RegionFallback(
            "not enough GPU memory for region-only resume",
            f"not enough GPU memory for region-only resume: streaming the kept keys and values needs "
            f"{(stream + largest) / GIB:.2f} GiB beside the model, {max(0.0, room + largest) / GIB:.2f} GiB is left "
            "within the memory this request already used; whole-clip resume")
    resident, used = set(), stream
    for key in order:
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


class KeptKeysValues:
    """The keys and values of one region-only run, per (block, forward): captured at full steps, fetched at region
    steps. `memory` reads the device's memory (TorchMemory by default); `margin` is the share of the process's
    high-water mark the region steps may add."""

    # bytes of pinned host memory runs of this process have held at once: torch caches them after a run (counted as
    # in use by the host), and the next run's captures of the same sizes take them from that cache
    pinned_high_water = 0

    def __init__(self, memory=None, margin: float = 0.05):
        self.memory = memory if memory is not None else TorchMemory()
        self.margin = float(margin)
        self._host_budget: Optional[int] = None   # set at the run's first capture
        self._kept_bytes = 0
        self._held: dict = {}        # key -> (keys, values): pinned host (CUDA, streamed), the device's (resident)
        self._order: list = []       # keys in capture order (the order region steps fetch them)
        self._resident: set = set()
        self._next: dict = {}        # key -> the streamed key fetched after it (prefetched while it computes)
        self._pending: list = []     # capture copies not yet waited for
        self._stream = None
        # the stream buffers: flat (keys, values) on the device, as large as the largest streamed block's, so blocks
        # that keep different numbers of rows (region_sparse_keys) share them; _views: the block each one holds
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
        self.device = k.device
        need = 2 * k.numel() * k.element_size()
        pinning = k.device.type == "cuda"
        if self._host_budget is None:
            self._host_budget = host_budget(self.memory.host_available(),
                                            KeptKeysValues.pinned_high_water if pinning else 0)
        if self._kept_bytes + need > self._host_budget:
            return _no_host_memory(f"more than {self._host_budget / GIB:.2f} GiB, {HOST_SHARE:.0%} of what the host "
                                   "has available")
        if not pinning:
            self._kept_bytes += need
            self._keep(key, (k.detach().clone(), v.detach().clone()))
            return None
        try:
            held = tuple(torch.empty(k.shape, dtype=k.dtype, pin_memory=True) for _ in range(2))
        except RuntimeError as error:      # the host would not pin more (its memory, a container's limit)
            return _no_host_memory(f"pinning {need / GIB:.2f} GiB more failed: {str(error).splitlines()[0][:120]}")
        self._kept_bytes += need
        KeptKeysValues.pinned_high_water = max(KeptKeysValues.pinned_high_water, self._kept_bytes)
        if self._stream is None:
            self._stream = torch.cuda.Stream(k.device)
        self._pending += [_copy(held[0], k, self._stream), _copy(held[1], v, self._stream)]
        while len(self._pending) > 4:       # at most two blocks' copies in flight: their sources stay allocated
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
            resident, why = placement(self._order, sizes, reading, share, self.margin)
        if why:
            return why
        self._resident = resident
        for key in resident:
            keys, values = self._held[key]
            if keys.device != self.device:
                self._held[key] = (keys.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True))
        streamed = [key for key in self._order if key not in resident]
        self._next = {key: next((s for s in self._order[i + 1:] + self._order[:i + 1] if s not in resident), None)
                      for i, key in enumerate(self._order)}
        self.placed = {"resident": sum(sizes[key] for key in resident),
                       "streamed": sum(sizes[key] for key in streamed)}
        return None

    def fetch(self, key):
        """(keys, values) of `key` on the device, ready for this step's rows to be written in; None if not kept."""
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
        return out

    def _load(self, key, index: int) -> int:
        keys, values = self._held[key]
        flat = self._buffers[index]
        if flat is None or flat[0].numel() < max(keys.numel(), values.numel()) or flat[0].dtype != keys.dtype:
            size = max(t.numel() for other in [key, *self._order] if other not in self._resident
                       for t in self._held[other])
            flat = self._buffers[index] = (torch.empty(size, dtype=keys.dtype, device=self.device),
                                           torch.empty(size, dtype=values.dtype, device=self.device))
        buffer = self._views[index] = (flat[0][:keys.numel()].view(keys.shape),
                                       flat[1][:values.numel()].view(values.shape))
        self._holds[index] = key
        _copy(buffer[0], keys, self._stream)
        self._ready[index] = _copy(buffer[1], values, self._stream)
        return index
