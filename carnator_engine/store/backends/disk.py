"""The embedded backend (the default, no server): diskcache's SQLite for metadata, signatures, thumbnails and the
change log, one file per trajectory blob.

Blobs are not diskcache values: diskcache deletes a value's file before the enclosing transaction commits, so a
crash during a delete tore an entry that was still committed. Here a blob is written to a temporary file, fsynced
and renamed into place before the transaction that makes its metadata visible; a delete commits the metadata's
removal first and unlinks the file after. A crash in between leaves an orphan file, reclaimed at the next open.
Keys are text: "m:<id>" metadata, "s:<id>" signature, "t:<id>" thumbnail, "l:<n>" change log, "seq" its head,
"store" the store's identity. The index snapshot is the file index.snapshot, written like a blob.
The folder is opened only as a marked Carnator store (marker.py), and only files under the names this module
writes are ever removed from it, and only when their header proves them this store's: a blob's header holds a
nonce recorded in cache.db ("k:<id>") before the blob was written, the index snapshot's a secret kept in cache.db
("secret"), neither of which the folder shows (a header copied from the marker proves nothing). A blob is created
with O_EXCL: a file someone put at a new entry's name is never overwritten, and one put in place of an entry's
blob is never deleted. Blobs written before the nonces carry the marker's identity instead: those are deleted with
their entry, never as orphans.
"""
from __future__ import annotations

import errno
import itertools
import os
import re
import shutil
import sqlite3
import uuid

import diskcache

from ..errors import StoreError, StoreUnavailable
from ..marker import (EMPTY, MARKER_FILE, NO_DATABASE, NO_RECORD, NOT_SQLITE, check_location, claim,
                      database_identity, marker_temporary, refuse_farm_folder)
from .. import index_snapshot
from ..owned_files import (HEADER_BYTES, LockFile, create_new, owner, read_part, read_regular, remove_own,
                           write_whole)

LOG_KEEP = 100_000          # change-log records kept; a reader further behind rebuilds its index
DB_FILES = ("cache.db", "cache.db-wal", "cache.db-shm")
SNAPSHOT_FILE = "index.snapshot"
# Locks the processes on one folder share (owned_files.LockFile): every write holds WRITING_LOCK shared from its
# blob's file to its commit, so the orphan sweep, which holds it exclusive, knows no write is in flight in any
# process (liveness, not a file's date: a file server's clock may be hours off); one eviction step at a time holds
# EVICTING_LOCK, so processes evicting at once each decide on the others' evictions.
WRITING_LOCK, EVICTING_LOCK = "writing.lock", "evicting.lock"
# Space kept back for the disk's worst day: on a full disk SQLite cannot even open (WAL mode needs its -shm and
# -wal files) nor commit a delete, so the store could never free space itself. Released to open or delete when
# the disk is full, written again once a delete has freed space.
RESERVE_FILE = "space.reserve"
RESERVE_BYTES = 256 << 10
# The only names Carnator writes (and so the only ones it deletes): an entry's blob, a write's temporary file.
ENTRY_ID = re.compile(r"[0-9a-f]{16}")
BLOB_NAME = re.compile(r"([0-9a-f]{16})\.blob")
TEMPORARY = r"\.[0-9a-f]{8}\.tmp"     # what write_whole appends to a final name while it writes
ROOT_TEMPORARY = re.compile(f"({re.escape(SNAPSHOT_FILE)}|{re.escape(RESERVE_FILE)})" + TEMPORARY)
SCAN_BATCH = 1000           # metadata rows held at once while listing (a rebuild's memory stays small)


