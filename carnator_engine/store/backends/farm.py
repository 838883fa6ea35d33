"""The farm layout: one Redis server holds the index, signatures, thumbnails and metadata (small: what every lookup
reads), and a folder on shared storage that every worker mounts holds the trajectory blobs (checkpoints and
attention connectivity: tens of MB each at Wan size), so Redis's memory grows by kilobytes per entry, not by the
trajectory. Composes the Redis backend (redis_store.py) and a BlobFolder (blob_folder.py).

Keys beside the Redis backend's: `f:<id>` the name of the entry's blob file (kept BLOB_GRACE_SECONDS after the
entry's removal, for readers in flight), `r:<name>` the set of entries that refer to that file (equal blobs share
one), `gc` the files that lost their last reference (name -> when) with `gcb` their bytes, `w` the files being
written (name -> when the write began) with `wb` their bytes, and `x:<name>` a short-lived tombstone while a file
is unlinked.

One farm, one folder: the farm's identity is its Redis store's, and the folder's marker names it. A second farm
given the folder is refused; a Redis that lost its data (FLUSHALL, a restart without its append-only file) takes
the identity back from the folder's marker when it is reached at the URL the marker records. Redis remembers the
folder's identity (redis_store.BLOB_FOLDER_KEY), so a worker that mounts another folder, or none, is refused, and
a folder that lost its marker while the store runs (unmounted) makes reads fail as a fault, never as damage.

What it promises, beside the backend contract (backends/__init__.py):
- a blob file is written whole (temporary, fsync, rename) before the transaction that makes its entry visible,
  and registered in `w` before it is written;
- a file is deleted only when no entry refers to it, its content proves it is this farm's (blob_folder.py), and
  Redis recorded why: released by its last entry (`gc`), or registered by a write that never committed (`w`, older
  than ORPHAN_GRACE_SECONDS: a killed writer). A file this Redis never recorded (another farm's, one from before
  a data loss, anyone's) is never deleted. The unlink runs under a tombstone that makes a concurrent writer of the
  same blob wait and write it again;
- a released file stays BLOB_GRACE_SECONDS for readers in flight, unless space is short: over the size limit, or
  a write failing with a full disk, released files go at once (a reader that loses its file generates in full);
- the size limit counts the folder: entries through their sizes, and every worker reads the released files and
  the writes in flight from Redis (overhead_bytes). Those two never make a live entry leave
  (lasting_overhead_bytes is 0): they leave, or become entries, by themselves.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import time
import uuid

from ..errors import StoreError
from ..owned_files import HEADER_BYTES
from .blob_folder import BlobFolder
from .redis_store import BLOB_FOLDER_KEY, PREFIX, RedisBackend

log = logging.getLogger("carnator.store")

BLOB_GRACE_SECONDS = 60      # a released blob stays readable this long (a hit reads it within a second)
ORPHAN_GRACE_SECONDS = 600   # a registered write that has not committed after this long was killed
TOMBSTONE_MS = 30_000        # a collector that dies mid-delete holds up writers of that blob at most this long
COLLECT_BATCH = 200
GC_KEY, GC_BYTES = PREFIX + "gc", PREFIX + "gcb"
WRITES_KEY, WRITE_BYTES = PREFIX + "w", PREFIX + "wb"
LOCATION_JOIN = " + "        # a farm's location: its Redis URL (no password), this, its blob folder


def _disk_full(error: BaseException) -> bool:
    cause = error.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)


class FarmBackend:
    def __init__(self, url: str, blob_dir: str):
        self._folder = BlobFolder(blob_dir)
        self._redis = RedisBackend(url, blob_folder=None)   # connects; the identity and binding follow
        self._client = self._redis._client
        self.blob_dir = self._folder.location
        self.location = f"{self._redis.location}{LOCATION_JOIN}{self.blob_dir}"
        self.identity = self._redis.identity = self._establish()

    def _establish(self) -> str:
        """The farm's identity, its folder claimed and bound (see the module's docstring)."""
        redis, location = self._redis, self._redis.location
        identity = redis.stored_identity()
        bound = redis.bound_folder() if identity is not None else ""
        if identity is None:
            marker = self._folder.marker()
            farm = marker.get("farm") if marker else None
            if farm and marker.get("redis") != location:
                raise StoreError(f"blob_dir {self.blob_dir!r} belongs to the farm whose Redis is "
                                 f"{marker.get('redis')} (store {farm[:8]}...), and {location} holds no Carnator "
                                 "store: give each farm a folder of its own (or, if that farm's Redis lost its data "
                                 "and moved, open it once at its old URL)")
            if farm:
                log.warning("carnator: %s holds no Carnator data, but blob_dir %s is its farm's folder: Redis lost "
                            "its data (run it with appendonly yes); the farm continues, the folder's files kept",
                            location, self.blob_dir)
            identity = redis.establish(farm or uuid.uuid4().hex)
            bound = redis.bound_folder()
        folder = self._folder.claim(identity, location, create=not bound)
        if bound and bound != folder:
            raise StoreError(f"Carnator cache {location!r} keeps its trajectories in another blob folder (folder "
                             f"identity {bound[:8]}..., this one {folder[:8]}...): give blob_dir, the folder of that "
                             "store every worker mounts")
        redis.identity = identity
        redis._bind(folder)
        return identity

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
                        self._register_write(name, HEADER_BYTES + len(blob))
                        try:
                            self._write(name, blob)   # after the tombstone check: a collector after it fails
                        except StoreError:
                            self._unregister_write(name)   # nothing of it stayed behind (write_whole)
                            raise
                        pipe.multi()
                        self._redis.queue_put(pipe, entry_id, meta, {"sig": parts["sig"], "thumb": parts["thumb"]})
                        pipe.set(self._name_key(entry_id), name)
                        pipe.sadd(self._refs_key(name), entry_id)
                        self._queue_unlisted(pipe, name)       # written and referenced: neither in flight nor garbage
                        # The identity and the binding with every entry: a Redis that lost its data meanwhile
                        # (FLUSHALL) is a farm again at once, never a Redis-only store holding a farm's entries.
                        pipe.set(PREFIX + "store", self.identity, nx=True)
                        pipe.set(BLOB_FOLDER_KEY, self._folder.identity, nx=True)
                        pipe.execute()
                        return
                    except errors.WatchError:
                        continue   # a collector took the tombstone meanwhile: the file may be gone, write it again
        self._redis._guard("store an entry", work)

    def _register_write(self, name: str, size: int) -> None:
        """Recorded before the file is written: a writer killed before its commit leaves a registration, which
        proves the file it left is a failed write of this farm (reclaim_orphans)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.zadd(WRITES_KEY, {name: time.time()})
        pipe.hset(WRITE_BYTES, name, size)
        pipe.execute()

    def _unregister_write(self, name: str) -> None:
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.zrem(WRITES_KEY, name)
            pipe.hdel(WRITE_BYTES, name)
            pipe.execute()
        except self._redis._errors.RedisError:
            pass   # left registered: reclaim_orphans finds nothing to delete and forgets it

    def _write(self, name: str, blob: bytes) -> None:
        """The blob's file; on a full disk, the released files are deleted at once (their grace period is a
        courtesy to readers, not worth a lost write) and the write tried once more."""
        try:
            self._folder.write(name, blob)
        except StoreError as error:
            if not _disk_full(error):
                raise
            self._collect(due=float("inf"))
            self._folder.write(name, blob)

    @staticmethod
    def _queue_unlisted(pipe, name: str) -> None:
        pipe.zrem(WRITES_KEY, name)
        pipe.hdel(WRITE_BYTES, name)
        pipe.zrem(GC_KEY, name)
        pipe.hdel(GC_BYTES, name)

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
                pipe.scard(self._refs_key(name.decode()))
        replies = self._redis._guard("delete an entry", lambda: self._redis.freeing(deletions, "del", entry_id))
        if name is not None and replies[-1] == 0:
            self._released([name.decode()])
        self.collect()
        return bool(replies[0])

    def _released(self, names) -> None:
        """Schedules files that lost their last reference for collection, with their bytes (the size limit counts
        them meanwhile). Best effort: over Redis's maxmemory (refused) they stay on disk, unscheduled."""
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.zadd(GC_KEY, {name: time.time() for name in names}, nx=True)
            pipe.hset(GC_BYTES, mapping={name: self._folder.size(name) for name in names})
            pipe.execute()
        except self._redis._errors.RedisError:
            pass

    def clear(self) -> None:
        """The entries listed now, and only those (an entry committed meanwhile stays whole and listed); a file is
        released only where its last reference went, never by deleting a reference set another writer may have
        just joined."""
        ids = self._redis.entry_ids()
        names = self._redis._guard("clear the cache", lambda: self._client.mget(
            [self._name_key(e) for e in ids])) if ids else []
        held = [(entry_id, name.decode()) for entry_id, name in zip(ids, names) if name is not None]
        released = sorted({name for _, name in held})

        def deletions(pipe):
            self._redis.queue_clear(pipe, ids)
            for entry_id, name in held:
                pipe.expire(self._name_key(entry_id), max(1, int(BLOB_GRACE_SECONDS)))
                pipe.srem(self._refs_key(name), entry_id)
            for name in released:
                pipe.scard(self._refs_key(name))
        replies = self._redis._guard("clear the cache", lambda: self._redis.freeing(deletions, "clear", "-"))
        emptied = [name for name, left in zip(released, replies[len(replies) - len(released):]) if left == 0]
        if emptied:
            self._released(emptied)

    # ---- garbage collection ----------------------------------------------------------------------

    def _delete_unreferenced(self, name: str) -> int:
        """Deletes blob file `name` when no entry refers to it (its content proving it ours); returns the bytes
        freed. Under the tombstone: a writer of the same blob that checked before it takes the tombstone fails its
        transaction on the watched key and writes the file again; one that checks after it waits until the file is
        gone, then writes it."""
        errors = self._redis._errors
        with self._client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(self._refs_key(name), self._tombstone_key(name))
                referenced = pipe.scard(self._refs_key(name)) or pipe.exists(self._tombstone_key(name))
                pipe.multi()
                if not referenced:
                    pipe.set(self._tombstone_key(name), "1", px=TOMBSTONE_MS)
                self._queue_unlisted(pipe, name)   # referenced again: a later removal schedules it anew
                pipe.execute()
            except errors.WatchError:
                return 0
        if referenced:
            return 0
        try:
            return self._folder.remove(name)
        finally:
            self._client.delete(self._tombstone_key(name))

    def _collect(self, due: float, need: float = float("inf")) -> tuple:
        """Deletes released files released before `due` (seconds since the epoch), oldest first, until `need`
        bytes are freed; (count, bytes)."""
        count = freed = 0
        tried = set()
        while freed < need:
            names = [n.decode() for n in self._client.zrangebyscore(GC_KEY, "-inf", due, start=0,
                                                                     num=COLLECT_BATCH + len(tried))]
            names = [n for n in names if n not in tried]
            if not names:
                break
            for name in names[:COLLECT_BATCH]:
                tried.add(name)   # one attempt each (one another worker is collecting stays listed until it is)
                size = self._delete_unreferenced(name)
                count, freed = count + bool(size), freed + size
                if freed >= need:
                    break
        return count, freed

    def collect(self) -> tuple:
        """Deletes the released blobs whose grace period is over; (count, bytes). Best effort: a failure leaves them
        for the next call."""
        try:
            return self._collect(due=time.time() - BLOB_GRACE_SECONDS)
        except (self._redis._errors.RedisError, StoreError):
            return 0, 0

    def reclaim_orphans(self) -> tuple:
        """At open: the released blobs past their grace period, then what the writes registered longer than
        ORPHAN_GRACE_SECONDS ago and never committed left (a worker killed between its write and its commit): the
        file, if no entry refers to it, and the write's temporary files."""
        return self._redis._guard("reclaim orphan blobs", self._reclaim)

    def _reclaim(self) -> tuple:
        count, freed = self.collect()
        cutoff = time.time() - ORPHAN_GRACE_SECONDS
        for name in [n.decode() for n in self._client.zrangebyscore(WRITES_KEY, "-inf", cutoff)]:
            leftovers = self._folder.temporaries(name, older_than=cutoff)
            gone = self._delete_unreferenced(name) + sum(self._folder.remove(t) for t in leftovers)
            count, freed = count + bool(gone), freed + gone
        return count, freed

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

    def check_present(self) -> None:
        """StoreUnavailable when a missing blob may be the folder's absence (unmounted, another folder in its place)
        or the store's rebinding, not damage: the entry is then not marked corrupt."""
        self._folder.check_present()
        if self._redis.bound_folder() != self._folder.identity:
            raise StoreError(f"Carnator cache {self.location!r} is bound to another blob folder now: give blob_dir, "
                             "the folder of that store every worker mounts")

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
        """The folder's files that no entry accounts for: released files not yet deleted and writes in flight, as
        Redis lists them for every worker."""
        def work():
            pipe = self._client.pipeline(transaction=False)
            pipe.hvals(GC_BYTES)
            pipe.hvals(WRITE_BYTES)
            return sum(int(v) for values in pipe.execute() for v in values)
        try:
            return self._redis._guard("measure its folder", work)
        except StoreError:
            return 0

    def lasting_overhead_bytes(self) -> int:
        """None of overhead_bytes: released files are deleted (compact) and writes in flight become entries, so
        neither may make a live entry leave."""
        return 0

    def compact(self, excess: int) -> None:
        """Over the size limit: released files deleted at once, oldest release first, until `excess` bytes are
        freed."""
        try:
            self._collect(due=float("inf"), need=excess)
        except (self._redis._errors.RedisError, StoreError):
            pass

    def close(self) -> None:
        self._redis.close()
