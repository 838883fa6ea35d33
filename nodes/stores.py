"""Open cache stores of this ComfyUI process, shared by the nodes and the web routes.

One CarnatorStore per directory (diskcache handles are costly to open and must not be duplicated);
the default directory lives in ComfyUI's user directory so it survives restarts and updates.
"""
from __future__ import annotations

import os
import threading

from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore

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


def cache_directory(directory: str = "") -> str:
    """The folder a Carnator Cache node's cache_dir names: empty = the default one; a relative path is taken
    inside the user directory, never the server's working directory (which depends on how ComfyUI was started)."""
    directory = os.path.expanduser(directory.strip())
    if not directory:
        return os.path.abspath(default_cache_dir())
    return os.path.abspath(os.path.join(user_directory(), directory))   # join keeps an absolute path as it is


def open_store(directory: str = "", size_limit_bytes: int = DEFAULT_SIZE_LIMIT) -> CarnatorStore:
    directory = cache_directory(directory)
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
