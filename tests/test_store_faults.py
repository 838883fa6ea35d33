"""Store faults: every one leaves the store usable, and none reports a healthy entry as corrupt."""
import os

import pytest
import torch

from carnator_engine.store import CarnatorStore, StoreError
from store_damage import set_raw
from test_store import _put, _signature, location  # noqa: F401 - location is the both-backends fixture


def _drop_snapshot(store):
    backend = store._backend
    if hasattr(backend, "_client"):
        backend._client.delete("carnator:snapshot")
    else:
        os.remove(os.path.join(backend.location, "index.snapshot"))


def test_a_rebuild_over_unparsable_metadata_opens_the_store(location):
    store = CarnatorStore(location, 64 << 20)
    good, bad = _put(store, 0), _put(store, 1)
    store.close()
    set_raw(store, bad, "meta", b"{not json")
    _drop_snapshot(store)                              # the index must be rebuilt from every entry's metadata
    reopened = CarnatorStore(location, 64 << 20)
    assert reopened.shortlist("b", _signature(0), 3) == [good]
    assert any(bad in p and "metadata does not parse" in p for p in reopened.drain_problems())
    assert [r.entry_id for r in reopened.records(include_corrupt=True)] == [good]
    reopened.close()


def test_an_entry_evicted_while_listing_is_gone_not_corrupt(redis_server):
    store, other = CarnatorStore(redis_server.url, 64 << 20), CarnatorStore(redis_server.url, 64 << 20)
    kept, evicted = _put(store, 0), _put(store, 1)
    client = store._backend._client
    members = client.smembers

    def listed_then_evicted(key):                       # another worker evicts between the listing and the reads
        ids = members(key)
        other.delete(evicted)
        return ids
    client.smembers = listed_then_evicted
    assert [r.entry_id for r in store.records()] == [kept]
    store.clear()                                       # a rebuild that meets the same race
    assert store.drain_problems() == []
    store.close(), other.close()


