"""The persistent store of earlier generations, on one of two backends (carnator_engine/backends): a directory
(diskcache + blob files, the default) or a Redis server shared by many workers (`redis://` / `rediss://` URL).

An entry is its metadata (JSON: bucket, request key, prompt, seed, steps, hits, lineage, sizes, the SHA-256 of its
parts and its compact signature vector) and three parts: the Early Signature (safetensors, read when the entry is
on a lookup's shortlist), the trajectory blob (checkpoints, attention connectivity, final latent; read on a hit)
and a PNG thumbnail. A part whose bytes do not match their checksum, or do not parse, makes the entry corrupt: it
is reported, marked, evicted first and never reaches a generation; unreadable metadata is reported and removed.

Lookups never scan: the in-memory index (memory_index.py; each bucket's compact vectors a matrix) is loaded at open
from the backend's snapshot of it (index_snapshot.py) and the change log since, or rebuilt from every entry's
metadata when no snapshot is usable, and kept current from the change log, which also carries other processes'
writes. A snapshot is written after a rebuild, after every SNAPSHOT_EVERY changes and at close. The size limit
is ours: after each write the entries with the least computational benefit (steps their hits saved, as in
NIRVANA's LCBFU; never-hit entries first, oldest use first) leave, in the order of a heap (eviction.py), until
the entries and the backend's own files (SQLite's) fit.
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from . import index_snapshot
from .errors import CorruptEntryError, StoreError, StoreUnavailable
from .memory_index import IndexedEntry, MemoryIndex
from ..plain import json_safe
from ..settings import DEFAULT_SIZE_LIMIT  # the one default: the Carnator Cache node, the CLI and the engine
from ..signature import EarlySignature
from .vectors import VECTOR_DIM, BucketMatrix, compact_vector
from .write_back import BackgroundWriter

log = logging.getLogger("carnator.store")

MIN_SIZE_LIMIT = 1 << 20
SIGNATURE_CACHE = 256   # parsed signatures kept in memory (entries never change their signature)
# Changes taken in from the log before the index is snapshotted again: an open replays at most this many
# (~0.3 ms each), and a snapshot of 100k entries costs well under a second to write.
SNAPSHOT_EVERY = 2000
RECONNECT_SECONDS = 5   # a store opened while its medium was unreachable tries again at most this often


def _check_size_limit(size_limit_bytes) -> None:
    if not isinstance(size_limit_bytes, (int, float)) or not math.isfinite(size_limit_bytes):
        raise ValueError(f"cache size limit {size_limit_bytes!r} is not a finite number of bytes: give a size "
                         "such as 8 GiB")
    if size_limit_bytes < MIN_SIZE_LIMIT:
        raise ValueError(f"cache size limit {size_limit_bytes} bytes is below the minimum of "
                         f"{MIN_SIZE_LIMIT} bytes (1 MiB): raise the size limit")


def new_entry_id() -> str:
    return uuid.uuid4().hex[:16]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class EntryRecord:
    entry_id: str
    bucket: str
    prompt: str
    seed: int
    steps: int
    probe_steps: int
    checkpoint_steps: list
    latent_shape: list
    created: float
    last_used: float
    sig_sha256: str
    blob_sha256: str
    size_bytes: int
    hits: int = 0
    repeats: int = 0       # of `hits`, the exact repeats answered with this entry's stored result
    steps_saved: int = 0
    reused_from: Optional[str] = None
    corrupt: Optional[str] = None
    extra: dict = field(default_factory=dict)
    request_key: str = ""  # every input of the request (pipeline.request_identity); "" in entries older than it
    lineage: str = ""      # the full generation this entry descends from through hits (itself for a full one)
    # A hit's key for repeats of it: its request key with the reuse settings its result depends on
    # (pipeline.hit_replay_key); "" for a full generation (its request key is its repeat key) and older hits.
    replay_key: str = ""

    @property
    def repeat_key(self) -> str:
        """The key under which this entry's stored result is the answer to a repeat ("" when it is none)."""
        if self.reused_from is None:
            return self.request_key
        return self.replay_key

    def replays(self, key: str) -> bool:
        """Whether this entry's stored result is exactly that request's: a full generation of that request key, or
        a hit of that replay key."""
        return bool(key) and self.repeat_key == key

    @property
    def benefit(self) -> float:
        return float(self.steps_saved)

    @property
    def root(self) -> str:
        return self.lineage or self.entry_id


