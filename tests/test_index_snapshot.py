"""The index snapshot (carnator_engine/store/index_snapshot.py), on both backends: an open loads it and replays what any
process logged since; a snapshot that is damaged, torn, of another version, of another store or behind the log is
never used (the index is rebuilt from the entries instead)."""
import logging
import os

import pytest

from carnator_engine.store import index_snapshot
from carnator_engine.store import store as store_module
from carnator_engine.store import CarnatorStore
from forked import run_forked_with_output
from test_store import _put, _signature, location  # noqa: F401 - location is a fixture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OTHER_WORKER = """
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from carnator_engine.store import CarnatorStore
from test_store import _put
store = CarnatorStore({location!r}, 64 << 20)
print(_put(store, 7))
store.delete({deleted!r})
store.record_hit({hit!r}, steps_saved=5)
"""  # it ends without close() (a forked worker, ended by os._exit): what it did is in the change log only


def _no_rebuild(monkeypatch, store):
    """Makes reading every entry's metadata (a rebuild) fail, for stores opened from now on."""
    def rebuilt(self):
        raise AssertionError("the index was rebuilt from every entry instead of loaded from its snapshot")
    monkeypatch.setattr(type(store._backend), "metas", rebuilt)


def _rebuilds(monkeypatch, store) -> list:
    """Counts the rebuilds of stores opened from now on (one element each)."""
    seen, real = [], type(store._backend).metas

    def metas(self):
        seen.append(1)
        return real(self)
    monkeypatch.setattr(type(store._backend), "metas", metas)
    return seen


def _indexed_ids(store) -> set:
    return set(store.shortlist("b", _signature(0), 1000))


def test_an_open_loads_the_snapshot_and_sees_what_another_worker_wrote_since(location, monkeypatch):
    first = CarnatorStore(location, 64 << 20)
    ids = [_put(first, seed) for seed in range(3)]
    first.close()                                           # writes the snapshot
    _no_rebuild(monkeypatch, first)
    running = CarnatorStore(location, 64 << 20)             # opened from the snapshot
    tests = os.path.join(ROOT, "tests")
    status, printed = run_forked_with_output(OTHER_WORKER.format(root=ROOT, tests=tests, location=location,
                                                                deleted=ids[0], hit=ids[1]))
    assert status == 0, printed
    new = printed.split()[0]
    later = CarnatorStore(location, 64 << 20)               # opened from the same snapshot, log replayed
    for store in (running, later):
        assert store.shortlist("b", _signature(7), 1) == [new]
        assert _indexed_ids(store) == {new, ids[1], ids[2]}
        assert store.stats()["entries"] == 3 and store.stats()["hits"] == 1
    running.close(), later.close()


def _swap(data: bytes, a: str, b: str) -> bytes:
    return data.replace(a.encode(), b"\0" * len(a)).replace(b.encode(), a.encode()).replace(b"\0" * len(a), b.encode())


def test_a_damaged_or_torn_snapshot_is_not_used(location, monkeypatch, caplog):
    store = CarnatorStore(location, 64 << 20)
    ids = [_put(store, seed) for seed in range(2)]
    store.close()
    backend = store._backend.__class__(location)
    good = backend.load_snapshot()
    rebuilds = _rebuilds(monkeypatch, store)
    # The two ids swapped inside the payload: a snapshot that parses, whose checksum alone says it is wrong.
    for damaged, why in ((_swap(good, *ids), "checksum"), (good[:-100], "torn")):
        backend.save_snapshot(damaged)
        with caplog.at_level(logging.WARNING, logger="carnator.store"):
            reopened = CarnatorStore(location, 64 << 20)
        assert any("snapshot" in r.getMessage() and why in r.getMessage() for r in caplog.records), why
        assert reopened.shortlist("b", _signature(0), 1) == [ids[0]]
        assert reopened.shortlist("b", _signature(1), 1) == [ids[1]]
        caplog.clear()
    assert len(rebuilds) == 2
    backend.close()


