"""Where a store keeps its bytes: the seam between CarnatorStore (records, checksums, index, eviction) and a backend.

A backend stores, per entry id, an encoded metadata value and three parts ("sig", "blob", "thumb"), and keeps a
change log so every process sharing the store can keep its in-memory index current. What every backend promises:
- `commit(id, meta, parts)`: the parts are fully written before the metadata that refers to them is visible;
- `remove(id)`: the metadata's removal is committed before any part is deleted, so a crash in between leaves an
  orphan (reclaimed at the next open), never a visible entry with a missing part;
- `evict(id, budget)`: removes the entry to make room: ("evicted" | "gone" | "fits", the total it saw); a store
  shared by several workers removes it only while its own total (checked in the removing transaction) exceeds
  `budget`, and answers "fits" otherwise, so workers evicting at once never take it below the limit;
- `update(id, change)`: an atomic read-modify-write of one entry's metadata; False when the entry is gone;
- `meta(id)`, `part(id, kind, limit)`: bytes or None (a blob file is read as a regular file only, at most `limit`
  bytes: a FIFO or a device at its name gives b"", never a hang); `parts(ids, kind)`: a list of those, read in one
  go where the medium allows; `metas()`: every (id, bytes or None) pair, streamed;
- `changes(cursor)`: (new cursor, [(op, id)]) since `cursor`, or (cursor, None) when the log no longer reaches back
  that far (the caller rebuilds); `cursor()` the current position;
- `load_snapshot()` (bytes or None), `save_snapshot(data)`: the index snapshot (index_snapshot.py), one value
  replaced whole; `identity`: a token made when the store was created, which a snapshot names;
- `clear()`, `overhead_bytes()` (what the store takes beyond its entries' bytes; the size limit counts it),
  `lasting_overhead_bytes()` (the part of it that stays until entries are evicted; the rest leaves, or becomes
  entries, by itself and is never a reason to evict), `compact(excess)` (frees up to `excess` bytes without
  evicting), `reclaim_orphans()` -> (count, bytes), `eviction_step()` (a context held around one eviction step:
  the lock the processes of a folder store share; nothing for a shared store, whose removing transaction checks
  its total), `check_present()` (StoreUnavailable when a part may be missing for want of the medium, not by
  damage: a folder unmounted), `close()`; `location`: where it lives, safe to show (no password).
Every failure of the medium is raised as StoreError naming the location and what to do; StoreUnavailable (one
kind of it) when the medium cannot be reached now but the store exists (the store then serves full generations).

Two backends, one file each: `disk` (diskcache + blob files, the default, no server) and `redis_store`; and the
farm layout `farm` (Redis for the index and metadata, trajectories in a shared `blob_folder`), which composes them.
"""
from __future__ import annotations

import ipaddress
import os
import urllib.parse

from ...typed_paths import control_character
from ..errors import StoreError

REDIS_SCHEMES = ("redis://", "rediss://")
# Set to 1 to let a Carnator Cache node's redis:// URL name a server on another machine (a farm's): a workflow
# shared with the user could otherwise send their generations to a host they never set up.
ALLOW_REMOTE_VARIABLE = "CARNATOR_ALLOW_REMOTE_REDIS"


def is_redis_url(location: str) -> bool:
    return location.strip().lower().startswith(REDIS_SCHEMES)


def refuse_other_urls(location: str) -> None:
    """StoreError for a URL of another kind (unix://, http://, ...): it would otherwise name a folder, the URL's
    password in its name. The message shows the scheme only."""
    scheme, separator, _ = location.strip().partition("://")
    if separator and not is_redis_url(location):
        raise StoreError(f"a {scheme[:20]}:// cache location is not supported: give a folder path, or a Redis "
                         "store as redis://[:password@]host:port/db (rediss:// for TLS)")


def _loopback(host: str) -> bool:
    if host in ("", "localhost") or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_remote_redis(location: str) -> None:
    """StoreError for a redis:// URL naming another machine than this one, unless ALLOW_REMOTE_VARIABLE is 1: by
    default the cache's generations go only to a server on this machine (loopback)."""
    from .redis_store import split_url
    client, _, shown = split_url(location)
    host = (urllib.parse.urlsplit(client).hostname or "").lower()
    if _loopback(host) or os.environ.get(ALLOW_REMOTE_VARIABLE, "").strip() == "1":
        return
    raise StoreError(f"cache_dir {shown!r} names a Redis server on another machine ({host}): Carnator sends "
                     "generations only to a server on this one unless you allow it; for a farm you set up, start "
                     f"ComfyUI with {ALLOW_REMOTE_VARIABLE}=1 (docs/farm.md)")


def holds_store(location: str) -> bool:
    """Whether a store lives at `location` already, found without creating one: a directory once it carries the
    store marker (or a store from before the marker, which opening adopts); a redis:// URL names a server, which
    only opening the store can ask."""
    if is_redis_url(location):
        return True
    refuse_other_urls(location)
    from ..marker import is_marked
    return is_marked(location)


def shown_location(location: str, blob_dir: str = "") -> str:
    """Where a store lives, as its backend's `location` says it (no password), found without opening it: what a
    store checks first, so a location or blob_dir holding a control character is refused before anything is made
    (and before strip() takes a trailing newline or tab away unseen)."""
    for name, text in (("the cache location", location), ("blob_dir", blob_dir)):
        refused = control_character(text)
        if refused:
            raise StoreError(f"{name} {refused}")
    if not is_redis_url(location):
        from ..marker import check_location
        return check_location(location)
    from .redis_store import shown_url
    if not blob_dir:
        return shown_url(location)
    from .farm import LOCATION_JOIN
    from ..marker import check_location
    return f"{shown_url(location)}{LOCATION_JOIN}{check_location(blob_dir.strip())}"


def open_backend(location: str, blob_dir: str = ""):
    """The backend of `location`; with `blob_dir` (a redis:// location only) the farm layout (farm.py)."""
    refuse_other_urls(location)
    if is_redis_url(location):
        refuse_remote_redis(location)
    if blob_dir:
        if not is_redis_url(location):
            raise StoreError(f"blob_dir {blob_dir[:200]!r} is for a redis:// cache (the farm layout: index in Redis, "
                             "trajectories in the shared folder): give a redis:// URL, or leave blob_dir empty")
        from .farm import FarmBackend
        return FarmBackend(location.strip(), blob_dir)
    if is_redis_url(location):
        from .redis_store import RedisBackend
        return RedisBackend(location.strip())
    from .disk import DiskBackend
    return DiskBackend(location)
