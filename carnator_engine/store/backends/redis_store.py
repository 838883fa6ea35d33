"""The shared backend: one Redis server holds every part of every entry, for many ComfyUI workers.

Keys (prefix `carnator:`): `m:<id>` metadata, `s:<id>` signature, `b:<id>` trajectory blob, `t:<id>` thumbnail, the
set `ids`, the stream `log` (the change log every worker's in-memory index follows), `store` the store's identity
and `snapshot` the index snapshot every worker opens from. An entry is written,
updated and removed in one MULTI/EXEC transaction, so no client ever sees part of one, whatever happens to the
writer; with `appendonly yes` a committed entry survives a restart of the server. Blobs live in Redis too,
not in a shared directory: `benchmarks/store.py scale` measured both for a Wan-1.3B-sized entry (RESULTS.md,
"Store at scale"), and one server with atomic transactions is simpler to run than a server plus a shared
filesystem, at the price of keeping trajectories in the server's memory.

The password comes from the URL (`redis://:PASSWORD@host:port/db`) or, when the URL has none, from the
CARNATOR_REDIS_PASSWORD environment variable. It is never part of `location` or of any message: every error
text is scrubbed of it.
"""
from __future__ import annotations

import contextlib
import os
import urllib.parse
import uuid

from ..errors import StoreError, StoreUnavailable

PASSWORD_VARIABLE = "CARNATOR_REDIS_PASSWORD"
PREFIX = "carnator:"
LOG_KEEP = 100_000
BATCH = 500
TIMEOUT_SECONDS = 60   # a Wan-sized blob is tens of MB


def split_url(url: str) -> tuple:
    """(URL for the client without its password, the password or None, the URL as shown). Read by hand, not with
    urllib: a password often holds '/', '#' or '?' unencoded, which a URL parser takes for the path, fragment or
    query (and then fails, or shows the password as a path). The user information ends at the last '@'."""
    scheme, _, rest = url.strip().partition("://")
    userinfo, at, address = rest.rpartition("@")
    user, colon, password = userinfo.partition(":") if at else ("", "", "")
    client = f"{scheme}://{user + '@' if user else ''}{address}"
    shown = f"{scheme}://{user + '@' if user else ''}{address.partition('?')[0].partition('#')[0]}"
    return client, urllib.parse.unquote(password) if colon and password else None, shown


def shown_url(url: str) -> str:
    """The URL without its password (user name, host, port and database kept)."""
    return split_url(url)[2]


def _stream_id(text) -> tuple:
    if isinstance(text, bytes):
        text = text.decode()
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


BLOB_FOLDER_KEY = PREFIX + "blob_folder"   # the farm layout's (farm.py): the identity of the store's blob folder
SIZES_KEY = PREFIX + "sz"      # entry id -> its bytes, set and deleted with the entry
TOTAL_KEY = PREFIX + "bytes"   # the sum of SIZES_KEY, kept in the same transactions: what eviction checks
RELIST_KEY = PREFIX + "listed"   # deleted by a removal that fell back to single commands (farm.py relists)
# TOTAL_KEY changed only where it exists (a store from before it, or one whose total was dropped, is recounted).
ADJUST = "if redis.call('exists', KEYS[1]) == 1 then return redis.call('incrby', KEYS[1], ARGV[1]) end return 0"
# The total recounted from the sizes, in one atomic step; entries from before SIZES_KEY get theirs from their
# metadata (its JSON object: the checksummed format prefixes it with a line).
RECOUNT = """
local listed = {}
for _, id in ipairs(redis.call('smembers', KEYS[1])) do
  listed[id] = true
  if redis.call('hexists', KEYS[2], id) == 0 then
    local meta = redis.call('get', ARGV[1] .. id)
    if meta then
      local start = string.find(meta, '{', 1, true) or 1
      local ok, value = pcall(cjson.decode, string.sub(meta, start))
      local size = ok and type(value) == 'table' and tonumber(value['size_bytes']) or 0
      redis.call('hset', KEYS[2], id, size)
    end
  end
end
local total = 0
local sizes = redis.call('hgetall', KEYS[2])
for i = 1, #sizes, 2 do
  if listed[sizes[i]] then total = total + tonumber(sizes[i + 1]) else redis.call('hdel', KEYS[2], sizes[i]) end
end
redis.call('set', KEYS[3], total)
return total
"""


