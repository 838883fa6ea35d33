import subprocess
import sys

import pytest
import torch

from carnator_engine.signature import EarlySignature
from carnator_engine.store import DEFAULT_SIZE_LIMIT, CarnatorStore, CorruptEntryError, StoreError, TrajectoryPayload
from store_damage import drop_raw, get_raw, set_raw


def _signature(seed=0):
    g = torch.Generator().manual_seed(seed)
    return EarlySignature(hidden=torch.randn(2, 3, 64, generator=g), denoised=torch.randn(3, 4, 4, 4, generator=g),
                          attention=torch.softmax(torch.randn(3, 4, 4, generator=g), -1))


def _put(store, seed=0, checkpoint_elems=1000, prompt="a red circle", request_key=""):
    latent = torch.randn(1, 1, 1, 1, checkpoint_elems, generator=torch.Generator().manual_seed(seed)).half()
    payload = TrajectoryPayload({4: latent, 6: latent * 2}, {"0": torch.eye(3, dtype=torch.bool)})
    return store.put(bucket="b", prompt=prompt, seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=payload, latent_shape=latent.shape, thumbnail=b"png", request_key=request_key)


def test_round_trip_and_restart(store, tmp_path):
    entry = _put(store)
    record = store.record(entry)
    assert record.checkpoint_steps == [4, 6] and record.prompt == "a red circle"
    restored = store.signature(record)
    assert torch.equal(restored.hidden, _signature(0).hidden)
    payload = store.trajectory(record)
    assert torch.equal(payload.checkpoints[6], payload.checkpoints[4] * 2)
    assert torch.equal(payload.connectivity["0"], torch.eye(3, dtype=torch.bool))
    store.close()
    # A fresh process sees the same entry: the store lives on disk, not in memory.
    code = ("import sys; sys.path.insert(0, %r); from carnator_engine.store import CarnatorStore; "
            "s = CarnatorStore(%r, 64 << 20); print([r.entry_id for r in s.records()])")
    out = subprocess.run([sys.executable, "-c", code % (sys.path[0], store.location)], capture_output=True,
                         text=True, check=True).stdout
    assert entry in out


def test_flipped_bytes_are_detected_reported_and_skipped(store):
    good, bad = _put(store, 0), _put(store, 1)
    blob = bytearray(get_raw(store, bad, "blob"))
    blob[-10] ^= 0xFF
    set_raw(store, bad, "blob", bytes(blob))
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.trajectory(store.record(bad))
    assert any(bad in problem for problem in store.drain_problems())
    assert [r.entry_id for r in store.records()] == [good]  # corrupt entry no longer offered
    with pytest.raises(CorruptEntryError):
        store.signature(store.record(bad))
    assert store.trajectory(store.record(good)).checkpoints  # the neighbour is untouched


def test_torn_entry_without_blob_is_skipped(store):
    entry = _put(store)
    drop_raw(store, entry, "blob")
    with pytest.raises(CorruptEntryError, match="missing"):
        store.trajectory(store.record(entry))


def test_entry_without_metadata_is_invisible(store):
    entry = _put(store)
    drop_raw(store, entry, "meta")
    assert store.records() == []


def test_eviction_keeps_entries_with_benefit(tmp_path):
    store = CarnatorStore(str(tmp_path / "c"), size_limit_bytes=1 << 20)
    useful = _put(store, 0, checkpoint_elems=60_000)   # ~240 KB each (two fp16 checkpoints)
    store.record_hit(useful, steps_saved=8)
    others = [_put(store, seed, checkpoint_elems=60_000) for seed in range(1, 8)]
    ids = [r.entry_id for r in store.records()]
    assert store.stats()["bytes"] <= 1 << 20
    assert useful in ids and others[-1] in ids
    assert others[0] not in ids
    assert store.record(useful).hits == 1 and store.record(useful).steps_saved == 8


