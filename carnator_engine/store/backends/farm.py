"""The farm layout: one Redis server holds the index, signatures, thumbnails and metadata (small: what every lookup
reads), and a folder on shared storage that every worker mounts holds the trajectory blobs (checkpoints and
attention connectivity: tens of MB each at Wan size), so Redis's memory grows by kilobytes per entry, not by the
trajectory. Composes the Redis backend (redis_store.py) and a BlobFolder (blob_folder.py).

Keys beside the Redis backend's: `f:<id>` the name of the entry's blob file (kept BLOB_GRACE_SECONDS after the
entry's removal, for readers in flight), `r:<name>` the set of entries that
refer to that file (equal blobs share one), `gc` the files that lost their last reference (name -> when), and
`x:<name>` a short-lived tombstone while a file is unlinked. The store is bound to its folder's identity
(redis_store.BLOB_FOLDER_KEY), so a worker that mounts another folder, or none, is refused instead of marking
healthy entries corrupt.

What it promises, beside the backend contract (backends/__init__.py):
- a blob file is written whole (temporary, fsync, rename) before the transaction that makes its entry visible;
- a file is deleted only when no entry refers to it, under a tombstone that makes a concurrent writer of the same
  blob wait and write it again, and only after a grace period: BLOB_GRACE_SECONDS since it lost its last
  reference (a worker that read the entry's metadata just before its removal still reads the whole file), or
  ORPHAN_GRACE_SECONDS since it was written for a file no entry ever referred to (a writer killed before its
  commit). Only files under the blob folder's own names are deleted, and only in a folder with the store marker;
- the size limit counts the blobs on disk: entries' blobs through their sizes, and the unreferenced files still in
  their grace period (overhead_bytes); a blob an eviction released leaves the disk after BLOB_GRACE_SECONDS.
"""
from __future__ import annotations

import hashlib
import time

from ..errors import StoreError
from .blob_folder import BlobFolder
from .redis_store import PREFIX, RedisBackend

BLOB_GRACE_SECONDS = 60      # a released blob stays readable this long (a hit reads it within a second)
ORPHAN_GRACE_SECONDS = 600   # a file no entry refers to may be a write in flight this long (as in disk.py)
TOMBSTONE_MS = 30_000        # a collector that dies mid-delete holds up writers of that blob at most this long
COLLECT_BATCH = 200
GC_KEY = PREFIX + "gc"
LOCATION_JOIN = " + "        # a farm's location: its Redis URL (no password), this, its blob folder


