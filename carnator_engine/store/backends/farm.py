"""The farm layout: one Redis server holds the index, signatures, thumbnails and metadata (small: what every lookup
reads), and a folder on shared storage that every worker mounts holds the trajectory blobs (checkpoints and
attention connectivity: tens of MB each at Wan size), so Redis's memory grows by kilobytes per entry, not by the
trajectory. Composes the Redis backend (redis_store.py) and a BlobFolder (blob_folder.py).

Keys beside the Redis backend's: `n:<name>` the record of blob file `<name>` (the nonce its header holds, its
entry, its bytes; " freeing" appended while it is deleted), from before the file is written until after it is
deleted; `f:<id>` the name of the entry's file (kept BLOB_GRACE_SECONDS after the entry's removal, for readers in
flight); `gc` the files released by their entry (name -> when) with `gcb` their bytes; `w` the files being written
(name -> when the write began) with `wb` their bytes. Farms made before per-write names also have `r:<name>`, the
entries sharing a legacy content-named file.

One farm, one folder: the farm's identity lives in its Redis (`store`) and in the folder's marker (`farm`). A
folder whose marker names a farm is opened only through a Redis that holds that identity: another farm's Redis, or
an empty one (another server at the same address, or this farm's Redis after it lost its data), is refused, with
nothing in the folder touched; after a data loss, `python -m carnator_engine reattach` gives the empty Redis the
folder's identity back, once, on the operator's word. Redis remembers the folder's identity
(redis_store.BLOB_FOLDER_KEY), so a worker that mounts another folder, or none, is refused, and a folder that lost
its marker while the store runs (unmounted) makes reads fail as a fault, never as damage.

What it promises, beside the backend contract (backends/__init__.py):
- every write has a file of its own (a random name, created with O_EXCL: nothing at that name is overwritten), so
  no two entries share a file and deleting a file can only ever cost the entry that released it;
- a blob file is written whole (fsynced) before the transaction that makes its entry visible, and its record is
  in Redis before it is written;
- an entry's file is released (listed in `gc`) in the same transaction that removes the entry, and a file is
  deleted only when its entry is gone and its header holds the nonce its record holds (not a file someone put in
  its place); its record is dropped only after the unlink, so a worker killed mid-delete, or a folder that refuses
  the unlink, leaves it listed and counted for the next collection. A file this Redis holds no record of (another
  farm's, one from before a data loss, anyone's) is never deleted;
- a released file stays BLOB_GRACE_SECONDS for readers in flight, unless space is short: over the size limit, or
  a write failing with a full disk, released files go at once (a reader that loses its file generates in full);
- the size limit counts the folder: entries through their sizes, and every worker reads the released files and
  the writes in flight from Redis (overhead_bytes). Those two never make a live entry leave
  (lasting_overhead_bytes is 0): they leave, or become entries, by themselves. Eviction is one transaction that
  checks the farm's total (redis_store.TOTAL_KEY), so workers evicting at once never take the total below the
  limit.
"""
from __future__ import annotations

import errno
import itertools
import logging
import uuid

from ..errors import StoreError
from ..owned_files import HEADER_BYTES
from .blob_folder import BLOB_NAME, LEGACY_NAME, BlobFolder
from .redis_store import BLOB_FOLDER_KEY, PREFIX, RELIST_KEY, RedisBackend

log = logging.getLogger("carnator.store")

BLOB_GRACE_SECONDS = 60      # a released blob stays readable this long (a hit reads it within a second)
ORPHAN_GRACE_SECONDS = 600   # a write's lease: one not committed after this long (server clock) was killed
COLLECT_BATCH = 200
GC_KEY, GC_BYTES = PREFIX + "gc", PREFIX + "gcb"
WRITES_KEY, WRITE_BYTES = PREFIX + "w", PREFIX + "wb"
LOCATION_JOIN = " + "        # a farm's location: its Redis URL (no password), this, its blob folder


# The farm's identity and folder binding set where Redis lost them (FLUSHALL), and only there: a Redis that holds
# another store now (a Redis-only one made in the emptied database) is never bound to the farm's folder.
RECLAIM_REDIS = """
local held = redis.call('get', KEYS[1])
if held and held ~= ARGV[1] then return held end
redis.call('set', KEYS[1], ARGV[1])
redis.call('set', KEYS[2], ARGV[2], 'NX')
return false
"""


def _disk_full(error: BaseException) -> bool:
    cause = error.__cause__
    return isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)