def test_entry_larger_than_the_limit_is_refused_without_evicting(tmp_path):
    store = CarnatorStore(str(tmp_path / "c"), size_limit_bytes=1 << 20)
    kept = _put(store, 0)
    with pytest.raises(StoreError, match="raise the size limit"):
        _put(store, 1, checkpoint_elems=400_000)
    assert [r.entry_id for r in store.records()] == [kept]


def test_bad_limits_and_unwritable_directory(tmp_path):
    with pytest.raises(ValueError, match="below the minimum"):
        CarnatorStore(str(tmp_path / "c"), size_limit_bytes=10)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="not writable"):
        CarnatorStore(str(blocker / "cache"))


def test_delete_clear_and_stats(store):
    first, second = _put(store, 0), _put(store, 1)
    assert store.stats()["entries"] == 2
    assert store.delete(first) and not store.delete(first)
    with pytest.raises(StoreError, match="no cache entry"):
        store.record(first)
    assert store.clear() == 1 and store.records() == []
    assert second not in [r.entry_id for r in store.records()]


# ---- both backends ------------------------------------------------------------------------------

@pytest.fixture(params=["disk", "redis"])
def location(request, tmp_path):
    """A fresh store location of each backend: a directory, or the URL of a throwaway redis-server."""
    if request.param == "disk":
        return str(tmp_path / "cache")
    return request.getfixturevalue("redis_server").url


def test_both_backends_round_trip_delete_and_share_their_writes(location):
    first, second = CarnatorStore(location, 64 << 20), CarnatorStore(location, 64 << 20)
    entry = _put(first, 0)
    payload = second.trajectory(second.record(entry))     # written by another instance, seen without reopening
    assert torch.equal(payload.checkpoints[6], payload.checkpoints[4] * 2)
    assert second.stats()["entries"] == 1 and second.shortlist("b", _signature(0), 3) == [entry]
    assert second.delete(entry) and first.shortlist("b", _signature(0), 3) == []
    assert first.stats()["entries"] == 0
    first.close(), second.close()


def test_damaged_metadata_is_reported_and_removed_not_fatal(location):
    store = CarnatorStore(location, 64 << 20)
    good, bad = _put(store, 0), _put(store, 1)
    set_raw(store, bad, "meta", b"\x80\x04garbage that does not parse")  # what a torn or damaged value looks like
    reopened = CarnatorStore(location, 64 << 20)
    assert [r.entry_id for r in reopened.records(include_corrupt=True)] == [good]
    assert reopened.stats()["entries"] == 1
    assert any(bad in p and "metadata does not parse" in p for p in reopened.drain_problems())
    assert _put(reopened, 2) and reopened.exact_repeat("b", "") is None
    set_raw(store, good, "meta", b"{}")                 # damaged under a running store: only that entry is lost
    with pytest.raises(CorruptEntryError, match="metadata does not parse"):
        store.record(good)
    assert good not in [r.entry_id for r in store.records()] and store.stats()["entries"] == 1
    store.close(), reopened.close()


def test_a_flipped_bit_or_an_edited_field_in_metadata_is_caught_never_served(location):
    store = CarnatorStore(location, 64 << 20)
    first, other = _put(store, 0, request_key="request A"), _put(store, 1, request_key="request B")
    meta = get_raw(store, first, "meta")
    flipped = meta.replace(b'"seed": 0,', b'"seed": 1,')             # one bit: "0" is 0x30, "1" 0x31
    assert flipped != meta and len(flipped) == len(meta)
    set_raw(store, first, "meta", flipped)
    with pytest.raises(CorruptEntryError, match="checksum"):
        store.record(first)
    edited = get_raw(store, other, "meta").replace(b'"request_key": "request B"', b'"request_key": "request A"')
    set_raw(store, other, "meta", edited)                            # B's result now claims to answer request A
    reopened = CarnatorStore(location, 64 << 20)                     # an index built from the edited metadata
    assert reopened.exact_repeat("b", "request A") is None
    assert store.exact_repeat("b", "request B") is None              # an index from before: the entry decides
    assert any(other in p and "checksum" in p for p in reopened.drain_problems() + store.drain_problems())
    assert reopened.stats()["entries"] == 0
    store.close(), reopened.close()