class FarmBackend:
    def __init__(self, url: str, blob_dir: str):
        self._folder = BlobFolder(blob_dir)
        self._redis = RedisBackend(url, blob_folder=self._folder.identity)
        self._client = self._redis._client
        self.identity = self._redis.identity
        self.blob_dir = self._folder.location
        self.location = f"{self._redis.location}{LOCATION_JOIN}{self.blob_dir}"
        self._young_files = {}   # name -> bytes: unreferenced files still in their grace period at the last sweep

    @staticmethod
    def _name_key(entry_id: str) -> str:
        return f"{PREFIX}f:{entry_id}"

    @staticmethod
    def _refs_key(name: str) -> str:
        return f"{PREFIX}r:{name}"

    @staticmethod
    def _tombstone_key(name: str) -> str:
        return f"{PREFIX}x:{name}"

    # ---- writing ---------------------------------------------------------------------------------

    def commit(self, entry_id: str, meta: bytes, parts: dict) -> None:
        blob = parts["blob"]
        name = hashlib.sha256(blob).hexdigest() + ".blob"
        errors = self._redis._errors

        def work():
            deadline = time.monotonic() + TOMBSTONE_MS / 1000
            with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(self._tombstone_key(name))
                        if pipe.exists(self._tombstone_key(name)):   # being unlinked: write it again afterwards
                            pipe.unwatch()
                            if time.monotonic() > deadline:
                                raise StoreError(f"Carnator cache {self.location!r}: blob {name} stays locked for "
                                                 "deletion: delete the key carnator:x:" + name)
                            time.sleep(0.02)
                            continue
                        self._folder.write(name, blob)   # after the tombstone check: a collector after it fails
                        pipe.multi()
                        self._redis.queue_put(pipe, entry_id, meta, {"sig": parts["sig"], "thumb": parts["thumb"]})
                        pipe.set(self._name_key(entry_id), name)
                        pipe.sadd(self._refs_key(name), entry_id)
                        pipe.execute()
                        return
                    except errors.WatchError:
                        continue   # a collector took the tombstone meanwhile: the file may be gone, write it again
        self._redis._guard("store an entry", work)

    def update(self, entry_id: str, change) -> bool:
        return self._redis.update(entry_id, change)

    def remove(self, entry_id: str) -> bool:
        name = self._redis._guard("delete an entry", lambda: self._client.get(self._name_key(entry_id)))

        def deletions(pipe):
            self._redis.queue_remove(pipe, entry_id)
            if name is not None:
                # The name outlives the entry by the grace period: a worker that read the metadata just before reads
                # the file it names, still on disk until then.
                pipe.expire(self._name_key(entry_id), max(1, int(BLOB_GRACE_SECONDS)))
                pipe.srem(self._refs_key(name.decode()), entry_id)
        existed = self._redis._guard("delete an entry", lambda: bool(
            self._redis.freeing(deletions, "del", entry_id)[0]))
        if name is not None:
            self._released([name.decode()])
        self.collect()
        return existed

    def _released(self, names) -> None:
        """Schedules files that may have lost their last reference for collection. Best effort: over Redis's
        maxmemory (ZADD refused) they stay unscheduled and the next open's sweep reclaims them as orphans."""
        try:
            now = time.time()
            self._client.zadd(GC_KEY, {name: now for name in names})
        except self._redis._errors.RedisError:
            pass

    def clear(self) -> None:
        ids = self._redis.entry_ids()
        names = self._redis._guard("clear the cache", lambda: self._client.mget(
            [self._name_key(e) for e in ids])) if ids else []
        released = sorted({n.decode() for n in names if n is not None})

        def deletions(pipe):
            self._redis.queue_clear(pipe, ids)
            for entry_id in ids:
                pipe.expire(self._name_key(entry_id), max(1, int(BLOB_GRACE_SECONDS)))
            for name in released:
                pipe.delete(self._refs_key(name))
        self._redis._guard("clear the cache", lambda: self._redis.freeing(deletions, "clear", "-"))
        if released:
            self._released(released)

    # ---- garbage collection ----------------------------------------------------------------------

    def _delete_unreferenced(self, name: str, written_before: float = None) -> int:
        """Deletes blob file `name` when no entry refers to it (and, given `written_before`, it was written before
        then); returns the bytes freed. Under the tombstone: a writer of the same blob that checked before it takes
        the tombstone fails its transaction on the watched key and writes the file again; one that checks after it
        waits until the file is gone, then writes it."""
        errors = self._redis._errors
        with self._client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self._refs_key(name), self._tombstone_key(name))
                if pipe.scard(self._refs_key(name)) or pipe.exists(self._tombstone_key(name)):
                    pipe.multi()
                    pipe.zrem(GC_KEY, name)   # referenced again: a later removal schedules it anew
                    pipe.execute()
                    return 0
                if written_before is not None:
                    mtime = self._folder.mtime(name)
                    if mtime is None or mtime > written_before:
                        pipe.unwatch()
                        return 0
                pipe.multi()
                pipe.set(self._tombstone_key(name), "1", px=TOMBSTONE_MS)
                pipe.zrem(GC_KEY, name)
                pipe.execute()
            except errors.WatchError:
                return 0
        try:
            return self._folder.remove(name)
        finally:
            self._client.delete(self._tombstone_key(name))

    def collect(self) -> tuple:
        """Deletes the released blobs whose grace period is over; (count, bytes). Best effort: a failure leaves them
        for the next call."""
        count = freed = 0
        try:
            due = self._client.zrangebyscore(GC_KEY, "-inf", time.time() - BLOB_GRACE_SECONDS, start=0,
                                             num=COLLECT_BATCH)
            for name in due:
                size = self._delete_unreferenced(name.decode())
                count, freed = count + bool(size), freed + size
        except self._redis._errors.RedisError:
            pass
        return count, freed

    def reclaim_orphans(self) -> tuple:
        """At open: the released blobs past their grace period, then every file of the folder's own names that no
        entry refers to and that is older than ORPHAN_GRACE_SECONDS (a worker killed between its write and its
        commit, or a temporary of an interrupted write). The young ones are counted in the size limit meanwhile."""
        return self._redis._guard("reclaim orphan blobs", self._reclaim)

    def _reclaim(self) -> tuple:
        count, freed = self.collect()
        cutoff = time.time() - ORPHAN_GRACE_SECONDS
        files = list(self._folder.files())
        blobs = [(name, size, mtime) for name, size, mtime, blob in files if blob]
        referenced = self._referenced([name for name, _, _ in blobs])
        young = {}
        for name, size, mtime in blobs:
            if name in referenced:
                continue
            if mtime > cutoff:
                young[name] = size
                continue
            gone = self._delete_unreferenced(name, written_before=cutoff)
            count, freed = count + bool(gone), freed + gone
        for name, size, mtime, blob in files:
            if not blob:
                if mtime > cutoff:
                    young[name] = size
                else:
                    gone = self._folder.remove(name)
                    count, freed = count + bool(gone), freed + gone
        self._young_files = young
        return count, freed

    def _referenced(self, names: list) -> set:
        found = set()
        for start in range(0, len(names), COLLECT_BATCH):
            chunk = names[start:start + COLLECT_BATCH]
            pipe = self._client.pipeline(transaction=False)
            for name in chunk:
                pipe.exists(self._refs_key(name))
            found.update(name for name, held in zip(chunk, pipe.execute()) if held)
        return found

    # ---- reading ---------------------------------------------------------------------------------

    def meta(self, entry_id: str):
        return self._redis.meta(entry_id)

    def part(self, entry_id: str, kind: str):
        return self.parts([entry_id], kind)[0]

    def parts(self, entry_ids: list, kind: str) -> list:
        if kind != "blob":
            return self._redis.parts(entry_ids, kind)
        if not entry_ids:
            return []
        names = self._redis._guard("read entries",
                                   lambda: self._client.mget([self._name_key(e) for e in entry_ids]))
        return [self._folder.read(name.decode()) if name is not None else None for name in names]

    def metas(self):
        return self._redis.metas()

    def cursor(self):
        return self._redis.cursor()

    def changes(self, cursor):
        return self._redis.changes(cursor)

    def load_snapshot(self):
        return self._redis.load_snapshot()

    def save_snapshot(self, data: bytes) -> None:
        self._redis.save_snapshot(data)

    # ---- space -----------------------------------------------------------------------------------

    def overhead_bytes(self) -> int:
        """The blob folder's files that no entry accounts for and that are still in their grace period."""
        return sum(self._young_files.values())

    def compact(self) -> None:
        self.collect()

    def close(self) -> None:
        self._redis.close()