class RedisBackend:
    """farm.py composes this backend: its connection, its error translation and its queue_* transaction parts."""

    def __init__(self, url: str, blob_folder=""):
        """`blob_folder` None: connect only (farm.py establishes the store's identity and binding itself)."""
        try:
            import redis
        except ImportError:
            raise StoreError("a redis:// cache needs the redis package: pip install -r requirements-redis.txt "
                             "(or pip install 'comfyui-carnator[redis]')") from None
        self._errors = redis.exceptions
        client_url, given, self.location = split_url(url)
        self._password = given or os.environ.get(PASSWORD_VARIABLE) or None
        try:
            self._client = redis.Redis.from_url(client_url, password=self._password, socket_timeout=TIMEOUT_SECONDS,
                                                socket_connect_timeout=10)
        except (ValueError, TypeError) as error:
            raise StoreError(self._scrub(f"Carnator cache URL {self.location!r} is not valid ({error}): write it "
                                         "as redis://[:password@]host:port/db or rediss:// for TLS")) from None
        self._guard("connect", self._client.ping)
        self.identity = None
        if blob_folder is not None:
            self.identity = self.establish(self.stored_identity() or uuid.uuid4().hex)
            self._bind(blob_folder)

    def recorded_size_limit(self):
        """The size limit the store was last opened with (bytes), None before one was recorded."""
        value = self._guard("connect", lambda: self._client.get(PREFIX + "size_limit"))
        return int(value) if value is not None and value.isdigit() else None

    def record_size_limit(self, size_limit_bytes: int) -> None:
        self._guard("record the size limit", lambda: self._client.set(PREFIX + "size_limit", int(size_limit_bytes)))

    def stored_identity(self):
        """The store's identity as Redis holds it; None in a new database (or one that lost its data)."""
        identity = self._guard("connect", lambda: self._client.get(PREFIX + "store"))
        return identity.decode() if identity is not None else None

    def establish(self, identity: str) -> str:
        """The store's identity: the one Redis holds, else `identity` (a write only then: an existing store opens
        over maxmemory too)."""
        if self.stored_identity() is None:
            self._guard("connect", lambda: self._client.set(PREFIX + "store", identity, nx=True))
        return self.stored_identity()

    def bound_folder(self):
        """The identity of the blob folder the store is bound to ("" none, the Redis-only layout)."""
        bound = self._guard("connect", lambda: self._client.get(BLOB_FOLDER_KEY))
        return bound.decode() if bound is not None else ""

    def check_present(self) -> None:
        """StoreError when an entry's part may be missing for want of the medium rather than by damage: this
        Redis-only store's database became a farm's (its trajectories are in a folder, not here)."""
        if self.bound_folder():
            raise StoreUnavailable(f"Carnator cache {self.location!r} is a farm's now (its trajectories are in a "
                                   "shared blob folder): give blob_dir")

    def _bind(self, blob_folder: str) -> None:
        """A store is Redis-only or a farm's (its trajectories in the blob folder of identity `blob_folder`), for
        good: opened the other way, every hit would read a trajectory that is not where it looks."""
        def work():
            with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(BLOB_FOLDER_KEY, PREFIX + "ids")
                        bound = pipe.get(BLOB_FOLDER_KEY)
                        bound = bound.decode() if bound is not None else ""
                        if bound or not blob_folder:
                            return bound
                        if pipe.scard(PREFIX + "ids"):
                            return None
                        pipe.multi()
                        pipe.set(BLOB_FOLDER_KEY, blob_folder)
                        pipe.execute()
                        return blob_folder
                    except self._errors.WatchError:
                        continue   # another worker bound it or stored an entry first: look again
        bound = self._guard("connect", work)
        if bound is None:
            raise StoreError(f"Carnator cache {self.location!r} holds Redis-only entries (trajectories inside "
                             "Redis): leave blob_dir empty for it, or give the farm another database "
                             "(redis://host:port/1)")
        if bound != blob_folder:
            raise StoreError(f"Carnator cache {self.location!r} keeps its trajectories in a shared blob folder "
                             f"(the farm layout; folder identity {bound[:8]}...): give blob_dir, the folder of that "
                             "store every worker mounts")

    # ---- errors ----------------------------------------------------------------------------------

    def _scrub(self, text: str) -> str:
        if self._password:
            for spelled in {self._password, urllib.parse.quote(self._password, safe="")}:
                text = text.replace(spelled, "***")
        return text

    def _guard(self, action: str, work):
        errors = self._errors
        try:
            return work()
        except errors.AuthenticationError as error:
            advice = ("the password was refused (wrong password?)" if self._password else
                      "it asks for a password and none was given")
            message = f"{advice} ({error}): put it in the URL (redis://:PASSWORD@host:port/db) or in " \
                      f"{PASSWORD_VARIABLE}"
        except errors.ResponseError as error:
            text = str(error)
            if "NOAUTH" in text or "uthentication required" in text:
                message = (f"it asks for a password and none was given ({text}): put it in the URL "
                           f"(redis://:PASSWORD@host:port/db) or in {PASSWORD_VARIABLE}")
            elif "without any password configured" in text:
                message = f"a password was given but the server has none ({text}): remove it from the URL"
            elif isinstance(error, errors.OutOfMemoryError) or "OOM" in text or "maxmemory" in text:
                message = f"the server is out of memory ({text}): lower the size limit or raise Redis' maxmemory"
            else:
                message = f"the server refused ({text})"
        except (errors.ConnectionError, errors.TimeoutError) as error:
            raise StoreUnavailable(self._scrub(f"Carnator cache {self.location!r} could not {action}: the server "
                                              f"cannot be reached ({error}): start redis-server or fix the URL")) \
                from None
        except errors.RedisError as error:
            message = f"the server failed ({error})"
        raise StoreError(self._scrub(f"Carnator cache {self.location!r} could not {action}: {message}")) from None

    def server_time(self) -> float:
        """Seconds since the epoch by the server's clock: the one clock every worker shares (theirs may be off by
        minutes)."""
        seconds, microseconds = self._client.time()
        return seconds + microseconds / 1e6

    def _key(self, kind: str, entry_id: str) -> str:
        return f"{PREFIX}{kind[0]}:{entry_id}"

    # ---- writing ---------------------------------------------------------------------------------

    def _log(self, pipe, op: str, entry_id: str) -> None:
        """One change-log record, queued on `pipe` (a transaction, or the client itself)."""
        pipe.xadd(PREFIX + "log", {"op": op, "id": entry_id}, maxlen=LOG_KEEP, approximate=True)

    def queue_put(self, pipe, entry_id: str, meta: bytes, parts: dict, size: int) -> None:
        """Into a MULTI: the parts given (the farm layout keeps its blob out of Redis), then the metadata, and the
        entry's `size` (all its parts' bytes) counted."""
        for kind in ("sig", "blob", "thumb"):
            if kind in parts:
                pipe.set(self._key(kind, entry_id), parts[kind])
        pipe.set(self._key("meta", entry_id), meta)
        pipe.sadd(PREFIX + "ids", entry_id)
        pipe.hset(SIZES_KEY, entry_id, size)
        self._adjust(pipe, size)
        self._log(pipe, "put", entry_id)

    def _adjust(self, pipe, delta: int) -> None:
        pipe.eval(ADJUST, 1, TOTAL_KEY, int(delta))

    def commit(self, entry_id: str, meta: bytes, parts: dict) -> None:
        """Once: under WATCH, a connection dropped during EXEC is redis-py's WatchError instead of a silent resend of
        the transaction, and the retry that finds this very metadata stored (it holds the write's own timestamps)
        does nothing, so the store's total is never counted twice."""
        key = self._key("meta", entry_id)

        def work():
            with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(key)
                        if pipe.get(key) == meta:
                            pipe.unwatch()
                            return   # applied already: the reply of its EXEC was lost
                        pipe.multi()
                        self.queue_put(pipe, entry_id, meta, parts, sum(len(p) for p in parts.values()))
                        pipe.execute()
                        return
                    except self._errors.WatchError:
                        continue
        self._guard("store an entry", work)

    def update(self, entry_id: str, change) -> bool:
        key = self._key("meta", entry_id)

        def work():
            with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(key)
                        meta = pipe.get(key)
                        if meta is None:
                            pipe.unwatch()
                            return False
                        pipe.multi()
                        pipe.set(key, change(meta))
                        self._log(pipe, "meta", entry_id)
                        pipe.execute()
                        return True
                    except self._errors.WatchError:
                        continue   # another worker changed it first: read it again
        return self._guard("update an entry", work)

    def freeing(self, deletions, op: str, entry_id: str):
        """Runs `deletions(pipe)` and logs `op` in one transaction; over maxmemory (noeviction), where Redis refuses
        every command of a transaction, the deletions run one by one instead (DEL and SREM are allowed over the
        limit), the metadata's first, then the log record once space was freed (skipped if still refused: the
        other workers find the entry gone at their next read of it). Returns the deletions' replies."""
        pipe = self._client.pipeline(transaction=True)
        deletions(pipe)
        self._log(pipe, op, entry_id)
        try:
            return pipe.execute()[:-1]
        except self._errors.OutOfMemoryError:
            pass
        pipe = self._client.pipeline(transaction=False)
        deletions(pipe)
        pipe.delete(TOTAL_KEY, RELIST_KEY)   # recounted, relisted: what refused commands left out (DEL is allowed)
        replies = pipe.execute(raise_on_error=False)[:-1]
        try:
            self._log(self._client, op, entry_id)
        except self._errors.OutOfMemoryError:
            pass
        return replies

    def queue_remove(self, pipe, entry_id: str) -> None:
        """An entry's deletions (for freeing): its metadata first, then its parts and its size."""
        pipe.delete(self._key("meta", entry_id))
        pipe.srem(PREFIX + "ids", entry_id)
        for kind in ("sig", "blob", "thumb"):
            pipe.delete(self._key(kind, entry_id))
        pipe.hdel(SIZES_KEY, entry_id)

    def remove_entry(self, entry_id: str, budget=None, blobs=None) -> tuple:
        """Removes one entry in one transaction: ("evicted" or "gone", the total seen). With `budget` (an
        eviction) only while the store's total exceeds it, checked in that same transaction (WATCH): ("fits",
        total) otherwise, so workers evicting at once never take the total below the limit. `blobs` (the farm)
        releases the entry's file in that transaction (watch_keys, read, queue_release)."""
        meta_key = self._key("meta", entry_id)

        def work():
            recounted = False
            with self._client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(meta_key, *([TOTAL_KEY] if budget is not None else []),
                                   *(blobs.watch_keys(entry_id) if blobs else []))
                        total = pipe.get(TOTAL_KEY) if budget is not None else None
                        if budget is not None and total is None and not recounted:
                            pipe.unwatch()
                            recounted = True
                            try:
                                self.recount()
                            except StoreError:
                                pass   # over maxmemory: the caller's index decides, this once
                            continue
                        if total is not None:
                            total = int(total)
                            if total <= budget:
                                pipe.unwatch()
                                return "fits", total
                        exists, size = pipe.exists(meta_key), pipe.hget(SIZES_KEY, entry_id)
                        if not exists and budget is not None:
                            pipe.unwatch()
                            return "gone", total
                        held = blobs.read(pipe, entry_id) if blobs else None
                        pipe.multi()
                        self._queue_removal(pipe, entry_id, exists and size, blobs, held)
                        pipe.execute()
                        break
                    except self._errors.WatchError:
                        continue   # another worker changed the entry or the total first: look again
                    except self._errors.OutOfMemoryError:
                        fallback = self._client.pipeline(transaction=False)
                        self._queue_removal(fallback, entry_id, 0, blobs, held)
                        fallback.delete(TOTAL_KEY, RELIST_KEY)
                        fallback.execute(raise_on_error=False)
                        break
            if blobs:
                blobs.released_legacy([held])
            return ("evicted" if exists else "gone"), total
        return self._guard("delete an entry", work)

    def _queue_removal(self, pipe, entry_id: str, size, blobs, held) -> None:
        self.queue_remove(pipe, entry_id)
        if size:
            self._adjust(pipe, -int(size))
        if blobs:
            blobs.queue_release(pipe, entry_id, held)
        self._log(pipe, "del", entry_id)

    def remove(self, entry_id: str) -> bool:
        return self.remove_entry(entry_id)[0] == "evicted"

    def evict(self, entry_id: str, budget: int) -> tuple:
        return self.remove_entry(entry_id, budget=budget)

    def total_bytes(self):
        """The store's total as Redis counts it (recounted where it is missing)."""
        total = self._guard("measure its entries", lambda: self._client.get(TOTAL_KEY))
        return int(total) if total is not None else self.recount()

    def recount(self) -> int:
        return int(self._guard("measure its entries", lambda: self._client.eval(
            RECOUNT, 3, PREFIX + "ids", SIZES_KEY, TOTAL_KEY, self._key("meta", ""))))

    def entry_ids(self) -> list:
        return [i.decode() for i in self._guard("list its entries", lambda: self._client.smembers(PREFIX + "ids"))]

    def queue_clear(self, pipe, ids: list) -> None:
        """The deletions of every entry of `ids` (for freeing). Only those: an entry another worker commits after
        the listing stays whole and listed (deleting the whole id set would leave its keys where nothing lists,
        evicts or counts them)."""
        for start in range(0, len(ids), BATCH):
            chunk = ids[start:start + BATCH]
            pipe.delete(*[self._key(kind, e) for kind in "msbt" for e in chunk])
            pipe.srem(PREFIX + "ids", *chunk)
            pipe.hdel(SIZES_KEY, *chunk)

    def clear(self, blobs=None) -> None:
        """The entries listed now, each file released with its entry (`blobs`: the farm); the total recounted
        after (an entry another worker removed meanwhile is not subtracted twice)."""
        ids = self.entry_ids()

        def work():
            helds = [blobs.read(self._client, entry_id) for entry_id in ids] if blobs else []

            def deletions(pipe):
                self.queue_clear(pipe, ids)
                for entry_id, held in zip(ids, helds):
                    blobs.queue_release(pipe, entry_id, held)
            self.freeing(deletions, "clear", "-")
            if blobs:
                blobs.released_legacy(helds)
        self._guard("clear the cache", work)
        try:
            self.recount()
        except StoreError:
            pass   # dropped: recounted by the next eviction

    # ---- reading ---------------------------------------------------------------------------------

    def meta(self, entry_id: str):
        return self._guard("read an entry", lambda: self._client.get(self._key("meta", entry_id)))

    def part(self, entry_id: str, kind: str, limit=None):
        """`limit` (a file's most bytes) is for blob files: a value in Redis has the size it was written with."""
        return self._guard("read an entry", lambda: self._client.get(self._key(kind, entry_id)))

    def parts(self, entry_ids: list, kind: str) -> list:
        """One part of each of several entries (bytes or None each), in one round trip."""
        if not entry_ids:
            return []
        return self._guard("read entries", lambda: self._client.mget([self._key(kind, e) for e in entry_ids]))

    def metas(self):
        """Every (id, metadata bytes or None), streamed BATCH at a time."""
        ids = sorted(i.decode() for i in self._guard("list its entries",
                                                    lambda: self._client.smembers(PREFIX + "ids")))
        for start in range(0, len(ids), BATCH):
            chunk = ids[start:start + BATCH]
            yield from zip(chunk, self._guard("list its entries",
                                              lambda: self._client.mget([self._key("meta", e) for e in chunk])))

    def cursor(self) -> str:
        def work():
            last = self._client.xrevrange(PREFIX + "log", count=1)
            return last[0][0].decode() if last else "0-0"
        return self._guard("read its change log", work)

    def changes(self, cursor: str):
        def work():
            pipe = self._client.pipeline(transaction=False)
            pipe.xrange(PREFIX + "log", min=f"({cursor}", max="+")
            pipe.xrange(PREFIX + "log", min=cursor, max=cursor)
            pipe.xrevrange(PREFIX + "log", count=1)
            new, at, last = pipe.execute()
            # Rebuild when the cursor's own record is no longer in the log: trimmed past it (this worker is LOG_KEEP
            # changes behind), or the server lost it (restarted without persistence, or rolled back to an older
            # append-only file: the log may have grown past the cursor again since, with other records, and the
            # entries this worker took in after the rollback point are gone).
            if _stream_id(cursor) != (0, 0) and not at:
                return (last[0][0].decode() if last else "0-0"), None
            if not new:
                return cursor, []
            changes = [(fields[b"op"].decode(), fields[b"id"].decode()) for _, fields in new]
            return new[-1][0].decode(), changes
        return self._guard("read its change log", work)

    # ---- the index snapshot ----------------------------------------------------------------------

    def load_snapshot(self):
        return self._guard("read its index snapshot", lambda: self._client.get(PREFIX + "snapshot"))

    def save_snapshot(self, data: bytes) -> None:
        self._guard("write its index snapshot", lambda: self._client.set(PREFIX + "snapshot", data))

    # ---- space -----------------------------------------------------------------------------------

    def overhead_bytes(self) -> int:
        return 0   # the server's own memory is its administrator's (maxmemory), not part of the entries' limit

    def lasting_overhead_bytes(self) -> int:
        return 0

    def compact(self, excess: int) -> None:
        return None

    def reclaim_orphans(self) -> tuple:
        return 0, 0  # parts are written and removed in the same transaction as their metadata: none can orphan

    @staticmethod
    def eviction_step():
        """Nothing to lock: eviction checks the store's total in its removing transaction (remove_entry)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        self._client.close()