def test_a_snapshot_of_another_version_is_not_used(location, monkeypatch):
    store = CarnatorStore(location, 64 << 20)
    _put(store, 0)
    monkeypatch.setattr(index_snapshot, "VERSION", index_snapshot.VERSION + 1)
    store.close()                                           # written by a later Carnator
    monkeypatch.undo()
    rebuilds = _rebuilds(monkeypatch, store)
    reopened = CarnatorStore(location, 64 << 20)
    assert rebuilds == [1] and reopened.stats()["entries"] == 1
    reopened.close()


def _elsewhere(location: str, tmp_path) -> str:
    return str(tmp_path / "elsewhere") if not location.startswith("redis") else location[:-1] + "1"


def test_a_snapshot_of_another_store_is_not_used(location, tmp_path):
    other = CarnatorStore(_elsewhere(location, tmp_path), 64 << 20)
    ghosts = {_put(other, seed) for seed in range(2)}
    other.close()
    store = CarnatorStore(location, 64 << 20)
    own = {_put(store, seed) for seed in range(3)}          # its log reaches past the other snapshot's cursor
    store.close()
    store._backend.__class__(location).save_snapshot(other._backend.__class__(
        _elsewhere(location, tmp_path)).load_snapshot())    # copied in, or left by a store created again
    reopened = CarnatorStore(location, 64 << 20)
    assert _indexed_ids(reopened) == own and not ghosts & _indexed_ids(reopened)
    reopened.close()


def test_a_snapshot_the_log_no_longer_reaches_is_not_used(tmp_path, monkeypatch):
    from carnator_engine.store.backends import disk
    monkeypatch.setattr(disk, "LOG_KEEP", 2)
    directory = str(tmp_path / "c")
    first = CarnatorStore(directory, 64 << 20)
    ids = {_put(first, 0)}
    first.close()
    writer = CarnatorStore(directory, 64 << 20)
    ids |= {_put(writer, seed) for seed in range(1, 5)}     # 4 changes: the log keeps the last 2
    rebuilds = _rebuilds(monkeypatch, writer)
    reopened = CarnatorStore(directory, 64 << 20)
    assert rebuilds == [1] and _indexed_ids(reopened) == ids


def test_a_snapshot_is_written_every_so_many_changes(location, monkeypatch):
    monkeypatch.setattr(store_module, "SNAPSHOT_EVERY", 3)
    store = CarnatorStore(location, 64 << 20)
    for seed in range(3):
        _put(store, seed)
    saved = index_snapshot.header(store._backend.load_snapshot())
    assert saved["cursor"] == store._backend.cursor() and saved["entries"] == 3   # without a close
    store.close()


def test_a_snapshot_holds_the_index_a_rebuild_makes(location, monkeypatch):
    from store_damage import set_raw
    store = CarnatorStore(location, 64 << 20)
    full = _put(store, 0)
    store.record_hit(full, steps_saved=4)
    store.put(bucket="b", prompt="hit", seed=1, steps=10, probe_steps=2, signature=_signature(1),
              payload=store.trajectory(store.record(full)), latent_shape=[1, 1, 1, 1, 1000], reused_from=full,
              extra={"bucket": {"model": "m", "steps": 10}})
    broken = _put(store, 2)
    set_raw(store, broken, "blob", b"damaged")
    with pytest.raises(store_module.CorruptEntryError):
        store.trajectory(store.record(broken))               # marked corrupt: indexed, but not searchable
    store.close()
    loaded = CarnatorStore(location, 64 << 20)._index
    store._backend.__class__(location).save_snapshot(b"not a snapshot")
    rebuilt = CarnatorStore(location, 64 << 20)._index

    def described(index):
        entries = {e: {k: getattr(v, k) for k in v.__slots__} for e, v in index.entries.items()}
        matrices = {b: {e: (m.rows[row].tolist(), float(m.norms[row])) for e, row in m.position.items()}
                    for b, m in index.matrices.items()}
        order = []
        while index.queue.first() is not None:
            order.append(index.queue.first())
            index.queue.discard(order[-1])
        return entries, matrices, index.bucket_counts, index.bucket_parts, index.repeats, index.bytes, order
    assert described(loaded) == described(rebuilt)
    assert loaded.entries[broken].corrupt and broken not in loaded.matrices["b"].ids
