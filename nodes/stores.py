"""Open cache stores of this ComfyUI process, shared by the nodes and the web routes.

One CarnatorStore per location (a store's handles and in-memory index are costly to build and must not be
duplicated): a directory, or a redis:// / rediss:// URL for a store shared by many workers. The default
directory lives in ComfyUI's user directory so it survives restarts and updates. Every store a node opened is
remembered there (carnator_stores.json: location and size limit, never a password), so that after a restart the
cache browser can open it again before any prompt has.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid

from carnator_engine.store.backends import is_redis_url, refuse_other_urls, refuse_remote_redis
from carnator_engine.store.backends.farm import LOCATION_JOIN
from carnator_engine.store.marker import check_location, inspect, refuse_farm_folder
from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore, StoreError
from carnator_engine.typed_paths import control_character

DEFAULT_SIZE_LIMIT_GB = DEFAULT_SIZE_LIMIT / (1 << 30)   # the Carnator Cache node's default, in GiB

REMEMBERED_FILE = "carnator_stores.json"

log = logging.getLogger("carnator.nodes")
_lock = threading.Lock()
_stores: dict = {}


def user_directory() -> str:
    """ComfyUI's user directory (user/ under its base directory), or ~/.cache without ComfyUI."""
    try:
        import folder_paths  # ComfyUI's module; absent when the engine is used on its own
        return folder_paths.get_user_directory()
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache")


def default_cache_dir() -> str:
    return os.path.join(user_directory(), "carnator_cache")


def _key(location: str) -> str:
    """The registry's key: the URL as given (it may hold a password, so it is never shown), or the directory a
    Carnator Cache node's cache_dir names: empty = the default one; a relative path is taken inside the user
    directory, never the server's working directory (which depends on how ComfyUI was started), and may not leave
    it (`..`): a shared workflow's cache_dir cannot reach folders elsewhere on the server."""
    refused = control_character(location)
    if refused:
        raise StoreError(f"cache_dir {refused}")
    location = location.strip()
    if is_redis_url(location):
        return location
    refuse_other_urls(location)
    directory = os.path.expanduser(location)
    if not directory:
        return os.path.abspath(default_cache_dir())
    if os.path.isabs(directory):
        return os.path.normpath(directory)
    inside = os.path.abspath(user_directory())
    joined = os.path.normpath(os.path.join(inside, directory))
    if os.path.commonpath([inside, joined]) != inside:
        raise StoreError(f"cache_dir {location!r} leaves ComfyUI's user directory ({inside}): give a folder inside "
                         "it (no '..'), or an absolute path")
    if joined == inside:
        raise StoreError(f"cache_dir {location!r} names ComfyUI's user directory itself ({inside}), which holds "
                         "ComfyUI's own files: a store needs a folder of its own, such as 'carnator_cache' (or "
                         "leave cache_dir empty for that default)")
    return joined


def check_cache_dir(location: str) -> None:
    """StoreError when opening `location` would be refused, found without creating, changing or deleting anything
    (a Redis server is not asked): the Carnator Cache node's check before any node of a prompt runs."""
    key = _key(location)
    if is_redis_url(key):
        refuse_remote_redis(key)
    else:
        directory = check_location(key)
        refuse_farm_folder(directory)
        inspect(directory)


def remembered_stores() -> dict:
    """Shown location -> size limit of every store a node of this ComfyUI has opened ({} when none or unreadable)."""
    try:
        with open(os.path.join(user_directory(), REMEMBERED_FILE), encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {location: limit for location, limit in value.items()
            if isinstance(location, str) and isinstance(limit, int) and not isinstance(limit, bool)}


def _remember(store: CarnatorStore) -> None:
    """Best effort (the browser only loses a store from its list until a prompt opens it again)."""
    remembered = remembered_stores()
    if remembered.get(store.location) == store.size_limit_bytes:
        return
    remembered[store.location] = store.size_limit_bytes
    path = os.path.join(user_directory(), REMEMBERED_FILE)
    temporary = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump(remembered, handle, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        log.warning("carnator: could not remember the store %s in %s (%s)", store.location, path, error)
        try:
            os.remove(temporary)
        except OSError:
            pass


def open_store(location: str = "", size_limit_bytes: int = DEFAULT_SIZE_LIMIT, blob_dir: str = "") -> CarnatorStore:
    """`blob_dir` (with a redis:// location): the farm layout's shared folder of trajectories. A farm's shown
    location (`URL + folder`, as remembered) opens that farm."""
    if not blob_dir.strip() and is_redis_url(location) and LOCATION_JOIN in location:
        location, blob_dir = location.split(LOCATION_JOIN, 1)
    key, blob_dir = _key(location), blob_dir.strip()
    with _lock:
        store = _stores.get((key, blob_dir))
        if store is None:
            store = _stores[(key, blob_dir)] = CarnatorStore(key, size_limit_bytes, blob_dir=blob_dir)
        elif store.size_limit_bytes != size_limit_bytes:
            store.set_size_limit(size_limit_bytes)
        _remember(store)
        return store


def known_stores() -> dict:
    """Shown location (a directory, or a URL without its password) -> store, the default one included once it
    has been opened."""
    with _lock:
        return {store.location: store for store in _stores.values()}
