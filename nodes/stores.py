"""Open cache stores of this ComfyUI process, shared by the nodes and the web routes.

One CarnatorStore per location (a store's handles and in-memory index are costly to build and must not be
duplicated): a directory, or a redis:// / rediss:// URL for a store shared by many workers. The default
directory lives in ComfyUI's user directory so it survives restarts and updates.
"""
from __future__ import annotations

import os
import threading

from carnator_engine.store.backends import is_redis_url
from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore, StoreError

DEFAULT_SIZE_LIMIT_GB = DEFAULT_SIZE_LIMIT / (1 << 30)   # the Carnator Cache node's default, in GiB

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
    location = location.strip()
    if is_redis_url(location):
        return location
    directory = os.path.expanduser(location)
    if not directory:
        return os.path.abspath(default_cache_dir())
    if os.path.isabs(directory):
        return os.path.normpath(directory)
    inside = os.path.abspath(user_directory())
    joined = os.path.normpath(os.path.join(inside, directory))
    if os.path.commonpath([inside, joined]) != inside or joined == inside:
        raise StoreError(f"cache_dir {location!r} leaves ComfyUI's user directory ({inside}): give a folder inside "
                         "it (no '..'), or an absolute path")
    return joined


def open_store(location: str = "", size_limit_bytes: int = DEFAULT_SIZE_LIMIT, blob_dir: str = "") -> CarnatorStore:
    """`blob_dir` (with a redis:// location): the farm layout's shared folder of trajectories."""
    key, blob_dir = _key(location), blob_dir.strip()
    with _lock:
        store = _stores.get((key, blob_dir))
        if store is None:
            store = _stores[(key, blob_dir)] = CarnatorStore(key, size_limit_bytes, blob_dir=blob_dir)
        elif store.size_limit_bytes != size_limit_bytes:
            store.set_size_limit(size_limit_bytes)
        return store


def known_stores() -> dict:
    """Shown location (a directory, or a URL without its password) -> store, the default one included once it
    has been opened."""
    with _lock:
        return {store.location: store for store in _stores.values()}