def _disk_full(error: BaseException, directory: str) -> bool:
    """Whether `error` means no room (SQLite says "disk I/O error" when its -shm cannot grow on a full disk)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    try:
        room = shutil.disk_usage(directory).free
    except OSError:
        return False
    return "full" in str(error).lower() or room < RESERVE_BYTES


def _advice(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "the disk is full: free space or lower the size limit"
    if isinstance(error, OSError) and error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "it is not writable: fix its permissions or choose another cache path"
    text = str(error).lower()
    if "readonly" in text or "read-only" in text:
        return "it is read-only: fix its permissions or choose another cache path"
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return "cache.db is damaged: move the directory away (or delete it) to start an empty cache"
    if "full" in text:
        return "the disk is full: free space or lower the size limit"
    return "check the disk, or choose another cache path"


def _refuse_foreign(directory: str, identity: str) -> None:
    """StoreError, with nothing in the folder touched, unless the records beside the marker (which anyone can copy)
    are the store's own: cache.db holding the identity the marker names (or, a creation interrupted before its
    first key, nothing at all), or no cache.db in a folder holding nothing else yet (a new store)."""
    found = database_identity(directory)
    if found in (identity, EMPTY):
        return
    if found == NO_DATABASE:
        blobs = os.path.join(directory, "blobs")
        others = sorted(name for name in os.listdir(directory) if name != MARKER_FILE and not marker_temporary(name)
                        and not (name == "blobs" and os.path.isdir(blobs) and not os.listdir(blobs)))
        if others:
            raise StoreError(f"Carnator cache {directory!r} holds a Carnator marker but not the store's records (no "
                             f"cache.db), beside files Carnator did not make there ({', '.join(others[:5])}"
                             f"{', ...' if len(others) > 5 else ''}): a marker copied from elsewhere? Move them away "
                             "or choose another folder; nothing in it was touched")
        return
    if found == NOT_SQLITE:
        raise StoreError(f"Carnator cache {directory!r}: cache.db is damaged: move the directory away to start an "
                         "empty cache (it is no SQLite database: damaged, or another program's file; nothing in it "
                         "was touched)")
    if found == NO_RECORD:
        raise StoreError(f"Carnator cache {directory!r}: cache.db is not this store's (an SQLite database holding "
                         f"no record of store {identity[:8]}..., the one its marker {MARKER_FILE} names: another "
                         "program's, or a marker copied in from elsewhere): move one of them away; nothing in it "
                         "was touched")
    raise StoreError(f"Carnator cache {directory!r}: cache.db belongs to another store than its marker {MARKER_FILE} "
                     "(copied in from elsewhere?): move one of them away; nothing in it was touched")


class DiskBackend:
    def __init__(self, directory: str):
        directory = check_location(directory)
        refuse_farm_folder(directory)
        self.location = directory
        self._sweep_waits = False   # the last orphan sweep found a write in flight: the next compact sweeps again
        self.blob_dir = os.path.join(directory, "blobs")
        database = os.path.join(directory, "cache.db")
        if os.path.isfile(database) and os.path.getsize(database) == 0:
            # SQLite would open a zero-length file as a new empty database and every entry would be silently lost.
            raise StoreError(f"Carnator cache {directory!r}: cache.db is empty (zero bytes; truncated?), so the "
                             "entries it listed are lost: delete the directory to start an empty cache")
        if os.path.exists(database) and not os.path.isfile(database):
            raise StoreError(f"Carnator cache {directory!r}: cache.db is not a file: move it away or choose "
                             "another cache path")
        # Writing the marker is a new store's write test; an existing one opens without writing (on a full disk its
        # lookups still work, and deletes free space).
        marked = self._owner = claim(directory)
        _refuse_foreign(directory, marked)
        try:
            os.makedirs(self.blob_dir, exist_ok=True)
            self._writing, self._evicting = (LockFile(os.path.join(directory, name), marked)
                                             for name in (WRITING_LOCK, EVICTING_LOCK))
        except OSError as error:
            if error.errno == errno.EINVAL:
                raise StoreError(f"Carnator cache {directory!r}: {error.filename} is not this store's lock file "
                                 "(something else is at its name, left alone): move it away") from error
            raise StoreError(f"Carnator cache directory {directory!r} is not writable "
                             f"({error.strerror or error}): choose another cache path") from error
        # Everything but blobs stays inside SQLite (atomic with its transaction): no diskcache value files.
        def open_database():
            cache = diskcache.Cache(
                directory, size_limit=1 << 62, eviction_policy="none", disk_min_file_size=1 << 30,
                # A WAL that is checkpointed often and truncated after each checkpoint keeps SQLite's share of the
                # size limit small (its default grows to 4 MB and stays).
                sqlite_wal_autocheckpoint=256, sqlite_journal_size_limit=1 << 20)
            cache.get("seq")    # a damaged database fails here, not mid-request
            return cache
        self._cache = self._guard("open", lambda: self._with_room(open_database))
        # The identity first: a creation interrupted after it leaves a database _refuse_foreign proves this store's.
        self.identity = self._guard("open", lambda: self._cache.get("store"))
        if self.identity is None:
            self._guard("open", lambda: self._cache.add("store", marked))
            self.identity = self._guard("open", lambda: self._cache.get("store"))
        if self.identity != marked:
            raise StoreError(f"Carnator cache {directory!r}: cache.db belongs to another store than its marker "
                             f"{MARKER_FILE} (copied in from elsewhere?): move one of them away")
        self._secret = self._guard("open", lambda: self._cache.get("secret"))
        if self._secret is None:
            try:
                self._cache.add("secret", uuid.uuid4().hex)
                self._secret = self._cache.get("secret")
            except (OSError, sqlite3.Error, diskcache.Timeout):
                pass   # a full disk: no snapshot is written until there is room
        self._keep_reserve()

    def recorded_size_limit(self):
        """The size limit the store was last opened with (bytes), None before one was recorded."""
        value = self._guard("open", lambda: self._cache.get("size_limit"))
        return value if isinstance(value, int) else None

    def record_size_limit(self, size_limit_bytes: int) -> None:
        self._guard("record the size limit", lambda: self._cache.set("size_limit", int(size_limit_bytes)))

    def _with_room(self, work):
        """work(), retried once with the reserve released when the disk is full."""
        try:
            return work()
        except (OSError, sqlite3.Error) as error:
            if not _disk_full(error, self.location):
                raise
            if not remove_own(os.path.join(self.location, RESERVE_FILE), self._owner):
                raise error from None   # no reserve, or someone's file under its name
            return work()

    def _keep_reserve(self) -> None:
        """Best effort: the reserve written back where it is missing (nothing lost if the disk has no room)."""
        try:
            create_new(os.path.join(self.location, RESERVE_FILE), bytes(RESERVE_BYTES), self._owner)
        except OSError:
            pass   # there already (or someone's file at its name), or no room

    def _guard(self, action: str, work):
        try:
            return work()
        except StoreError:
            raise
        except (OSError, sqlite3.Error, diskcache.Timeout) as error:
            raise StoreError(f"Carnator cache {self.location!r} could not {action} ({error}): "
                             f"{_advice(error)}") from error

    def _blob_path(self, entry_id: str) -> str:
        if not isinstance(entry_id, str) or not ENTRY_ID.fullmatch(entry_id):
            raise StoreError(f"Carnator cache {self.location!r}: {str(entry_id)[:40]!r} is not an entry id (16 "
                             "lowercase hex digits)")
        return os.path.join(self.blob_dir, entry_id + ".blob")

    # ---- writing ---------------------------------------------------------------------------------

    def _log(self, op: str, entry_id: str) -> None:
        """Inside a transaction: one change-log record."""
        seq = self._cache.incr("seq", default=0)
        self._cache.set(f"l:{seq}", f"{op} {entry_id}")
        self._cache.delete(f"l:{seq - LOG_KEEP}")

    def _write_blob(self, entry_id: str, blob: bytes) -> str:
        """The blob in a new file, its nonce recorded first (a crash after that leaves a file the orphan sweep can
        prove its own); the nonce."""
        path, nonce = self._blob_path(entry_id), uuid.uuid4().hex
        self._cache.set(f"k:{entry_id}", nonce)
        try:
            create_new(path, blob, nonce)
        except FileExistsError:
            self._cache.delete(f"k:{entry_id}")
            raise StoreError(f"Carnator cache {self.location!r}: {path} is taken by a file this store did not write "
                             "(left alone): move it away; the entry was not stored") from None
        except BaseException:
            self._cache.delete(f"k:{entry_id}")
            raise
        return nonce

    def commit(self, entry_id: str, meta: bytes, parts: dict) -> None:
        """The blob's file, then the transaction that makes the entry visible, all under WRITING_LOCK held shared:
        no orphan sweep (in any process) runs between the two. The transaction refuses where the write's nonce is
        no longer the one recorded (its file was reclaimed after all): never an entry whose blob is missing."""
        def work():
            nonce = self._write_blob(entry_id, parts["blob"])
            try:
                with self._cache.transact():
                    if self._cache.get(f"k:{entry_id}") != nonce:
                        raise StoreError(f"Carnator cache {self.location!r}: the blob of entry {entry_id} was "
                                         "reclaimed as an orphan before its commit (another process swept the "
                                         "folder): the entry was not stored")
                    self._cache.set(f"s:{entry_id}", parts["sig"])
                    self._cache.set(f"t:{entry_id}", parts["thumb"])
                    self._cache.set(f"m:{entry_id}", meta)
                    self._log("put", entry_id)
            except BaseException:
                self._unlink(entry_id, held=False)
                raise

        def held():
            with self._writing.held(exclusive=False):
                work()
        self._guard("store an entry", held)

    def update(self, entry_id: str, change) -> bool:
        def work():
            with self._cache.transact():
                meta = self._cache.get(f"m:{entry_id}")
                if meta is None:
                    return False
                self._cache.set(f"m:{entry_id}", change(meta))
                self._log("meta", entry_id)
                return True
        return self._guard("update an entry", work)

    def remove(self, entry_id: str) -> bool:
        def work():
            with self._cache.transact():
                existed = self._cache.delete(f"m:{entry_id}")
                self._cache.delete(f"s:{entry_id}")
                self._cache.delete(f"t:{entry_id}")
                if existed:
                    self._log("del", entry_id)
            if existed:   # an id that is no entry names no file of the store's: nothing is touched
                self._unlink(entry_id)  # after the commit: a crash here leaves an orphan, not a torn entry
            return bool(existed)
        existed = self._guard("delete an entry", lambda: self._with_room(work))
        self._keep_reserve()
        return existed

    def evict(self, entry_id: str, budget: int) -> tuple:
        """One process's store: the caller's index decides (`budget` unused)."""
        return ("evicted" if self.remove(entry_id) else "gone"), None

    def _unlink(self, entry_id: str, held: bool = True) -> None:
        """Removes an entry's blob file when its header proves it the one this store wrote there (its recorded
        nonce; a blob from before the nonces: the marker's identity, taken as proof only where `held`, the entry
        having been the store's until now), then the record. Anything else at its name (a file or folder someone
        put there) is left alone; an unlink that fails keeps the record, for the orphan sweep to try again."""
        if not isinstance(entry_id, str) or not ENTRY_ID.fullmatch(entry_id):
            return
        path, nonce = self._blob_path(entry_id), self._cache.get(f"k:{entry_id}")
        try:
            if nonce is None and not held:
                return
            remove_own(path, nonce if nonce is not None else self._owner)
        except OSError:
            return
        if nonce is not None:
            self._cache.delete(f"k:{entry_id}")

    def clear(self) -> None:
        def work():
            ids = self._meta_ids()
            with self._cache.transact():
                for entry_id in ids:
                    for kind in "mst":
                        self._cache.delete(f"{kind}:{entry_id}")
                self._log("clear", "-")
            for entry_id in ids:
                self._unlink(entry_id)
        self._guard("clear the cache", lambda: self._with_room(work))
        self._keep_reserve()

    # ---- reading ---------------------------------------------------------------------------------

    def meta(self, entry_id: str):
        return self._guard("read an entry", lambda: self._cache.get(f"m:{entry_id}"))

    def part(self, entry_id: str, kind: str, limit=None):
        return self.parts([entry_id], kind, limit)[0]

    def parts(self, entry_ids: list, kind: str, limit=None) -> list:
        """One part of each of several entries (bytes or None each). Key by key: on a store of 100k entries one
        SQL query for a lookup's 32 signatures measured no faster than 32 reads through diskcache (~2 ms warm)."""
        if kind != "blob":
            return self._guard("read an entry", lambda: [self._cache.get(f"{kind[0]}:{e}") for e in entry_ids])
        return [self._blob(entry_id, limit) for entry_id in entry_ids]

    def _blob(self, entry_id: str, limit):
        """None where it is missing (the store marks the entry corrupt when its metadata still lists it)."""
        try:
            return read_part(self._blob_path(entry_id), limit)
        except OSError as error:
            raise StoreError(f"Carnator cache {self.location!r} could not read a blob ({error}): "
                             f"{_advice(error)}") from error

    def _scan(self, columns: str):
        """diskcache's rows of the metadata keys, SCAN_BATCH at a time, through a read-only connection of its own:
        one SQL scan where the table's layout is the one this was written for (diskcache 5: raw text keys, raw
        bytes values inline). A per-key read costs ~0.1 ms: 10 s at 100k entries, against ~1 s for the scan.
        sqlite3.Error at the first batch where the layout is another."""
        connection = sqlite3.connect(f"file:{os.path.join(self.location, 'cache.db')}?mode=ro", uri=True,
                                     timeout=30)
        try:
            rows = connection.execute(f"SELECT {columns} FROM Cache WHERE raw = 1 AND key >= 'm:' AND key < 'm;'")
            while True:
                batch = rows.fetchmany(SCAN_BATCH)
                if not batch:
                    return
                yield batch
        finally:
            connection.close()

    def _guarded(self, action: str, items):
        """`items`, each step of it under _guard (a generator's failures surface while it is consumed)."""
        while True:
            batch = self._guard(action, lambda: next(items, None))
            if batch is None:
                return
            yield from batch

    def _meta_keys_one_by_one(self):
        for key in self._cache.iterkeys():
            if isinstance(key, str) and key.startswith("m:"):
                yield key

    def metas(self):
        """Every (id, metadata bytes or None), streamed."""
        def batches():
            scan = self._scan("key, mode, filename, value")
            try:
                first = next(scan, [])
            except sqlite3.Error:
                for key in self._meta_keys_one_by_one():
                    try:
                        yield [(key[2:], self._cache.get(key))]
                    except Exception:  # noqa: BLE001 - one unreadable value must not hide the others
                        yield [(key[2:], None)]
                return
            for batch in itertools.chain([first], scan):
                yield [(key[2:], value if mode == diskcache.core.MODE_RAW and filename is None else
                        self._cache.get(key)) for key, mode, filename, value in batch]
        return self._guarded("list its entries", batches())

    def _meta_ids(self) -> set:
        try:
            return {key[2:] for batch in self._scan("key") for (key,) in batch}
        except sqlite3.Error:
            return {key[2:] for key in self._meta_keys_one_by_one()}

    def cursor(self) -> int:
        return int(self._guard("read its change log", lambda: self._cache.get("seq", 0)))

    def changes(self, cursor: int):
        def work():
            head = int(self._cache.get("seq", 0))
            if head == cursor:
                return cursor, []
            if head - cursor > LOG_KEEP or head < cursor:
                return head, None
            found = []
            for seq in range(cursor + 1, head + 1):
                record = self._cache.get(f"l:{seq}")
                if record is None:
                    return head, None
                op, entry_id = record.split(" ", 1)
                found.append((op, entry_id))
            return head, found
        return self._guard("read its change log", work)

    # ---- space -----------------------------------------------------------------------------------

    def overhead_bytes(self) -> int:
        """SQLite's own files (metadata, signatures, thumbnails, log and free pages) and the index snapshot: the
        limit counts them."""
        total = 0
        for name in DB_FILES + (SNAPSHOT_FILE, RESERVE_FILE):
            try:
                total += os.path.getsize(os.path.join(self.location, name))
            except OSError:
                pass
        return total

    def lasting_overhead_bytes(self) -> int:
        return self.overhead_bytes()

    def check_present(self) -> None:
        """StoreUnavailable when the folder lost its marker (a drive unmounted under a running store): a blob
        missing then is the folder's absence, not damage."""
        if not os.path.isfile(os.path.join(self.location, MARKER_FILE)):
            raise StoreUnavailable(f"Carnator cache {self.location!r} has lost its marker {MARKER_FILE} (is its "
                                   "drive mounted?): requests are generated in full until it is back")

    def compact(self, excess: int = 0) -> None:
        """What frees space without evicting, when the store is over its limit: orphans reclaimed where the last
        sweep had to wait for a write in flight, the WAL moved into cache.db and truncated."""
        if self._sweep_waits:
            self.reclaim_orphans()
        def work():
            connection = sqlite3.connect(os.path.join(self.location, "cache.db"), timeout=10)
            try:
                connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                connection.close()
        self._guard("compact cache.db", work)

    def reclaim_orphans(self) -> tuple:
        """Blob files no metadata refers to (a crash between a blob's write and its commit, or between a delete's
        commit and its unlink), and temporary files of interrupted snapshot writes, whatever their dates: swept
        only while WRITING_LOCK is held exclusive, so no write is in flight in any process; where one is, the sweep
        waits for the next compact. Only regular files under Carnator's own names whose header holds what cache.db
        recorded for them (a blob's nonce, the snapshot's secret) are ever removed: anything else is left alone,
        whatever its name, age or header. Which ids have metadata is one scan of the keys (0.15 s at 100k
        entries), not a read per blob (2.5 s at every open, page cache warm)."""
        with self._writing.held_if_free() as alone:
            self._sweep_waits = not alone
            return self._sweep() if alone else (0, 0)

    def _sweep(self) -> tuple:
        live = self._guard("list its entries", self._meta_ids)
        found = []   # (file, the id of the entry it is the blob of, or None for a temporary file)
        for item in os.scandir(self.blob_dir):
            blob = BLOB_NAME.fullmatch(item.name)
            if blob and blob.group(1) not in live:
                found.append((item, blob.group(1)))
        found += [(item, None) for item in os.scandir(self.location) if ROOT_TEMPORARY.fullmatch(item.name)]
        count = freed = 0
        for item, entry_id in found:
            try:
                secret = self._secret if entry_id is None else self._cache.get(f"k:{entry_id}")
                if secret is None or owner(item.path) != secret:
                    continue   # a name is no proof, nor a header anyone could copy: only the recorded secret
                size = remove_own(item.path, secret)
                if not size:
                    continue
                if entry_id is not None:
                    self._cache.delete(f"k:{entry_id}")
            except (OSError, StoreError, sqlite3.Error, diskcache.Timeout):
                continue
            count, freed = count + 1, freed + size
        return count, freed

    # ---- the index snapshot ----------------------------------------------------------------------

    def load_snapshot(self):
        def work():
            return read_part(os.path.join(self.location, SNAPSHOT_FILE))
        return self._guard("read its index snapshot", work)

    def save_snapshot(self, data: bytes) -> None:
        """Replaces the snapshot only where what is there is this store's (its secret in the header; from before
        the secret: the marker's identity, then a snapshot) or nothing: never a file someone put at its name."""
        path = os.path.join(self.location, SNAPSHOT_FILE)
        if self._secret is None:
            raise StoreError(f"Carnator cache {self.location!r} could not write its index snapshot: no room yet")
        if os.path.lexists(path) and owner(path) != self._secret and not self._legacy_snapshot(path):
            raise StoreError(f"Carnator cache {self.location!r}: {path} is not this store's snapshot (left alone): "
                             "move it away")
        def work():
            with self._writing.held(exclusive=False):   # its temporary file is no orphan while it is written
                write_whole(path, data, self._secret)
        self._guard("write its index snapshot", work)

    def _legacy_snapshot(self, path: str) -> bool:
        try:
            start = read_regular(path, HEADER_BYTES + len(index_snapshot.MAGIC))
        except OSError:
            return False   # a FIFO or a link there is no snapshot of this store's, and is never waited on
        return owner(path) == self._owner and start[HEADER_BYTES:] == index_snapshot.MAGIC

    def eviction_step(self):
        """The lock one eviction step holds (CarnatorStore.enforce_size_limit): the processes on this folder
        evict one at a time, each from an index that has taken in the others' evictions."""
        return self._evicting.held()

    def close(self) -> None:
        self._cache.close()
        self._writing.close()
        self._evicting.close()
