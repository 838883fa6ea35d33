"""Open cache stores of this ComfyUI process, shared by the nodes and the web routes.

One CarnatorStore per location (a store's handles and in-memory index are costly to build and must not be
duplicated): a directory, or a redis:// / rediss:// URL for a store shared by many workers. The default
directory lives in ComfyUI's user directory so it survives restarts and updates.
"""
from __future__ import annotations

import os
import threading

from carnator_engine.backends import is_redis_url
from carnator_engine.store import CarnatorStore

_lock = threading.Lock()
_stores: dict = {}


def default_cache_dir() -> str:
    try:
        import folder_paths  # ComfyUI's module; absent when the engine is used on its own
        return os.path.join(folder_paths.get_user_directory(), "carnator_cache")
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "carnator")


def _key(location: str) -> str:
    """The registry's key: the URL as given (it may hold a password, so it is never shown), or the directory."""
    location = location.strip()
    if is_redis_url(location):
        return location
    return os.path.abspath(os.path.expanduser(location or default_cache_dir()))


def open_store(location: str = "", size_limit_bytes: int = 8 << 30) -> CarnatorStore:
    key = _key(location)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = CarnatorStore(key, size_limit_bytes)
        elif store.size_limit_bytes != size_limit_bytes:
            store.set_size_limit(size_limit_bytes)
        return store


def known_stores() -> dict:
    """Shown location (a directory, or a URL without its password) -> store, the default one included once it
    has been opened."""
    with _lock:
        return {store.location: store for store in _stores.values()}