def _batches(items, size: int):
    items = iter(items)
    while True:
        batch = list(itertools.islice(items, size))
        if not batch:
            return
        yield batch


class FarmBackend:
    def __init__(self, url: str, blob_dir: str, reattach: bool = False):
        """`reattach`: an empty Redis takes the identity of the farm the folder's marker names (after that farm's
        Redis lost its data; the operator's word, never a guess from the URL)."""
        self._folder = BlobFolder(blob_dir)
        self._redis = RedisBackend(url, blob_folder=None)   # connects; the identity and binding follow
        self._client = self._redis._client
        self.blob_dir = self._folder.location
        self.location = f"{self._redis.location}{LOCATION_JOIN}{self.blob_dir}"
        self.identity = self._redis.identity = self._establish(reattach)

    def _establish(self, reattach: bool) -> str:
        """The farm's identity, its folder claimed and bound (see the module's docstring)."""
        redis, location = self._redis, self._redis.location
        identity = redis.stored_identity()
        bound = redis.bound_folder() if identity is not None else ""
        if identity is None:
            marker = self._folder.marker()
            farm = marker.get("farm") if marker else None
            if farm and not reattach and redis.stored_identity() is None:   # (set meanwhile: a worker creating it)
                raise StoreError(f"blob_dir {self.blob_dir!r} belongs to the farm {farm[:8]}... (made with Redis "
                                 f"{marker.get('redis')}), and {location} holds no Carnator store: another server, "
                                 "or that farm's Redis after it lost its data. Give each farm a folder of its own; "
                                 "after a data loss, run once: python -m carnator_engine reattach --cache URL "
                                 "--blob-dir FOLDER")
            if reattach and not farm:
                raise StoreError(f"blob_dir {self.blob_dir!r} names no farm: there is nothing to reattach")
            identity = redis.establish(farm or uuid.uuid4().hex)
            bound = redis.bound_folder()
        elif reattach:
            raise StoreError(f"Carnator cache {location!r} holds a store already: there is nothing to reattach")
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
    def _record_key(name: str) -> str:
        return f"{PREFIX}n:{name}"

    @staticmethod
    def _lease_key(name: str) -> str:
        return f"{PREFIX}wl:{name}"

    # ---- writing ---------------------------------------------------------------------------------

    def commit(self, entry_id: str, meta: bytes, parts: dict) -> None:
        """Every Redis call of the write under the Redis guard (a fault is StoreUnavailable or StoreError, never
        redis-py's own exception), the collection a full disk asks for included."""
        self._redis._guard("store an entry", lambda: self._commit(entry_id, meta, parts))

    def _commit(self, entry_id: str, meta: bytes, parts: dict) -> None:
        """The transaction that makes the entry visible, once: it refuses where the write's record is another (a
        collector is freeing it: it marks the record before deleting the file) or is gone with the file (a
        collector freed it: the file goes before the record), and where this Redis holds another store now. A
        record gone while the file still holds the write's nonce was lost by Redis (FLUSHALL): recorded again,
        with the farm's identity and binding, and committed. A
        retry after an EXEC whose reply was lost (redis-py reports a connection dropped under WATCH as a
        WatchError) finds the entry naming this write's file, a name chosen for this one write (its nonce), and
        does nothing: the farm's total is never counted twice."""
        blob = parts["blob"]
        size = len(blob) + len(parts["sig"]) + len(parts["thumb"])
        name, record = self._create(entry_id, blob)
        errors = self._redis._errors
        with self._client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self._record_key(name), self._name_key(entry_id), PREFIX + "store")
                    if pipe.get(self._name_key(entry_id)) == name.encode():
                        pipe.unwatch()
                        return                # applied already: the reply of its EXEC was lost
                    found = pipe.get(self._record_key(name))
                    lost = found is None and self._folder.holds(name, record.split()[0])
                    if found != record.encode() and not lost:
                        pipe.unwatch()   # the collector freeing it (or done) drops the record: left to it
                        raise StoreError(f"Carnator cache {self.location!r}: the blob of this entry was reclaimed "
                                         "as a killed write before its commit (the write outlived its lease of "
                                         f"{ORPHAN_GRACE_SECONDS} s, or Redis lost its data): the entry was not "
                                         "stored")
                    held = pipe.get(PREFIX + "store")
                    if held != self.identity.encode() and not (held is None and lost):
                        pipe.unwatch()   # the file is this write's own (its nonce): deleted, never stranded
                        self._folder.free(name, record.split()[0])
                        self._unregister_write(name)
                        self._refuse_other_store(held)
                    pipe.multi()
                    if lost:
                        pipe.set(self._record_key(name), record)
                        pipe.set(PREFIX + "store", self.identity, nx=True)
                        pipe.set(BLOB_FOLDER_KEY, self._folder.identity, nx=True)
                    self._redis.queue_put(pipe, entry_id, meta, {"sig": parts["sig"], "thumb": parts["thumb"]}, size)
                    pipe.set(self._name_key(entry_id), name)
                    self._queue_unlisted(pipe, name)             # written and live: neither in flight nor garbage
                    pipe.delete(self._lease_key(name))
                    pipe.execute()
                    return
                except errors.WatchError:
                    continue   # a collector looked at it meanwhile, or the reply was lost: look again

    def _create(self, entry_id: str, blob: bytes) -> tuple:
        """The blob written into a file of its own: (its name, its record). The record (the write's nonce, the
        entry, the file's bytes) is in Redis before the file exists, and stays until the file is deleted: what
        proves the file this farm's, and finds it again wherever a worker is killed."""
        self._hold_redis()
        for _ in range(3):
            name, nonce = uuid.uuid4().hex + ".blob", uuid.uuid4().hex
            record = f"{nonce} {entry_id} {HEADER_BYTES + len(blob)}"
            self._register_write(name, record, HEADER_BYTES + len(blob))
            try:
                created = self._write(name, nonce, blob)
            except StoreError:
                self._unregister_write(name)   # nothing of it stayed behind (create_new)
                raise
            if created:
                return name, record
            self._unregister_write(name)       # someone's file at that name, untouched: another name
        raise StoreError(f"Carnator blob folder {self.blob_dir!r}: three new blob names were taken by other files: "
                         "give the farm a folder of its own")

    def _hold_redis(self) -> None:
        """Before a write: the farm's identity and binding back where Redis lost its data (the first write after
        a FLUSHALL makes it this farm's again); StoreError where it holds another store now."""
        held = self._client.eval(RECLAIM_REDIS, 2, PREFIX + "store", BLOB_FOLDER_KEY, self.identity,
                                 self._folder.identity)
        if held is not None:
            self._refuse_other_store(held)

    def _refuse_other_store(self, held) -> None:
        shown = held.decode()[:8] + "..." if held else "none"
        raise StoreError(f"Carnator cache {self.location!r} holds another store now (identity {shown}, this farm's "
                         f"{self.identity[:8]}...: Redis lost its data and another store was made there): the entry "
                         "was not stored and nothing is marked corrupt; see docs/farm.md, after a data loss")

    def _register_write(self, name: str, record: str, size: int) -> None:
        """The write's record, listed in flight (dated by the server's clock) with its lease: a key that expires
        ORPHAN_GRACE_SECONDS later by the server's clock, whose absence is what marks the write killed."""
        now = self._redis.server_time()
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._record_key(name), record)
        pipe.set(self._lease_key(name), 1, ex=max(1, int(ORPHAN_GRACE_SECONDS)))
        pipe.zadd(WRITES_KEY, {name: now})
        pipe.hset(WRITE_BYTES, name, size)
        pipe.execute()

    def _unregister_write(self, name: str) -> None:
        """A write that left no file forgotten (Redis unreachable: left registered, and its collection finds
        nothing to delete)."""
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._record_key(name), self._lease_key(name))
            self._queue_unlisted(pipe, name)
            pipe.execute()
        except self._redis._errors.RedisError:
            pass

    def _write(self, name: str, nonce: str, blob: bytes) -> bool:
        """The blob's file (False: the name is taken); on a full disk, the released files are deleted at once
        (their grace period is a courtesy to readers, not worth a lost write) and the write tried once more."""
        try:
            return self._folder.create(name, nonce, blob)
        except StoreError as error:
            if not _disk_full(error):
                raise
            self._collect(due=float("inf"))
            return self._folder.create(name, nonce, blob)

    @staticmethod
    def _queue_unlisted(pipe, name: str) -> None:
        pipe.zrem(WRITES_KEY, name)
        pipe.hdel(WRITE_BYTES, name)
        pipe.zrem(GC_KEY, name)
        pipe.hdel(GC_BYTES, name)

    def update(self, entry_id: str, change) -> bool:
        return self._redis.update(entry_id, change)

    # The entry's blob file, as RedisBackend's removals ask of it (watch_keys, read, queue_release): released in
    # the very transaction that removes the entry, so no crash leaves a file that nothing lists.

    def watch_keys(self, entry_id: str) -> list:
        return [self._name_key(entry_id)]

    def read(self, pipe, entry_id: str):
        """(the entry's blob name, its bytes) or None, read under the removal's WATCH."""
        name = pipe.get(self._name_key(entry_id))
        if name is None:
            return None
        name = name.decode()
        record = pipe.get(self._record_key(name)) if BLOB_NAME.fullmatch(name) else None
        return name, int(record.split()[2]) if record is not None else self._folder.size(name)

    def queue_release(self, pipe, entry_id: str, held) -> None:
        if held is None:
            return
        name, size = held
        # The name outlives the entry by the grace period: a worker that read the metadata just before reads the
        # file it names, still on disk until then.
        pipe.expire(self._name_key(entry_id), max(1, int(BLOB_GRACE_SECONDS)))
        if LEGACY_NAME.fullmatch(name):
            pipe.srem(self._refs_key(name), entry_id)   # a shared legacy file: released by its last reference
            return
        pipe.zadd(GC_KEY, {name: self._redis.server_time()}, nx=True)
        pipe.hset(GC_BYTES, name, size)

    def released_legacy(self, helds) -> None:
        """After a removal: the legacy files among `helds` whose last reference went, scheduled for collection."""
        legacy = sorted({held[0] for held in helds if held is not None and LEGACY_NAME.fullmatch(held[0])})
        if not legacy:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for name in legacy:
                pipe.scard(self._refs_key(name))
            unreferenced = [name for name, left in zip(legacy, pipe.execute()) if left == 0]
            if unreferenced:
                pipe = self._client.pipeline(transaction=True)
                now = self._redis.server_time()
                pipe.zadd(GC_KEY, {name: now for name in unreferenced}, nx=True)
                pipe.hset(GC_BYTES, mapping={name: self._folder.size(name) for name in unreferenced})
                pipe.execute()
        except self._redis._errors.RedisError:
            pass

    def remove(self, entry_id: str) -> bool:
        outcome, _ = self._redis.remove_entry(entry_id, blobs=self)
        self.collect()
        return outcome == "evicted"

    def evict(self, entry_id: str, budget: int) -> tuple:
        return self._redis.remove_entry(entry_id, budget=budget, blobs=self)

    def total_bytes(self):
        return self._redis.total_bytes()

    def clear(self) -> None:
        """The entries listed now, and only those (an entry committed meanwhile stays whole and listed), each
        file released with its entry."""
        self._redis.clear(blobs=self)

    # ---- garbage collection ----------------------------------------------------------------------

    def _free(self, name: str) -> int:
        """Deletes blob file `name` unless its entry is live; returns the bytes freed. Its record is marked first
        (a writer still committing it fails on its WATCH), and dropped only once the file is gone: a worker killed
        meanwhile, or an unlink that fails (a read-only folder), leaves the file listed and counted, for the next
        collection. A file whose header does not hold the recorded nonce (someone's, put in its place) is left
        alone and forgotten; a file without a record is never deleted."""
        if LEGACY_NAME.fullmatch(name):
            return self._free_legacy(name)
        errors, key = self._redis._errors, self._record_key(name)
        with self._client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                record = pipe.get(key)
                fields = record.decode().split() if record is not None else []
                live = len(fields) >= 3 and pipe.get(self._name_key(fields[1])) == name.encode() \
                    and pipe.exists(self._redis._key("meta", fields[1]))
                pipe.multi()
                if len(fields) < 3 or live:
                    self._queue_unlisted(pipe, name)   # nothing proves it ours, or it is an entry's: not garbage
                elif len(fields) == 3:
                    pipe.set(key, record + b" freeing")
                pipe.execute()
            except errors.WatchError:
                return 0
        if len(fields) < 3 or live:
            return 0
        freed = self._folder.free(name, fields[0])   # StoreError: the records stay, so does the count
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        self._queue_unlisted(pipe, name)
        pipe.execute()
        return freed or 0

    def _free_legacy(self, name: str) -> int:
        """A legacy (shared, content-named) file: deleted when no entry refers to it and its content proves it
        this farm's (blob_folder.free_legacy). No writer writes a legacy name any more, so none can race it."""
        if self._client.scard(self._refs_key(name)):
            freed = 0
        else:
            freed = self._folder.free_legacy(name)
            if freed == 0 and self._folder.size(name):
                return 0   # still there (not removable now): stays listed
        pipe = self._client.pipeline(transaction=True)
        self._queue_unlisted(pipe, name)
        pipe.execute()
        return freed

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
                tried.add(name)   # one attempt each (one that fails now stays listed for the next collection)
                try:
                    size = self._free(name)
                except StoreError:
                    size = 0
                count, freed = count + bool(size), freed + size
                if freed >= need:
                    break
        return count, freed

    def collect(self) -> tuple:
        """Deletes the released blobs whose grace period is over; (count, bytes). Best effort: a failure leaves them
        for the next call."""
        try:
            return self._collect(due=self._redis.server_time() - BLOB_GRACE_SECONDS)
        except (self._redis._errors.RedisError, StoreError):
            return 0, 0

    def reclaim_orphans(self) -> tuple:
        """At open: the released blobs past their grace period, then the files of writes registered longer than
        ORPHAN_GRACE_SECONDS ago and never committed (a worker killed between its write and its commit), and,
        after a removal that could not list its file (Redis over maxmemory), every record nothing lists."""
        return self._redis._guard("reclaim orphan blobs", self._reclaim)

    def _reclaim(self) -> tuple:
        self._relist_records()
        count, freed = self.collect()
        now = self._redis.server_time()
        writes = [n.decode() for n in self._client.zrange(WRITES_KEY, 0, -1)]
        pipe = self._client.pipeline(transaction=False)
        for name in writes:
            pipe.exists(self._lease_key(name))
        for name, alive in zip(writes, pipe.execute()):
            if alive:
                continue   # its writer's lease runs (by the server's clock, whatever the workers' clocks say)
            legacy = LEGACY_NAME.fullmatch(name)
            leftovers = self._folder.temporaries(name, older_than=now - ORPHAN_GRACE_SECONDS) if legacy else []
            gone = self._free(name) + sum(self._folder.free_legacy(t) for t in leftovers)
            count, freed = count + bool(gone), freed + gone
        return count, freed

    def _relist_records(self) -> None:
        """Once after a removal fell back to commands one by one (over maxmemory, RELIST_KEY deleted): every
        file record that is neither an entry's nor listed as released or in flight is listed as released."""
        if self._client.exists(RELIST_KEY):
            return
        for keys in _batches(self._client.scan_iter(match=self._record_key("*"), count=1000), 500):
            names = [k.decode()[len(self._record_key("")):] for k in keys]
            pipe = self._client.pipeline(transaction=False)
            for name in names:
                pipe.get(self._record_key(name))
                pipe.zscore(GC_KEY, name)
                pipe.zscore(WRITES_KEY, name)
            replies = pipe.execute()
            for name, (record, released, writing) in zip(names, zip(*[iter(replies)] * 3)):
                if record is None or released is not None or writing is not None:
                    continue
                entry, size = record.decode().split()[1:3]
                if self._client.get(self._name_key(entry)) == name.encode() and \
                        self._client.exists(self._redis._key("meta", entry)):
                    continue
                pipe = self._client.pipeline(transaction=True)
                pipe.zadd(GC_KEY, {name: self._redis.server_time()}, nx=True)
                pipe.hset(GC_BYTES, name, int(size))
                pipe.execute()
        self._client.set(RELIST_KEY, 1)

    # ---- reading ---------------------------------------------------------------------------------

    def meta(self, entry_id: str):
        return self._redis.meta(entry_id)

    def part(self, entry_id: str, kind: str, limit=None):
        return self.parts([entry_id], kind, limit)[0]

    def parts(self, entry_ids: list, kind: str, limit=None) -> list:
        if kind != "blob":
            return self._redis.parts(entry_ids, kind)
        if not entry_ids:
            return []
        names = self._redis._guard("read entries",
                                   lambda: self._client.mget([self._name_key(e) for e in entry_ids]))
        return [self._folder.read(name.decode(), limit) if name is not None else None for name in names]

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

    def recorded_size_limit(self):
        return self._redis.recorded_size_limit()

    def record_size_limit(self, size_limit_bytes: int) -> None:
        self._redis.record_size_limit(size_limit_bytes)

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

    def eviction_step(self):
        return self._redis.eviction_step()

    def close(self) -> None:
        self._redis.close()
