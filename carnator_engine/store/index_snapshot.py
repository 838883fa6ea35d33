"""A snapshot of the store's in-memory index (memory_index.py): what opening a store loads instead of decoding every
entry's metadata (100k entries: one value of ~70 MB read in well under a second, against seconds of JSON).

A snapshot is the index as of a change-log cursor. Opening loads it and replays the log from that cursor, so
everything any process wrote, updated or removed since is taken in; when the log no longer reaches back that far
the store is rebuilt from its entries instead. A snapshot is only ever used whole and current: `decode` refuses
one that is torn or damaged (length and SHA-256 of its payload), from another snapshot version, or of another
store (a store identity the backend keeps with its entries: a cache.db deleted and created again, or a snapshot
copied in from elsewhere, would otherwise hand out entries that do not exist).

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (JSON: version, store, cursor, counts,
payload length and SHA-256), then the payload: the columns (JSON) and the float16 vector rows of the entries
that are not corrupt, bucket by bucket in the order of the columns.
"""
from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from .memory_index import IndexedEntry, MemoryIndex
from .vectors import VECTOR_DIM, BucketMatrix

MAGIC = b"carnator index snapshot\n"
VERSION = 2     # 2: each entry's exact repeats
ROW_BYTES = VECTOR_DIM * 2


class UnusableSnapshot(ValueError):
    """Why a snapshot cannot be used (the store rebuilds its index instead)."""


def encode(index: MemoryIndex, cursor, store_id: str) -> bytes:
    ids, rows = [], []
    for matrix in index.matrices.values():
        ids.extend(matrix.ids)
        rows.append(matrix.filled_rows())
    with_rows = len(ids)
    ids.extend(e for e, entry in index.entries.items() if entry.corrupt)
    entries = [index.entries[e] for e in ids]
    buckets = sorted(index.bucket_counts)
    number = {bucket: n for n, bucket in enumerate(buckets)}
    columns = {
        "ids": ids, "buckets": buckets, "parts": index.bucket_parts,
        "bucket": [number[e.bucket] for e in entries], "size": [e.size for e in entries],
        "hits": [e.hits for e in entries], "repeats": [e.repeats for e in entries],
        "steps_saved": [e.steps_saved for e in entries],
        "corrupt": [int(e.corrupt) for e in entries], "repeat_key": [e.repeat_key for e in entries],
        "created": [e.created for e in entries], "last_used": [e.last_used for e in entries],
        "root": ["" if e.root == i else e.root for i, e in zip(ids, entries)],
        "sig": [e.sig_sha256 for e in entries]}
    payload = json.dumps(columns, separators=(",", ":"), allow_nan=False).encode()
    vectors = np.concatenate(rows).tobytes() if rows else b""
    digest = hashlib.sha256(payload)
    digest.update(vectors)
    header = json.dumps({"version": VERSION, "store": store_id, "cursor": cursor, "entries": len(ids),
                         "rows": with_rows, "columns_bytes": len(payload),
                         "sha256": digest.hexdigest()}).encode()
    return b"".join([MAGIC, struct.pack("<Q", len(header)), header, payload, vectors])


def header(data: bytes) -> dict:
    """The snapshot's header (version, store, cursor, ...), checked for nothing but its own syntax."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 8:
        raise UnusableSnapshot("it is not a Carnator index snapshot")
    (length,) = struct.unpack_from("<Q", data, len(MAGIC))
    start = len(MAGIC) + 8
    try:
        found = json.loads(data[start:start + length])
    except ValueError:
        raise UnusableSnapshot("its header does not parse (torn?)") from None
    if not isinstance(found, dict):
        raise UnusableSnapshot("its header does not parse (torn?)")
    found["payload_start"] = start + length
    return found


def decode(data: bytes, store_id: str) -> tuple:
    """(cursor, MemoryIndex) from a snapshot of the store `store_id`; UnusableSnapshot when it is not exactly one."""
    head = header(data)
    if head.get("version") != VERSION:
        raise UnusableSnapshot(f"it is of snapshot version {head.get('version')!r}, this Carnator reads {VERSION}")
    if head.get("store") != store_id:
        raise UnusableSnapshot("it is of another store (the store was created again since, or it was copied in)")
    try:
        start, rows, columns_bytes = head["payload_start"], int(head["rows"]), int(head["columns_bytes"])
        expected = hashlib.sha256(memoryview(data)[start:]).hexdigest()
        if len(data) - start != columns_bytes + rows * ROW_BYTES:
            raise UnusableSnapshot("its length is not the one its header gives (torn write?)")
        if expected != head["sha256"]:
            raise UnusableSnapshot("its bytes do not match their checksum (damaged)")
        columns = json.loads(data[start:start + columns_bytes])
        vectors = np.frombuffer(data, dtype=np.float16, count=rows * VECTOR_DIM,
                                offset=start + columns_bytes).reshape(rows, VECTOR_DIM)
        return head["cursor"], _index(columns, vectors, int(head["entries"]))
    except UnusableSnapshot:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise UnusableSnapshot(f"its contents do not parse ({type(error).__name__})") from None


def _index(columns: dict, vectors: np.ndarray, count: int) -> MemoryIndex:
    ids, buckets = columns["ids"], columns["buckets"]
    fields = ("bucket", "size", "hits", "steps_saved", "corrupt", "repeat_key", "created", "last_used", "root", "sig",
              "repeats")
    if len(ids) != count or any(len(columns[name]) != count for name in fields):
        raise UnusableSnapshot("its columns are not all of one length")
    entries = {}
    for entry_id, bucket, size, hits, saved, corrupt, repeat, created, used, root, sig, repeats in zip(
            ids, *(columns[name] for name in fields)):
        entries[entry_id] = IndexedEntry(buckets[bucket], size, hits, saved, bool(corrupt), repeat, created, used,
                                         root or entry_id, sig, repeats)
    matrices, start, rows = {}, 0, len(vectors)
    while start < rows:     # the rows come bucket by bucket
        bucket = entries[ids[start]].bucket
        stop = start
        while stop < rows and entries[ids[stop]].bucket == bucket:
            stop += 1
        if bucket in matrices or any(entries[e].corrupt for e in ids[start:stop]):
            raise UnusableSnapshot("its rows are not grouped by bucket")
        matrices[bucket] = BucketMatrix(ids[start:stop], vectors[start:stop])
        start = stop
    if any(not entries[e].corrupt for e in ids[rows:]):
        raise UnusableSnapshot("an entry that is not corrupt has no vector")
    return MemoryIndex.assembled(entries, matrices, columns["parts"])