RECORD_FIELDS = {f.name for f in dataclasses.fields(EntryRecord)}


@dataclass
class TrajectoryPayload:
    """What a hit needs from an entry: the latents entering chosen steps, and attention connectivity; what an
    exact repeat needs: the generation's final latent, kept at full precision."""

    checkpoints: dict          # step -> latent tensor (fp16, CPU)
    connectivity: dict         # name -> tensor (ConnectivityRecorder.tensors())
    final: Optional[torch.Tensor] = None


# Metadata as stored: this line (format and the SHA-256 of the JSON that follows), then the JSON. A flipped bit
# anywhere, or an edited field, fails the checksum: the entry is reported and removed, never served for another
# request. Metadata from before the checksum (plain JSON, "{" first, which no single flipped bit of this prefix
# gives) is read as it is, and checksummed at its next update.
META_FORMAT = b"carnator-meta-2 "


def _encode(record: EntryRecord, vector) -> bytes:
    value = asdict(record)
    value["vector"] = base64.b64encode(np.asarray(vector, dtype=np.float16).tobytes()).decode()
    body = json.dumps(value, allow_nan=False).encode()
    return META_FORMAT + _sha256(body).encode() + b"\n" + body


def _decode(data, entry_id: str) -> tuple:
    """(record, vector) from entry `entry_id`'s stored metadata; ValueError for anything that is not a whole,
    valid record of that entry."""
    data = bytes(data)
    if data.startswith(META_FORMAT):
        digest, _, data = data[len(META_FORMAT):].partition(b"\n")
        if _sha256(data).encode() != digest:
            raise ValueError("metadata does not match its checksum")
    elif not data.startswith(b"{"):
        raise ValueError("metadata does not parse (an unknown format)")
    try:
        value = json.loads(data)
        vector = np.frombuffer(base64.b64decode(value.pop("vector")), dtype=np.float16)
        record = EntryRecord(**{k: v for k, v in value.items() if k in RECORD_FIELDS})
    except Exception as error:  # noqa: BLE001 - whatever the damage, the entry is unreadable
        raise ValueError(f"metadata does not parse ({type(error).__name__})") from None
    if vector.shape != (VECTOR_DIM,) or not np.isfinite(vector).all():
        raise ValueError("metadata holds no valid signature vector")
    if record.entry_id != entry_id:
        raise ValueError(f"metadata is entry {str(record.entry_id)[:40]!r}'s")
    return record, vector


def _refuse_corrupt(record: EntryRecord) -> None:
    if record.corrupt:
        raise CorruptEntryError(f"cache entry {record.entry_id} is corrupt ({record.corrupt}); it was skipped")


def _finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise StoreError(f"{name} holds non-finite values (NaN or inf): a broken generation is never stored")


def _indexed(record: EntryRecord) -> IndexedEntry:
    repeat = record.repeat_key or None
    return IndexedEntry(record.bucket, record.size_bytes, record.hits, record.steps_saved, record.corrupt is not None,
                        repeat, record.created, record.last_used, record.root, record.sig_sha256, record.repeats)


def _bucket_parts(record: EntryRecord) -> Optional[dict]:
    parts = record.extra.get("bucket") if isinstance(record.extra, dict) else None
    return parts if isinstance(parts, dict) else None


