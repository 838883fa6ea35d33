"""The order entries leave a full store in, kept as a heap instead of sorted from every record on every write.

Corrupt entries go first, then the least computational benefit (steps their hits saved, as in NIRVANA's LCBFU;
never-hit entries first), then the least recently used. A changed key is pushed again and the old heap item is
skipped when it surfaces (lazy deletion); the heap is rebuilt when stale items outnumber live ones.
"""
from __future__ import annotations

import heapq
from typing import Optional


def priority(corrupt: bool, benefit: float, last_used: float) -> tuple:
    return (not corrupt, float(benefit), float(last_used))


class EvictionQueue:
    def __init__(self, keys: Optional[dict] = None):
        """Empty, or holding `keys` (id -> priority), heapified at once."""
        self._keys: dict = dict(keys or {})
        self._heap: list = [(key, entry_id) for entry_id, key in self._keys.items()]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._keys)

    def set(self, entry_id: str, key: tuple) -> None:
        if self._keys.get(entry_id) == key:
            return
        self._keys[entry_id] = key
        heapq.heappush(self._heap, (key, entry_id))
        if len(self._heap) > 2 * len(self._keys) + 1024:
            self._heap = [(k, e) for e, k in self._keys.items()]
            heapq.heapify(self._heap)

    def discard(self, entry_id: str) -> None:
        self._keys.pop(entry_id, None)

    def first(self, skip=None):
        """The id to evict next (not `skip`), or None; it stays queued until discarded."""
        held = []
        found = None
        while self._heap:
            key, entry_id = self._heap[0]
            if self._keys.get(entry_id) != key:
                heapq.heappop(self._heap)
                continue
            if entry_id == skip:
                held.append(heapq.heappop(self._heap))
                continue
            found = entry_id
            break
        for item in held:
            heapq.heappush(self._heap, item)
        return found
