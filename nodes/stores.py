"""Open cache stores of this ComfyUI process, shared by the nodes and the web routes.

One CarnatorStore per directory (diskcache handles are costly to open and must not be duplicated);
the default directory lives in ComfyUI's user directory so it survives restarts and updates.
"""
from __future__ import annotations

import os
import threading

from carnator_engine.store import CarnatorStore

_lock = threading.Lock()
_stores: dict = {}


def default_cache_dir() -> str:
    try:
        import folder_paths  # ComfyUI's module; absent when the engine is used on its own
        return os.path.join(folder_paths.get_user_directory(), "carnator_cache")
    except ImportError:
        return os.path.join(os.path.expanduser("~"), ".cache", "carnator")


def open_store(directory: str = "", size_limit_bytes: int = 8 << 30) -> CarnatorStore:
    directory = os.path.abspath(os.path.expanduser(directory.strip() or default_cache_dir()))
    with _lock:
        store = _stores.get(directory)
        if store is None:
            store = _stores[directory] = CarnatorStore(directory, size_limit_bytes)
        elif store.size_limit_bytes != size_limit_bytes:
            store.set_size_limit(size_limit_bytes)
        return store


def known_stores() -> dict:
    """directory -> store, the default one included once it has been opened."""
    with _lock:
        return dict(_stores)
