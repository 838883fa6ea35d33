"""Raw access to a store's stored bytes, for tests that damage entries the way a crash or a disk would.

Works for both backends: the disk backend's SQLite keys and blob files, the Redis backend's keys."""
import dataclasses
import os

from carnator_engine.store.backends.disk import DiskBackend


def _disk_key(kind, entry_id):
    return f"{kind[0]}:{entry_id}"


def get_raw(store, entry_id, kind):
    backend = store._backend
    if kind == "meta":
        return backend.meta(entry_id)
    return backend.part(entry_id, kind)


def set_raw(store, entry_id, kind, data):
    backend = store._backend
    if isinstance(backend, DiskBackend):
        if kind == "blob":
            with open(backend._blob_path(entry_id), "wb") as handle:
                handle.write(data)
        else:
            backend._cache.set(_disk_key(kind, entry_id), data)
    else:
        backend._client.set(backend._key(kind, entry_id), data)


def drop_raw(store, entry_id, kind):
    backend = store._backend
    if isinstance(backend, DiskBackend):
        if kind == "blob":
            os.remove(backend._blob_path(entry_id))
        else:
            backend._cache.delete(_disk_key(kind, entry_id))
    else:
        backend._client.delete(backend._key(kind, entry_id))


def edit_meta(store, entry_id, change):
    """change(dict) edits the stored metadata in place, as another writer would (checksum and all: a consistent
    record, not damage)."""
    from carnator_engine.store.store import EntryRecord, _decode, _encode
    record, vector = _decode(get_raw(store, entry_id, "meta"), entry_id)
    value = dataclasses.asdict(record)
    change(value)
    set_raw(store, entry_id, "meta", _encode(EntryRecord(**value), vector))