class CarnatorStore:
    def __init__(self, location: str, size_limit_bytes: Optional[int] = DEFAULT_SIZE_LIMIT, blob_dir: str = ""):
        """`blob_dir` with a redis:// location: the farm layout (backends/farm.py), trajectories in that folder.
        A store whose medium cannot be reached now (StoreUnavailable: its Redis down, its shared folder not mounted)
        opens all the same: every use until it is reached raises StoreUnavailable (requests are generated in
        full), and it tries again at most every RECONNECT_SECONDS. `size_limit_bytes` is recorded with the store;
        None opens it with the limit recorded there (its last opener's; DEFAULT_SIZE_LIMIT if none), as `stats`
        does: looking at a cache neither changes its limit nor evicts under another one."""
        if size_limit_bytes is not None:
            _check_size_limit(size_limit_bytes)
        from .backends import shown_location
        self.location = shown_location(location, blob_dir)
        self._given_limit = None if size_limit_bytes is None else int(size_limit_bytes)
        self.size_limit_bytes = self._given_limit or DEFAULT_SIZE_LIMIT
        self.problems: list = []
        self._lock = threading.RLock()
        self._signatures: OrderedDict = OrderedDict()
        self.writer = BackgroundWriter(self.report_problem)   # the generations being stored in the background
        self._medium, self._opened, self._retry_at, self._why_unavailable = (location, blob_dir), None, 0.0, ""
        self._index, self._cursor, self._unsaved = MemoryIndex(), None, 0
        self.orphans_reclaimed = self.orphan_bytes_reclaimed = 0
        try:
            self._open()
        except StoreUnavailable as error:
            self._unavailable(error)

    def _open(self) -> None:
        from .backends import open_backend
        backend = open_backend(*self._medium)
        with self._lock:
            self._opened = backend
            try:
                self.location = backend.location
                self.orphans_reclaimed, self.orphan_bytes_reclaimed = backend.reclaim_orphans()
                if self.orphans_reclaimed:
                    log.info("carnator: reclaimed %d orphan blob files (%d bytes) in %s", self.orphans_reclaimed,
                             self.orphan_bytes_reclaimed, self.location)
                self._open_index()
                self._settle_size_limit(backend)
                self.enforce_size_limit()
            except StoreUnavailable:
                self._opened = None
                backend.close()
                raise

    def _unavailable(self, error: StoreError) -> None:
        self._retry_at = time.monotonic() + RECONNECT_SECONDS
        self._why_unavailable = str(error)
        log.warning("carnator: %s (the store is opened when it can be reached; until then requests are generated "
                    "in full)", error)

    @property
    def _backend(self):
        """The open backend; StoreUnavailable while the medium cannot be reached (tried again at most every
        RECONNECT_SECONDS)."""
        opened = self._opened
        if opened is not None:
            return opened
        with self._lock:
            if self._opened is None:
                if time.monotonic() < self._retry_at:
                    raise StoreUnavailable(self._why_unavailable)
                try:
                    self._open()
                except StoreUnavailable as error:
                    self._unavailable(error)
                    raise
            return self._opened

    def _settle_size_limit(self, backend) -> None:
        """The limit given at opening recorded with the store, or none given: the one recorded there. A limit that
        cannot be recorded (a full disk) still applies to this process; the store reports it."""
        recorded = backend.recorded_size_limit()
        if self._given_limit is None:
            self.size_limit_bytes = recorded if recorded is not None and recorded >= MIN_SIZE_LIMIT \
                else DEFAULT_SIZE_LIMIT
        elif recorded != self._given_limit:
            try:
                backend.record_size_limit(self._given_limit)
            except StoreUnavailable:
                raise
            except StoreError as error:
                self.report_problem(f"the cache's size limit was not recorded with it ({error})")

    def set_size_limit(self, size_limit_bytes: int) -> list:
        """Applies a new limit at once and records it with the store (a store not reached yet does both when it
        opens); returns the ids it evicted."""
        _check_size_limit(size_limit_bytes)
        self._given_limit = self.size_limit_bytes = int(size_limit_bytes)
        if self._opened is None:
            return []
        with self._lock:
            self._settle_size_limit(self._backend)
        return self.enforce_size_limit()

    def close(self) -> None:
        """Writes out the queued generations (write_back) and the index snapshot if it changed, then closes the
        backend."""
        self.writer.settle()
        with self._lock:
            if self._opened is None:
                return
            if self._unsaved:
                self._save_snapshot()
            self._opened.close()

    # ---- the in-memory index ---------------------------------------------------------------------

    def _open_index(self) -> None:
        """The index from the backend's snapshot and the changes logged since (by any process), or rebuilt from
        every entry's metadata when there is no usable snapshot."""
        with self._lock:
            try:
                data = self._backend.load_snapshot()
                loaded = index_snapshot.decode(data, self._backend.identity) if data is not None else None
            except (StoreError, index_snapshot.UnusableSnapshot) as why:
                log.warning("carnator: the index snapshot of %s is not used (%s): rebuilding the index from the "
                            "entries", self.location, why)
                loaded = None
            if loaded is None:
                self._rebuild()
                return
            (self._cursor, self._index), self._unsaved = loaded, 0
            self._sync()    # rebuilds instead where the log no longer reaches back to the snapshot

    def _rebuild(self) -> None:
        """Every entry's metadata decoded and the index assembled in bulk (100k entries: seconds, where adding
        them one by one took half as long again)."""
        with self._lock:
            self._cursor = self._backend.cursor()  # before reading: changes made meanwhile are replayed later
            self._signatures.clear()
            entries, rows, parts, unreadable = {}, {}, {}, []
            for entry_id, record, vector in self._decoded_metas(unreadable):
                indexed = entries[entry_id] = _indexed(record)
                if not indexed.corrupt:
                    ids, vectors = rows.setdefault(record.bucket, ([], bytearray()))
                    ids.append(entry_id)
                    vectors += vector.tobytes()    # one buffer, not 100k small arrays
                recorded = _bucket_parts(record)
                if recorded is not None:
                    parts.setdefault(record.bucket, recorded)
            matrices = {bucket: BucketMatrix(ids, np.frombuffer(vectors, np.float16).reshape(len(ids), VECTOR_DIM))
                        for bucket, (ids, vectors) in rows.items()}
            self._index = MemoryIndex.assembled(entries, matrices, parts)
            for entry_id, why in unreadable:   # once the index exists: removing an entry updates it
                self._unreadable(entry_id, why)
            self._save_snapshot()

    def _save_snapshot(self) -> None:
        """Best effort: without a snapshot the next open only takes longer."""
        self._unsaved = 0   # after a failure too: the next attempt waits for SNAPSHOT_EVERY more changes
        try:
            self._backend.save_snapshot(index_snapshot.encode(self._index, self._cursor, self._backend.identity))
        except StoreError as error:
            log.warning("carnator: %s (the next open of the store takes longer)", error)

    def _decoded_metas(self, unreadable: list):
        """(entry id, record, vector) of every stored entry whose metadata decodes; the others are appended to
        `unreadable` as (entry id, why), for the caller to remove once it may (the listing is still streaming)."""
        for entry_id, data in self._backend.metas():
            if data is None:
                continue           # deleted or evicted (by another worker) since the listing began: gone, not corrupt
            try:
                record, vector = _decode(data, entry_id)
            except ValueError as why:
                unreadable.append((entry_id, str(why)))
                continue
            yield entry_id, record, vector

    def _unreadable(self, entry_id: str, why: str) -> None:
        """Metadata that does not decode: reported, and the entry removed (it can never be used)."""
        self._forget(entry_id)
        self._report(entry_id, why, "it was removed")
        try:
            self._backend.remove(entry_id)
        except StoreError as error:
            log.warning("carnator: %s", error)

    def _apply(self, entry_id: str, data) -> None:
        """Indexes one entry's stored metadata (None: it is gone); unreadable metadata is reported and removed."""
        if data is None:
            self._forget(entry_id)
            return
        try:
            record, vector = _decode(data, entry_id)
        except ValueError as why:
            self._unreadable(entry_id, str(why))
            return
        self._signatures.pop(entry_id, None)
        self._index.add(entry_id, _indexed(record), vector, _bucket_parts(record))

    def _forget(self, entry_id: str) -> None:
        self._signatures.pop(entry_id, None)
        self._index.forget(entry_id)

    def _sync(self) -> None:
        """Takes in every change made since the last call, by this process or another one."""
        with self._lock:
            cursor, changes = self._backend.changes(self._cursor)
            if changes is None:
                self._rebuild()
                return
            self._cursor = cursor
            for op, entry_id in changes:
                if op == "clear":
                    self._rebuild()
                    return
                self._apply(entry_id, self._backend.meta(entry_id) if op != "del" else None)
            self._unsaved += len(changes)
            if self._unsaved >= SNAPSHOT_EVERY:
                self._save_snapshot()

    def shortlist(self, bucket: str, signature: EarlySignature, count: int) -> list:
        """Ids of the `count` entries of `bucket` whose compact vectors are nearest the signature's."""
        vector = compact_vector(signature)
        with self._lock:
            self._sync()
            matrix = self._index.matrices.get(bucket)
            return matrix.nearest(vector, count) if matrix is not None else []

    def lineage_of(self, entry_id: str) -> tuple:
        """(lineage, created) of an indexed entry, from memory: the full generation it descends from, and when it
        was stored (what orders equally near candidates, oldest first)."""
        with self._lock:
            indexed = self._index.entries.get(entry_id)
            return (indexed.root, indexed.created) if indexed is not None else (entry_id, 0.0)

    def holds_bucket(self, bucket: str) -> bool:
        """Whether any entry of `bucket` is stored, corrupt ones included (from memory)."""
        with self._lock:
            self._sync()
            return bucket in self._index.bucket_counts

    def bucket_examples(self) -> list:
        """(entry id, bucket parts) of the oldest usable entry of each bucket whose entries recorded their parts
        (index.bucket_parts), oldest first: what a miss for want of a bucket is compared with (from memory)."""
        with self._lock:
            self._sync()
            index = self._index
            oldest = {bucket: index.oldest_in(bucket) for bucket in index.bucket_parts}
            found = [(entry_id, index.bucket_parts[bucket]) for bucket, entry_id in oldest.items() if entry_id]
            return sorted(found, key=lambda example: index.entries[example[0]].created)

    def index_bytes(self) -> int:
        return self._index.nbytes()

    # ---- writing ---------------------------------------------------------------------------------

    def put(self, *, bucket: str, prompt: str, seed: int, steps: int, probe_steps: int,
            signature: EarlySignature, payload: TrajectoryPayload, latent_shape, thumbnail: bytes = b"",
            reused_from: Optional[str] = None, extra: Optional[dict] = None, request_key: str = "",
            replay_key: str = "",
            entry_id: Optional[str] = None) -> str:
        """Stores one entry and returns its id: `entry_id` (new_entry_id(), chosen before a background write so the
        request can name its entry at once) or a new one."""
        if not isinstance(signature, EarlySignature):
            raise StoreError(f"signature is a {type(signature).__name__}, not an Early Signature: pass the probe's "
                             "signature (ProbeResult.signature)")
        try:
            vector = compact_vector(signature)
        except ValueError as error:
            raise StoreError(str(error)) from None
        for step, latent in payload.checkpoints.items():
            _finite(f"checkpoint {step}", latent)
        if payload.final is not None:
            _finite("the final latent", payload.final)
        tensors = {f"checkpoint.{step}": latent.contiguous() for step, latent in payload.checkpoints.items()}
        tensors.update({f"connectivity.{name}": value.contiguous() for name, value in payload.connectivity.items()})
        if payload.final is not None:
            tensors["final"] = payload.final.detach().to("cpu").contiguous()
        blob = save_safetensors(tensors) if tensors else save_safetensors({"empty": torch.zeros(0)})
        sig = save_safetensors(signature.to_tensors())
        size = len(blob) + len(sig) + len(thumbnail)
        if size > self.size_limit_bytes:
            raise StoreError(f"this generation needs {size / 2**20:.1f} MiB but the cache size limit is "
                             f"{self.size_limit_bytes / 2**20:.1f} MiB: raise the size limit to keep it")
        now = time.time()
        entry = entry_id or new_entry_id()
        with self._lock:
            source = self._lineage_of(reused_from) if reused_from else entry
            record = EntryRecord(
                entry_id=entry, bucket=bucket, prompt=prompt, seed=int(seed), steps=int(steps),
                probe_steps=int(probe_steps), checkpoint_steps=sorted(int(s) for s in payload.checkpoints),
                latent_shape=[int(d) for d in latent_shape], created=now, last_used=now,
                sig_sha256=_sha256(sig), blob_sha256=_sha256(blob), size_bytes=size,
                reused_from=reused_from, extra=json_safe(dict(extra or {})), request_key=request_key, lineage=source,
                replay_key=replay_key if reused_from else "")
            meta = _encode(record, vector)
            self._backend.commit(entry, meta, {"sig": sig, "blob": blob, "thumb": thumbnail})
            self._apply(entry, meta)
            self.enforce_size_limit(keep=entry)
        return entry

    def _lineage_of(self, entry_id: str) -> str:
        try:
            return self.record(entry_id).root
        except StoreError:
            return entry_id  # the source is gone: its id still names the lineage

    def _update(self, entry_id: str, change) -> None:
        def rewrite(data):
            try:
                record, vector = _decode(data, entry_id)
            except ValueError:
                return data  # left as it is: _apply reports and removes it
            change(record)
            return _encode(record, vector)
        with self._lock:
            if self._backend.update(entry_id, rewrite):
                self._apply(entry_id, self._backend.meta(entry_id))

    def record_hit(self, entry_id: str, steps_saved: int, exact_repeat: bool = False) -> None:
        def hit(record):
            record.hits += 1
            record.repeats += bool(exact_repeat)
            record.steps_saved += int(steps_saved)
            record.last_used = time.time()
        self._update(entry_id, hit)

    def delete(self, entry_id: str) -> bool:
        with self._lock:
            existed = self._backend.remove(entry_id)
            self._forget(entry_id)
            return existed

    def clear(self) -> int:
        with self._lock:
            self._sync()
            count = len(self._index)
            self._backend.clear()
            self._rebuild()
            return count

    def enforce_size_limit(self, keep: Optional[str] = None) -> list:
        """Keeps the store within its limit; returns the evicted ids. Over it, the backend first frees what needs no
        eviction (compact: a farm's released blobs); then the least-benefit entries leave while the entries and the
        backend's lasting overhead exceed it (what leaves or becomes an entry by itself, a farm's released blobs and
        writes in flight, never makes a live entry leave)."""
        evicted = []
        with self._lock:
            self._sync()
            backend = self._backend
            excess = self._index.bytes + backend.overhead_bytes() - self.size_limit_bytes
            if excess > 0:
                backend.compact(excess)
            while self._eviction_step(backend, keep, evicted):
                pass
            excess = self._index.bytes + backend.overhead_bytes() - self.size_limit_bytes
            if evicted and excess > 0:
                backend.compact(excess)   # what the evictions released
        if evicted:
            log.info("carnator: evicted %d entries to stay under %d bytes", len(evicted), self.size_limit_bytes)
        return evicted

    def _eviction_step(self, backend, keep: Optional[str], evicted: list) -> bool:
        """One entry evicted where the store is over its budget; whether to look again. Under the backend's
        eviction lock (a folder store's processes: one step at a time; a shared store's total is checked in its
        removing transaction instead), from an index that has taken in every eviction made so far, by any process:
        processes evicting at once never evict what another one's eviction already made room for."""
        with backend.eviction_step():
            self._sync()
            budget = self.size_limit_bytes - backend.lasting_overhead_bytes()
            if self._index.bytes <= budget:
                return False
            victim = self._index.queue.first(skip=keep)
            if victim is None:
                return False
            outcome, _ = backend.evict(victim, budget)   # a shared store checks its own total, atomically
            if outcome == "fits":
                return False
            self._forget(victim)
            if outcome == "evicted":
                evicted.append(victim)
            return True

    # ---- reading ---------------------------------------------------------------------------------

    def records(self, bucket: Optional[str] = None, include_corrupt: bool = False) -> list:
        """Every entry's record, oldest first: the cache browser's listing (lookups use the index instead)."""
        found, unreadable = [], []
        for _, record, _ in self._decoded_metas(unreadable):
            if (bucket is None or record.bucket == bucket) and (include_corrupt or record.corrupt is None):
                found.append(record)
        with self._lock:
            for entry_id, why in unreadable:
                self._unreadable(entry_id, why)
        return sorted(found, key=lambda r: r.created)

    def exact_repeat(self, bucket: str, request_key: str) -> Optional[EntryRecord]:
        """The newest entry whose stored result answers exactly this request (EntryRecord.repeat_key: a full
        generation's request key, a hit's replay key) in the bucket, else None."""
        with self._lock:
            self._sync()
            newest = self._index.newest_repeat(bucket, request_key)
        if newest is None:
            return None
        try:
            record = self.record(newest)
        except StoreError:
            return None
        # what the entry holds now, not what the index took in: its stored result answers this very request
        return record if record.bucket == bucket and record.replays(request_key) else None

    def record(self, entry_id: str) -> EntryRecord:
        data = self._backend.meta(entry_id)
        if data is None:
            with self._lock:
                self._forget(entry_id)
            raise StoreError(f"no cache entry {entry_id!r} (deleted or evicted?): run the probe and lookup again")
        try:
            return _decode(data, entry_id)[0]
        except ValueError as why:
            with self._lock:
                self._unreadable(entry_id, str(why))
            raise CorruptEntryError(f"cache entry {entry_id} is corrupt: {why}; it was removed") from None

    def signature(self, record: EntryRecord) -> EarlySignature:
        _refuse_corrupt(record)
        cached = self._cached_signature(record.entry_id)
        if cached is not None:
            return cached
        data = self._checked(record.entry_id, "sig", record.sig_sha256, self._backend.part(record.entry_id, "sig"))
        return self._parsed_signature(record.entry_id, data)

    def signatures_of(self, entry_ids: list) -> dict:
        """{id: signature} of indexed entries, without reading their metadata (the checksums are in memory), and
        those not in memory read in one backend call: what a lookup reads for its shortlist. An entry that is
        gone, marked corrupt, or found corrupt now (reported) is left out."""
        with self._lock:
            indexed = {e: self._index.entries.get(e) for e in entry_ids}
        usable = [e for e in entry_ids if indexed[e] is not None and not indexed[e].corrupt]
        found = {e: self._cached_signature(e) for e in usable}
        missing = [e for e in usable if found[e] is None]
        for entry_id, data in zip(missing, self._backend.parts(missing, "sig")):
            try:
                found[entry_id] = self._parsed_signature(
                    entry_id, self._checked(entry_id, "sig", indexed[entry_id].sig_sha256, data))
            except StoreError:
                found[entry_id] = None
        return {e: found[e] for e in usable if found[e] is not None}

    def _cached_signature(self, entry_id: str) -> Optional[EarlySignature]:
        with self._lock:
            cached = self._signatures.get(entry_id)
            if cached is not None:
                self._signatures.move_to_end(entry_id)
            return cached

    def _parsed_signature(self, entry_id: str, data: bytes) -> EarlySignature:
        try:
            signature = EarlySignature.from_tensors(load_safetensors(data))
        except Exception as error:  # any parse failure of stored bytes means corruption
            raise self._mark_corrupt(entry_id, f"signature does not parse ({error})")
        with self._lock:
            self._signatures[entry_id] = signature
            while len(self._signatures) > SIGNATURE_CACHE:
                self._signatures.popitem(last=False)
        return signature

    def trajectory(self, record: EntryRecord) -> TrajectoryPayload:
        _refuse_corrupt(record)
        # At most the bytes the record holds: a file put at its name (a link to /dev/zero) is never read whole.
        data = self._checked(record.entry_id, "blob", record.blob_sha256,
                             self._backend.part(record.entry_id, "blob", record.size_bytes), record.size_bytes)
        try:
            tensors = load_safetensors(data)
        except Exception as error:
            raise self._mark_corrupt(record.entry_id, f"trajectory does not parse ({error})")
        checkpoints = {int(k.split(".", 1)[1]): v for k, v in tensors.items() if k.startswith("checkpoint.")}
        connectivity = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith("connectivity.")}
        final = tensors.get("final")
        expected = tuple(record.latent_shape)
        latents = {f"checkpoint {step}": latent for step, latent in checkpoints.items()}
        if final is not None:
            latents["the final latent"] = final
        for name, latent in latents.items():
            if tuple(latent.shape) != expected:
                raise self._mark_corrupt(record.entry_id, f"{name} has shape {tuple(latent.shape)}, "
                                                          f"expected {expected}")
        if sorted(checkpoints) != sorted(record.checkpoint_steps):
            raise self._mark_corrupt(record.entry_id, "its checkpoints are not the ones its metadata lists")
        return TrajectoryPayload(checkpoints=checkpoints, connectivity=connectivity, final=final)

    def thumbnail(self, entry_id: str) -> bytes:
        return self._backend.part(entry_id, "thumb") or b""

    def stats(self) -> dict:
        """Totals from the in-memory index. `hits` are reuses through the gate; `exact_repeats` (requests answered
        with an entry's stored result) are counted apart: one definition for the CLI, the routes and the web UI."""
        with self._lock:
            self._sync()
            entries = self._index.entries.values()
            overhead = self._backend.overhead_bytes()
            held = self._index.bytes
            return {"entries": len(self._index), "corrupt": sum(e.corrupt for e in entries),
                    "bytes": held + overhead, "entry_bytes": held, "overhead_bytes": overhead,
                    "size_limit_bytes": self.size_limit_bytes, "hits": sum(e.hits - e.repeats for e in entries),
                    "exact_repeats": sum(e.repeats for e in entries),
                    "steps_saved": sum(e.steps_saved for e in entries), "directory": self.location,
                    "orphans_reclaimed": self.orphans_reclaimed, "index_bytes": self.index_bytes()}

    def drain_problems(self) -> list:
        """Problem reports (corrupt entries, unusable signatures) since the last call, for the node's output and the run's summary."""
        with self._lock:
            problems, self.problems = self.problems, []
        return problems

    # ---- corruption ----------------------------------------------------------------------------

    def _checked(self, entry_id: str, kind: str, sha: str, data: Optional[bytes], limit=None) -> bytes:
        """An entry's part as read (None: absent), whole and matching its checksum, else reported."""
        if data is None:
            if self._backend.meta(entry_id) is None:  # deleted or evicted while it was being read
                with self._lock:
                    self._forget(entry_id)
                raise StoreError(f"cache entry {entry_id} was deleted or evicted meanwhile")
            self._backend.check_present()   # a folder unmounted is a fault, not damage: nothing marked
            data = self._backend.part(entry_id, kind, limit)   # once more: a folder mounted again since the read
            if data is None:
                raise self._mark_corrupt(entry_id, f"its {kind} data is missing")
        if _sha256(data) != sha:
            raise self._mark_corrupt(entry_id, f"its {kind} data does not match its checksum")
        return data

    def _mark_corrupt(self, entry_id: str, why: str) -> CorruptEntryError:
        def mark(record):
            record.corrupt = why
        try:
            self._update(entry_id, mark)
        except StoreError as error:
            log.warning("carnator: could not mark entry %s corrupt: %s", entry_id, error)
        return self._report(entry_id, why)

    def _report(self, entry_id: str, why: str,
                done: str = "it was skipped (delete it or clear the cache)") -> CorruptEntryError:
        return CorruptEntryError(self.report_problem(f"cache entry {entry_id} is corrupt: {why}; {done}"))

    def withdraw_problem(self, message: str) -> bool:
        """Takes back a problem not drained yet, because it was shown on the request it concerns (a write that failed
        after that request's result was out): True when it was still waiting for the next request's warnings."""
        with self._lock:
            if message in self.problems:
                self.problems.remove(message)
                return True
        return False

    def report_problem(self, message: str) -> str:
        """A problem the current request should show as a warning (drain_problems) and the log should keep."""
        with self._lock:
            self.problems.append(message)
        log.warning("carnator: %s", message)
        return message