def test_redis_over_maxmemory_still_deletes_evicts_and_clears_and_says_why(redis_server):
    from nodes.routes import delete_entry
    store = CarnatorStore(redis_server.url, 64 << 20)
    entries = [_put(store, seed, checkpoint_elems=100_000) for seed in range(6)]   # ~0.4 MB each
    client = store._backend._client
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(client.info("memory")["used_memory"] // 2))
    with pytest.raises(StoreError, match="out of memory.*lower the size limit or raise Redis' maxmemory"):
        _put(store, 9)
    assert store.delete(entries[0])                                  # the store frees space itself
    assert delete_entry(store, entries[1]) == {"deleted": entries[1]}  # and the cache browser's DELETE
    assert store.set_size_limit(1 << 20) and len(store.records()) < 4  # eviction
    client.config_set("maxmemory", "1")                               # still over the limit: clear works
    assert store.clear() >= 1 and store.records() == []
    assert CarnatorStore(redis_server.url, 64 << 20).stats()["entries"] == 0
    client.config_set("maxmemory", "0")
    store.close()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root only; where mounting is not allowed the test skips with the reason)."""
    import subprocess
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()}): run as root")
    yield mount
    subprocess.run(["umount", "--lazy", str(mount)], check=True)   # lazy: a closed SQLite may still be unmapping


def _fill(path):
    """Takes every byte the disk has left, as another program would."""
    try:
        with open(path, "wb") as handle:
            while True:
                handle.write(bytes(4096))
                handle.flush()
    except OSError:
        pass                             # full (possibly before the file could be made)


def test_a_full_disk_still_opens_the_store_for_lookups_and_frees_space_itself(small_disk):
    import os
    directory = str(small_disk / "cache")
    store = CarnatorStore(directory, 64 << 20)
    entries = []
    with pytest.raises(StoreError, match="disk is full: free space or lower the size limit"):
        while True:
            entries.append(_put(store, len(entries), checkpoint_elems=60_000))
    store.close()
    _fill(small_disk / "other_program.bin")
    assert os.statvfs(small_disk).f_bavail == 0
    reopened = CarnatorStore(directory, 64 << 20)                     # opens: lookups still work
    assert reopened.shortlist("b", _signature(0), 1) == [entries[0]]
    assert torch.equal(reopened.trajectory(reopened.record(entries[0])).checkpoints[6],
                       reopened.trajectory(reopened.record(entries[0])).checkpoints[4] * 2)
    assert reopened.delete(entries[0])                                # and the store frees space itself
    assert reopened.set_size_limit(1 << 20)                           # eviction
    assert not [name for name in os.listdir(directory) if name.startswith(".write-test")]
    reopened.close()


def test_a_redis_password_with_url_characters_connects_and_never_shows(tmp_path):
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    password = "pa/ss#wo?rd@x"
    server = RedisServer(str(tmp_path / "redis"), password=password).start()
    try:
        url = f"redis://:{password}@127.0.0.1:{server.port}/0"
        store = CarnatorStore(url, 64 << 20)
        assert _put(store, 0) and password not in store.location and "pa/ss" not in str(store.stats())
        store.close()
        for broken in (f"redis://:{password}@127.0.0.1:notaport/0", f"redis://:{password}@127.0.0.1:1/0"):
            with pytest.raises(StoreError) as caught:   # a bad port at the open; an unreachable one at its use
                CarnatorStore(broken, 64 << 20).stats()
            assert "pa/ss" not in str(caught.value) and "wo?rd" not in str(caught.value), caught.value
    finally:
        server.stop()


def test_a_url_of_another_kind_is_refused_not_made_a_folder(tmp_path, monkeypatch):
    from nodes import stores
    monkeypatch.setattr(stores, "user_directory", lambda: str(tmp_path / "user"))
    for url in ("unix://:s3cret@/tmp/redis.sock", "http://:s3cret@host/"):
        for opening in (lambda: stores.open_store(url), lambda: CarnatorStore(url)):
            with pytest.raises(StoreError, match="cache location is not supported") as caught:
                opening()
            assert "s3cret" not in str(caught.value)
    assert not (tmp_path / "user").exists()


def test_orphans_of_repeated_crashes_are_reclaimed_and_the_size_limit_holds(tmp_path):
    from test_store import _crash
    directory = tmp_path / "c"
    limit = 2 << 20
    CarnatorStore(str(directory), limit).close()
    for seed in range(3):                              # each killed between its blob's write and its commit
        _crash(str(directory), "commit",
               "import torch\nfrom carnator_engine.store import TrajectoryPayload\n"
               "from carnator_engine.signature import EarlySignature\n"
               "sig = EarlySignature(torch.ones(2, 3, 64), torch.ones(3, 4, 4, 4), torch.full((3, 4, 4), 0.25))\n"
               f"store.put(bucket='b', prompt='p', seed={seed}, steps=10, probe_steps=2, signature=sig, "
               "payload=TrajectoryPayload({4: torch.rand(1, 100_000).half()}, {}), latent_shape=[1, 100_000])")
    # No write holds the folder's lock at an open: each open (the next crashing writer's too) takes the last one's file.
    store = CarnatorStore(str(directory), limit)
    assert store.orphans_reclaimed == 1 and len(os.listdir(directory / "blobs")) == 0
    for seed in range(10):
        _put(store, seed, checkpoint_elems=30_000)
        on_disk = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
        assert on_disk <= limit, (seed, on_disk)
    store.close()


@pytest.mark.parametrize("hostile", ["folder", "fifo", "link to /dev/zero", "huge file"])
def test_a_blob_replaced_by_something_hostile_is_marked_corrupt_and_left_alone(store, hostile):
    """Read only as a regular file, without blocking and at most the size its record holds: a FIFO never hangs
    the read, /dev/zero never exhausts the memory."""
    from carnator_engine.store import CorruptEntryError
    entry = _put(store, 0)
    path = store._backend._blob_path(entry)
    os.remove(path)
    make = {"folder": os.mkdir, "fifo": os.mkfifo, "link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
            "huge file": lambda p: os.truncate(open(p, "wb").name, 64 << 30)}   # sparse: 64 GiB of zeros
    make[hostile](path)
    with pytest.raises(CorruptEntryError, match="does not match its checksum"):
        store.trajectory(store.record(entry))
    assert store.record(entry).corrupt and store.shortlist("b", _signature(0), 3) == []
    assert store.delete(entry) and os.path.lexists(path)


def test_a_file_put_in_place_of_a_blob_or_of_the_snapshot_is_never_deleted_or_overwritten(tmp_path):
    import os
    from carnator_engine.store.owned_files import header
    from test_store import _age_blobs
    directory = tmp_path / "c"
    store = CarnatorStore(str(directory), 64 << 20)
    entries = [_put(store, seed) for seed in range(2)]
    marker_header = header(store._backend.identity)                 # anyone can copy it from the marker
    path = store._backend._blob_path(entries[0])
    os.remove(path)
    with open(path, "wb") as handle:                                # a user's file in place of an entry's blob
        handle.write(marker_header + b"the user's own bytes")
    assert store.delete(entries[0])
    assert open(path, "rb").read() == marker_header + b"the user's own bytes"
    snapshot = directory / "index.snapshot"
    snapshot.write_bytes(marker_header + b"the user's snapshot")     # and a user's file at the snapshot's name
    store._save_snapshot()
    assert snapshot.read_bytes() == marker_header + b"the user's snapshot"
    from carnator_engine.store import index_snapshot
    snapshot.write_bytes(marker_header + index_snapshot.MAGIC + b"...")   # one an older Carnator wrote: replaced
    store._save_snapshot()
    assert snapshot.read_bytes().startswith(header(store._backend._secret) + index_snapshot.MAGIC)
    taken = "0123456789abcdef"                                       # and one at a new entry's blob name
    (directory / "blobs" / f"{taken}.blob").write_bytes(b"someone's")
    with pytest.raises(StoreError, match="taken by a file this store did not write"):
        store.put(bucket="b", prompt="p", seed=3, steps=10, probe_steps=2, signature=_signature(3),
                  payload=store.trajectory(store.record(entries[1])), latent_shape=[1, 1, 1, 1, 1000],
                  entry_id=taken)
    assert (directory / "blobs" / f"{taken}.blob").read_bytes() == b"someone's"
    store.close()
    _age_blobs(str(directory))
    reopened = CarnatorStore(str(directory), 64 << 20)              # named like orphans, old: still not ours
    assert reopened.orphans_reclaimed == 0
    assert open(path, "rb").read() == marker_header + b"the user's own bytes"
    assert reopened.trajectory(reopened.record(entries[1])).checkpoints
    reopened.close()


def test_two_stores_on_one_folder_evict_one_step_at_a_time(tmp_path):
    """Two processes on one folder (two stores, each with its own lock descriptors, lock like two processes): while
    one is inside an eviction step, the other's eviction waits, then decides from an index that took the first
    one's eviction in; the entries evicted are those the limit needs, not one per process."""
    import threading
    directory, limit = str(tmp_path / "c"), 2 << 20
    first, second = CarnatorStore(directory, limit), CarnatorStore(directory, limit)
    while first.stats()["bytes"] < limit - (150 << 10):
        _put(first, len(first.records()), checkpoint_elems=30_000)
    second.stats()                                   # the second store's index holds every entry
    inside, seen, others = [False], [], []
    real_first, real_second = first._backend.evict, second._backend.evict

    def second_evicts(entry_id, budget):
        seen.append(inside[0])
        return real_second(entry_id, budget)

    def first_evicts(entry_id, budget):
        inside[0] = True
        other = threading.Thread(target=second.enforce_size_limit)
        others.append(other)
        other.start()
        other.join(timeout=2)      # the second store, waiting on the lock, does not evict meanwhile
        inside[0] = False
        outcome = real_first(entry_id, budget)
        first._backend.evict = real_first
        return outcome
    second._backend.evict, first._backend.evict = second_evicts, first_evicts
    _put(first, 99, checkpoint_elems=250_000)        # over the limit by several entries
    others[0].join()
    assert True not in seen
    assert first.stats()["bytes"] <= limit
    first.close()
    second.close()


def test_a_fifo_at_the_snapshots_name_is_never_waited_on_nor_replaced(tmp_path):
    directory = tmp_path / "c"
    store = CarnatorStore(str(directory), 64 << 20)
    kept = _put(store, 0)
    store.close()
    snapshot = directory / "index.snapshot"
    snapshot.unlink()
    os.mkfifo(snapshot)
    reopened = CarnatorStore(str(directory), 64 << 20)     # rebuilt from the entries, the FIFO left alone
    assert [r.entry_id for r in reopened.records()] == [kept]
    reopened.close()
    assert snapshot.is_fifo()