def test_an_entry_deleted_during_a_read_is_gone_not_corrupt(location):
    store = CarnatorStore(location, 64 << 20)
    entry = _put(store, 0)
    record = store.record(entry)
    other = CarnatorStore(location, 64 << 20)
    other.delete(entry)                              # another worker evicts it between the record and the read
    with pytest.raises(StoreError, match="deleted or evicted meanwhile") as caught:
        store.trajectory(record)
    assert not isinstance(caught.value, CorruptEntryError) and store.drain_problems() == []
    store.close(), other.close()


def test_non_finite_values_are_refused_before_anything_is_stored(location):
    store = CarnatorStore(location, 64 << 20)
    broken = _signature(0)
    broken.denoised[0, 0, 0, 0] = float("nan")
    latent = torch.zeros(1, 1, 1, 1, 10).half()
    with pytest.raises(StoreError, match="non-finite"):
        store.put(bucket="b", prompt="p", seed=0, steps=10, probe_steps=2, signature=broken,
                  payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape)
    with pytest.raises(StoreError, match="checkpoint 4 holds non-finite"):
        store.put(bucket="b", prompt="p", seed=0, steps=10, probe_steps=2, signature=_signature(0),
                  payload=TrajectoryPayload({4: latent + float("inf")}, {}), latent_shape=latent.shape)
    assert store.stats()["entries"] == 0 and store.records(include_corrupt=True) == []
    for limit in (float("nan"), float("inf"), "8"):
        with pytest.raises(ValueError, match="not a finite number"):
            store.set_size_limit(limit)
    store.close()


def test_a_non_finite_lookup_signature_finds_nothing_and_says_why(store):
    from carnator_engine.store.index import nearest
    _put(store, 0)
    broken = _signature(0)
    broken.hidden[0, 0, 0] = float("nan")
    assert nearest(store, "b", broken) == []
    assert any("non-finite" in p for p in store.drain_problems())


def test_the_index_shortlist_finds_the_nearest_among_many(tmp_path):
    store = CarnatorStore(str(tmp_path / "c"), 256 << 20)
    ids = [_put(store, seed, checkpoint_elems=10) for seed in range(300)]
    from carnator_engine.store.index import nearest
    for seed in (3, 150, 299):
        query = _signature(seed)
        query.denoised += 0.01 * torch.randn(query.denoised.shape, generator=torch.Generator().manual_seed(9))
        assert nearest(store, "b", query, limit=1)[0].record.entry_id == ids[seed]
    reopened = CarnatorStore(str(tmp_path / "c"), 256 << 20)     # rebuilt at open from the stored vectors
    assert reopened.shortlist("b", _signature(42), 1) == [ids[42]]


def test_lineage_keeps_a_full_generation_among_the_candidates_of_its_hits(store):
    """The crowding sequence of issue 16: a full generation F, then three hits made from it whose signatures lie
    nearer the next request than F's; each hit keeps only the checkpoints after its resume step (4), so a gate that
    sees only the three of them finds "no checkpoint between step 4 and step 4" and misses."""
    from carnator_engine.store.index import nearest
    base = _signature(0)

    def put(signature, checkpoints, reused_from=None):
        latent = torch.zeros(1, 1, 1, 1, 10).half()
        payload = TrajectoryPayload({s: latent.clone() for s in checkpoints}, {})
        return store.put(bucket="b", prompt="p", seed=0, steps=10, probe_steps=2, signature=signature,
                         payload=payload, latent_shape=latent.shape, reused_from=reused_from)

    def near(scale):
        shifted = _signature(0)
        shifted.denoised = base.denoised + scale
        return shifted
    full = put(near(0.3), [3, 4, 5, 6])
    hit = put(near(0.05), [5, 6], reused_from=full)
    hit_of_hit = put(near(0.06), [5, 6], reused_from=hit)
    third = put(near(0.07), [5, 6], reused_from=full)
    other = put(near(-0.5), [3, 4, 5, 6])                        # another generation, further away
    assert store.record(hit_of_hit).lineage == full and store.record(full).lineage == full
    candidates = [c.record.entry_id for c in nearest(store, "b", base, limit=3)]
    assert full in candidates and other in candidates             # F is not crowded out by its own hits
    assert candidates[0] == hit and third not in candidates       # one slot per lineage: its nearest, and F


