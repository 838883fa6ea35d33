"""The store's in-memory index of its entries: what lookups, exact repeats, eviction, the size limit, stats and a
miss's explanation need of each entry, so that none of them reads the backend.

CarnatorStore fills it from the entries' metadata (a rebuild) or from a snapshot (index_snapshot.py) and keeps it
current from the backend's change log. Per entry it holds a few fields in a slotted object and one float16 row
of its bucket's matrix: about 1.3 KB an entry in all (tracemalloc at 100k entries: 133 MB, 49 MB of it rows),
where a dataclass per entry and float32 rows grown by doubling took 247 MB.
"""
from __future__ import annotations

import sys
from typing import Optional

import numpy as np

from .eviction import EvictionQueue, priority
from .vectors import BucketMatrix


class IndexedEntry:
    __slots__ = ("bucket", "size", "hits", "steps_saved", "corrupt", "repeat_key", "created", "last_used", "root",
                 "sig_sha256", "repeats")

    def __init__(self, bucket: str, size: int, hits: int, steps_saved: int, corrupt: bool,
                 repeat_key: Optional[str], created: float, last_used: float, root: str, sig_sha256: str,
                 repeats: int = 0):
        self.bucket, self.size, self.hits, self.steps_saved, self.corrupt = bucket, size, hits, steps_saved, corrupt
        self.repeat_key, self.created, self.last_used, self.root = repeat_key, created, last_used, root
        self.sig_sha256 = sig_sha256
        self.repeats = repeats      # of `hits`, the exact repeats (stats count them apart)

    def eviction_key(self) -> tuple:
        return priority(self.corrupt, self.steps_saved, self.last_used)

    def share_strings(self, entry_id: str) -> None:
        """One string object for a bucket's name across its entries, and for an id that is its own lineage (most
        are): 100k copies of either would be 6 MB."""
        self.bucket = sys.intern(self.bucket)
        if self.root == entry_id:
            self.root = entry_id


class MemoryIndex:
    def __init__(self):
        self.entries: dict = {}         # id -> IndexedEntry
        self.matrices: dict = {}        # bucket -> BucketMatrix of its entries that are not corrupt
        self.bucket_counts: dict = {}   # bucket -> its entries, corrupt ones included
        self.bucket_parts: dict = {}    # bucket -> its parts (index.bucket_parts), as its entries recorded them
        self.repeats: dict = {}         # request key -> ids of the full generations of that request
        self.queue = EvictionQueue()
        self.bytes = 0

    @classmethod
    def assembled(cls, entries: dict, matrices: dict, parts: dict) -> "MemoryIndex":
        """An index of `entries` (id -> IndexedEntry) whose vectors are already in `matrices` (bucket ->
        BucketMatrix of the entries that are not corrupt): the rest is derived in bulk, not entry by entry."""
        index = cls()
        for entry_id, entry in entries.items():
            entry.share_strings(entry_id)
            index.bucket_counts[entry.bucket] = index.bucket_counts.get(entry.bucket, 0) + 1
            index.bytes += entry.size
            if entry.repeat_key and not entry.corrupt:
                index.repeats.setdefault(entry.repeat_key, []).append(entry_id)
        index.entries = entries
        index.matrices = {sys.intern(bucket): matrix for bucket, matrix in matrices.items()}
        index.bucket_parts = {bucket: value for bucket, value in parts.items() if bucket in index.bucket_counts}
        index.queue = EvictionQueue({entry_id: entry.eviction_key() for entry_id, entry in entries.items()})
        return index

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry_id: str, entry: IndexedEntry, vector: Optional[np.ndarray],
            parts: Optional[dict] = None) -> None:
        """Indexes an entry (replacing what was indexed under its id); `vector` is unused for a corrupt one."""
        self.forget(entry_id)
        entry.share_strings(entry_id)
        bucket = entry.bucket
        self.entries[entry_id] = entry
        self.bytes += entry.size
        self.bucket_counts[bucket] = self.bucket_counts.get(bucket, 0) + 1
        if parts is not None and bucket not in self.bucket_parts:
            self.bucket_parts[bucket] = parts
        if not entry.corrupt:
            matrix = self.matrices.get(bucket)
            if matrix is None:
                matrix = self.matrices[bucket] = BucketMatrix()
            matrix.add(entry_id, vector)
            if entry.repeat_key:
                self.repeats.setdefault(entry.repeat_key, []).append(entry_id)
        self.queue.set(entry_id, entry.eviction_key())

    def forget(self, entry_id: str) -> None:
        entry = self.entries.pop(entry_id, None)
        if entry is None:
            return
        self.queue.discard(entry_id)
        self.bytes -= entry.size
        bucket = entry.bucket
        left = self.bucket_counts[bucket] - 1
        if left:
            self.bucket_counts[bucket] = left
        else:
            del self.bucket_counts[bucket]
            self.bucket_parts.pop(bucket, None)
        matrix = self.matrices.get(bucket)
        if matrix is not None:
            matrix.remove(entry_id)
            if not len(matrix):
                del self.matrices[bucket]
        same = self.repeats.get(entry.repeat_key)
        if same is not None and entry_id in same:
            same.remove(entry_id)
            if not same:
                del self.repeats[entry.repeat_key]

    def newest_repeat(self, bucket: str, request_key: str) -> Optional[str]:
        same = [e for e in self.repeats.get(request_key, ()) if self.entries[e].bucket == bucket]
        return max(same, key=lambda e: self.entries[e].created, default=None)

    def oldest_in(self, bucket: str) -> Optional[str]:
        """The oldest entry of a bucket that is not corrupt (a scan of that bucket's ids in memory: for a miss's
        explanation, which is rare and comes before a full generation)."""
        matrix = self.matrices.get(bucket)
        if matrix is None:
            return None
        return min(matrix.ids, key=lambda e: self.entries[e].created)

    def nbytes(self) -> int:
        """The matrices' bytes (the rest is Python objects: see `benchmarks/store.py scale` for the process' growth)."""
        return sum(matrix.nbytes() for matrix in self.matrices.values())
