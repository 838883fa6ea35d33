import subprocess
import sys

import pytest
import torch

from carnator_engine.signature import EarlySignature
from carnator_engine.store import CarnatorStore, CorruptEntryError, StoreError, TrajectoryPayload
from store_damage import drop_raw, get_raw, set_raw


def _signature(seed=0):
    g = torch.Generator().manual_seed(seed)
    return EarlySignature(hidden=torch.randn(2, 3, 64, generator=g), denoised=torch.randn(3, 4, 4, 4, generator=g),
                          attention=torch.softmax(torch.randn(3, 4, 4, generator=g), -1))


def _put(store, seed=0, checkpoint_elems=1000, prompt="a red circle"):
    latent = torch.randn(1, 1, 1, 1, checkpoint_elems, generator=torch.Generator().manual_seed(seed)).half()
    payload = TrajectoryPayload({4: latent, 6: latent * 2}, {"0": torch.eye(3, dtype=torch.bool)})
    return store.put(bucket="b", prompt=prompt, seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=payload, latent_shape=latent.shape, thumbnail=b"png")


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