# ---- crashes and damage of the disk backend -------------------------------------------------------

CRASH = """
import os, sys
sys.path.insert(0, {root!r})
from carnator_engine.store.backends import disk
from carnator_engine.store import CarnatorStore
store = CarnatorStore({directory!r}, 64 << 20)
real_remove, real_transact = os.remove, store._backend._cache.transact
def remove(path, *args, **kwargs):
    if path.endswith('.blob') and {at!r} == 'unlink':
        os._exit(9)             # killed between the delete's commit and the blob's unlink
    return real_remove(path, *args, **kwargs)
def transact(*args, **kwargs):
    if {at!r} == 'commit':
        os._exit(9)             # killed between the blob's write and the metadata's commit
    return real_transact(*args, **kwargs)
os.remove = remove
store._backend._cache.transact = transact
{work}
"""


def _crash(directory, at, work):
    """Runs `work` on a store at `directory` in another process, killed (os._exit(9)) at `at`."""
    import os
    from forked import run_forked
    code = CRASH.format(root=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), directory=directory,
                        at=at, work=work)
    assert run_forked(code) == 9


def _age_blobs(directory):
    import os
    blobs = os.path.join(directory, "blobs")
    for name in os.listdir(blobs):
        os.utime(os.path.join(blobs, name), (0, 0))   # older than the grace given to writes in flight
    return len(os.listdir(blobs))


def test_a_crash_during_delete_never_tears_a_committed_entry(tmp_path):
    directory = str(tmp_path / "c")
    store = CarnatorStore(directory, 64 << 20)
    kept, doomed = _put(store, 0), _put(store, 1)
    store.close()
    _crash(directory, "unlink", f"store.delete({doomed!r})")
    assert _age_blobs(directory) == 2                      # the doomed blob outlived its metadata: an orphan
    reopened = CarnatorStore(directory, 64 << 20)
    assert [r.entry_id for r in reopened.records(include_corrupt=True)] == [kept]
    assert reopened.orphans_reclaimed == 1 and reopened.stats()["orphans_reclaimed"] == 1
    assert reopened.trajectory(reopened.record(kept)).checkpoints and reopened.drain_problems() == []


