"""The persistent store: entries (signature, trajectory, connectivity, thumbnail, metadata) behind one seam.

`store.py` is the store every stage reads (records, checksums, size limit); `index.py` finds the nearest entries
over the in-memory index (`memory_index.py`, `vectors.py`, `index_snapshot.py`, `eviction.py`); `write_back.py`
writes a generation after its request returned; `backends/` holds the media (diskcache on disk, Redis).
"""
from .errors import CorruptEntryError, StoreError
from .store import DEFAULT_SIZE_LIMIT, CarnatorStore, EntryRecord, TrajectoryPayload, new_entry_id

__all__ = ["CarnatorStore", "CorruptEntryError", "DEFAULT_SIZE_LIMIT", "EntryRecord", "StoreError",
           "TrajectoryPayload", "new_entry_id"]