def test_a_killed_write_leaves_an_orphan_that_the_next_open_reclaims_whatever_its_date(tmp_path):
    """Whether a write is in flight is judged by the lock every write holds, never by its file's date: a file
    server's clock may be a day ahead or an hour behind."""
    import os
    import time
    from carnator_engine.store.backends.disk import WRITING_LOCK
    from carnator_engine.store.owned_files import LockFile
    directory = str(tmp_path / "c")
    store = CarnatorStore(directory, 64 << 20)
    kept = _put(store, 0)
    store.close()
    _crash(directory, "commit",
           "import torch\nfrom carnator_engine.store import TrajectoryPayload\n"
           "from carnator_engine.signature import EarlySignature\n"
           "sig = EarlySignature(torch.ones(2, 3, 64), torch.ones(3, 4, 4, 4), torch.full((3, 4, 4), 0.25))\n"
           "store.put(bucket='b', prompt='p', seed=1, steps=10, probe_steps=2, signature=sig, "
           "payload=TrajectoryPayload({4: torch.zeros(1, 8).half()}, {}), latent_shape=[1, 8])")
    blobs = os.path.join(directory, "blobs")
    tomorrow = time.time() + 86400
    for name in os.listdir(blobs):
        os.utime(os.path.join(blobs, name), (tomorrow, tomorrow))
    writer = LockFile(os.path.join(directory, WRITING_LOCK), "0" * 32)   # another process's write in flight
    with writer.held(exclusive=False):
        busy = CarnatorStore(directory, 64 << 20)
        assert busy.orphans_reclaimed == 0 and [r.entry_id for r in busy.records()] == [kept]
        busy.close()
    writer.close()
    assert len(os.listdir(blobs)) == 2
    reopened = CarnatorStore(directory, 64 << 20)
    assert reopened.orphans_reclaimed == 1 and [r.entry_id for r in reopened.records()] == [kept]
    assert len(os.listdir(blobs)) == 1


def test_the_size_limit_holds_on_disk_including_sqlite_files(tmp_path):
    import os
    directory = tmp_path / "c"
    limit = 2 << 20
    store = CarnatorStore(str(directory), limit)
    for seed in range(40):
        _put(store, seed, checkpoint_elems=30_000)         # ~120 KB per entry: 40 of them would be ~4.8 MB
        on_disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        assert on_disk <= limit, (seed, on_disk)
    stats = store.stats()
    assert stats["bytes"] <= limit and stats["overhead_bytes"] > 0 and 5 <= stats["entries"] < 40
    assert os.path.exists(directory / "cache.db")


def test_unusable_cache_db_is_a_clear_error(tmp_path, monkeypatch):
    import sqlite3

    import diskcache
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "cache.db").write_bytes(b"")
    with pytest.raises(StoreError, match=r"empty.*cache.db is empty.*delete the directory"):
        CarnatorStore(str(empty))
    damaged = tmp_path / "damaged"
    CarnatorStore(str(damaged)).close()                  # a marked store whose database is then overwritten
    for name in ("cache.db-wal", "cache.db-shm"):
        (damaged / name).unlink(missing_ok=True)
    (damaged / "cache.db").write_bytes(b"this is not an SQLite database" * 100)
    with pytest.raises(StoreError, match=r"damaged.*cache.db is damaged: move the directory away"):
        CarnatorStore(str(damaged))
    misplaced = tmp_path / "misplaced"
    (misplaced / "cache.db").mkdir(parents=True)
    with pytest.raises(StoreError, match=r"misplaced.*cache.db is not a file"):
        CarnatorStore(str(misplaced))

    def read_only(*args, **kwargs):     # root ignores file modes, so the error SQLite gives is injected
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(diskcache, "Cache", read_only)
    with pytest.raises(StoreError, match=r"read_only.*read-only: fix its permissions"):
        CarnatorStore(str(tmp_path / "read_only"))


def test_the_size_limit_is_recorded_with_the_store_and_opening_without_one_keeps_it(tmp_path):
    """A cache made with 1 MiB opens with 1 MiB where no limit is given (stats, clear): neither the default 8 GiB
    reported nor anything evicted under another limit; a limit given again is recorded again."""
    directory = str(tmp_path / "cache")
    made = CarnatorStore(directory, 1 << 20)
    _put(made)
    made.close()
    looked_at = CarnatorStore(directory, None)
    assert looked_at.size_limit_bytes == looked_at.stats()["size_limit_bytes"] == 1 << 20
    assert looked_at.stats()["entries"] == 1
    looked_at.set_size_limit(64 << 20)
    looked_at.close()
    assert CarnatorStore(directory, None).size_limit_bytes == 64 << 20
    assert CarnatorStore(str(tmp_path / "new"), None).size_limit_bytes == DEFAULT_SIZE_LIMIT
