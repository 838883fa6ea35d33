"""The farm keeps every acknowledged entry whatever the workers' clocks say and whatever the connection does: a
write's age is its lease on Redis's clock (workers with clocks 11 minutes apart, each patched in its own forked
process), a commit refuses where its record is gone and applies once on a retry, a Redis fault inside a write
is the store's error, never redis-py's, and a hostile file at a blob's path is a corrupt entry."""
import errno
import multiprocessing
import os
import time

import pytest
import torch

from carnator_engine.store import CarnatorStore, CorruptEntryError, StoreError
from carnator_engine.store.backends import farm
from carnator_engine.store.errors import StoreUnavailable
from test_farm_backend import _leases_run_out, _put, blobs, farm_store  # noqa: F401 - fixtures

FORK = multiprocessing.get_context("fork")
SKEW = 11 * 60   # past ORPHAN_GRACE_SECONDS: by a local clock, a live write looks killed
REAL_TIME = time.time


def _skewed(seconds: float) -> None:
    """This process's clock `seconds` off the real one (time.time only: what a worker's wrong clock changes)."""
    time.time = lambda: REAL_TIME() + seconds


def _open_with_clock(url: str, blobs: str, seconds: float, answers) -> None:
    torch.set_num_threads(1)
    _skewed(seconds)
    store = CarnatorStore(url, 64 << 20, blob_dir=blobs)
    answers.put(store.orphans_reclaimed)
    store.close()


def _opened_elsewhere(url: str, blobs: str, seconds: float) -> int:
    """A worker with its clock `seconds` off opens the farm in another process: what its open reclaimed."""
    answers = FORK.Queue()
    process = FORK.Process(target=_open_with_clock, args=(url, blobs, seconds, answers))
    process.start()
    reclaimed = answers.get(timeout=120)
    process.join(timeout=60)
    assert process.exitcode == 0
    return reclaimed


@pytest.mark.parametrize("writer, opener", [(-SKEW, 0), (0, SKEW)])
def test_a_write_in_flight_survives_an_open_by_a_worker_with_another_clock(redis_server, tmp_path, monkeypatch,
                                                                           writer, opener):
    blobs = str(tmp_path / "blobs")
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    monkeypatch.setattr(time, "time", lambda: REAL_TIME() + writer)
    real_write, reclaimed = farm.FarmBackend._write, []

    def write_then_another_worker_opens(self, name, nonce, blob):
        written = real_write(self, name, nonce, blob)
        reclaimed.append(_opened_elsewhere(redis_server.url, blobs, opener))
        return written
    monkeypatch.setattr(farm.FarmBackend, "_write", write_then_another_worker_opens)
    entry = _put(store, 3)
    assert reclaimed == [0]
    assert store.trajectory(store.record(entry)).checkpoints[4][0, 0] == 3.0
    store.close()


def test_a_killed_write_dated_a_day_ahead_is_reclaimed_once_its_lease_is_gone(redis_server, tmp_path, monkeypatch):
    blobs = str(tmp_path / "blobs")
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    monkeypatch.setattr(time, "time", lambda: REAL_TIME() + 86400)
    monkeypatch.setattr(farm.FarmBackend, "_commit", lambda self, entry_id, meta, parts: self._create(entry_id,
                                                                                                      b"x" * 1000))
    _put(store, 1)                                                # the writer is killed after its file
    monkeypatch.undo()
    assert len(os.listdir(blobs)) == 2 and store.stats()["overhead_bytes"] > 1000   # counted while in flight
    _leases_run_out(redis_server.url)
    assert _opened_elsewhere(redis_server.url, blobs, 0) == 1
    assert os.listdir(blobs) == ["carnator-store.json"] and store.stats()["overhead_bytes"] == 0
    store.close()


def test_a_commit_whose_record_is_gone_fails_and_is_never_acknowledged(farm_store, redis_server, monkeypatch):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    real_write = farm.FarmBackend._write

    def write_then_collected(self, name, nonce, blob):
        written = real_write(self, name, nonce, blob)
        os.remove(os.path.join(self.blob_dir, name))              # a collector freed it meanwhile: the file,
        admin.delete(f"carnator:n:{name}")                        # then its record
        return written
    monkeypatch.setattr(farm.FarmBackend, "_write", write_then_collected)
    with pytest.raises(StoreError, match="reclaimed as a killed write before its commit"):
        _put(farm_store, 2)
    assert farm_store.records() == [] and admin.scard("carnator:ids") == 0


@pytest.mark.parametrize("layout", ["farm", "redis only"])
def test_a_commit_retried_after_its_exec_went_through_applies_once(redis_server, blobs, monkeypatch, layout):
    """A connection killed during EXEC: redis-py reports a WatchError, the transaction having been applied."""
    import redis
    store = CarnatorStore(redis_server.url, 64 << 20, **({"blob_dir": blobs} if layout == "farm" else {}))
    real_execute, lost = redis.client.Pipeline.execute, []

    def execute(self, *args, **kwargs):
        commit = _puts(self)                         # read before: execute empties the queue
        replies = real_execute(self, *args, **kwargs)
        if commit and not lost:
            lost.append(True)
            raise redis.exceptions.WatchError("A ConnectionError occurred on while watching one or more keys")
        return replies
    store._backend.total_bytes()                     # the total kept from now on (recounted once)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    first = _put(store, 1, elems=5000)
    monkeypatch.undo()
    second = _put(store, 2, elems=5000)
    admin = redis.Redis.from_url(redis_server.url)
    sizes = sum(int(v) for v in admin.hvals("carnator:sz"))
    assert lost and int(admin.get("carnator:bytes")) == sizes and admin.scard("carnator:ids") == 2
    assert len(admin.xrange("carnator:log")) == 2 and store.record(first) and store.record(second)
    store.close()


def _puts(pipe) -> bool:
    """Whether the transaction queued on `pipe` is an entry's commit (it stores the entry's metadata)."""
    return any(args[0] == "SET" and str(args[1]).startswith("carnator:m:") for args, _ in pipe.command_stack)


def test_a_write_whose_file_was_deleted_before_its_commit_says_so(farm_store, monkeypatch):
    from carnator_engine.store.backends import blob_folder
    real_create = blob_folder.create_new

    def created_then_deleted(final, data, secret):
        real_create(final, data, secret)
        os.remove(final)
    monkeypatch.setattr(blob_folder, "create_new", created_then_deleted)
    with pytest.raises(StoreError, match="was deleted before its commit") as refused:
        _put(farm_store, 6)
    assert "unmounted" not in str(refused.value) and farm_store.records() == []


def test_a_full_disk_while_redis_is_gone_is_the_stores_error(farm_store, monkeypatch):
    import redis
    real_create = farm.BlobFolder.create

    def full(self, name, nonce, data):
        error = StoreError("no room")
        error.__cause__ = OSError(errno.ENOSPC, "No space left on device")
        raise error

    def gone(*args, **kwargs):
        raise redis.exceptions.ConnectionError("Connection closed by server.")
    monkeypatch.setattr(farm.BlobFolder, "create", full)
    monkeypatch.setattr(farm_store._backend._client, "zrangebyscore", gone)
    with pytest.raises(StoreUnavailable, match="cannot be reached"):
        _put(farm_store, 4)
    monkeypatch.setattr(farm.BlobFolder, "create", real_create)


@pytest.mark.parametrize("hostile", ["fifo", "link to /dev/zero"])
def test_a_hostile_file_at_a_blob_path_is_a_corrupt_entry_never_a_hang(farm_store, blobs, redis_server, hostile):
    import redis
    entry = _put(farm_store, 5)
    name = redis.Redis.from_url(redis_server.url).get(f"carnator:f:{entry}").decode()
    path = os.path.join(blobs, name)
    os.remove(path)
    (os.mkfifo if hostile == "fifo" else lambda p: os.symlink("/dev/zero", p))(path)
    with pytest.raises(CorruptEntryError, match="does not match its checksum"):
        farm_store.trajectory(farm_store.record(entry))
    assert os.path.lexists(path)


def test_after_a_flushall_a_store_made_there_costs_the_farm_no_entry_and_no_binding(farm_store, redis_server):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()
    alone = CarnatorStore(redis_server.url, 64 << 20)             # a Redis-only store in the emptied database
    theirs = _put(alone, 1)
    with pytest.raises(StoreError, match="holds another store now .*nothing is marked corrupt"):
        _put(farm_store, 2)
    assert admin.get("carnator:blob_folder") is None             # never bound to the farm's folder
    with pytest.raises(StoreError) as refused:
        farm_store.trajectory(farm_store.record(theirs))
    assert not isinstance(refused.value, CorruptEntryError) and not alone.record(theirs).corrupt
    assert alone.trajectory(alone.record(theirs)).checkpoints[4][0, 0] == 1.0
    alone.close()


def test_a_write_in_flight_across_a_flushall_is_stored_whole_and_strands_no_file(farm_store, redis_server, blobs,
                                                                                 monkeypatch):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    real_write = farm.FarmBackend._write

    def write_then_flushall(self, name, nonce, blob):
        written = real_write(self, name, nonce, blob)
        admin.flushall()                                          # Redis loses its data, the file is written
        return written
    monkeypatch.setattr(farm.FarmBackend, "_write", write_then_flushall)
    entry = _put(farm_store, 7)
    monkeypatch.undo()
    name = admin.get(f"carnator:f:{entry}").decode()
    assert admin.get(f"carnator:n:{name}") is not None             # its record is back: the file is counted
    assert farm_store.trajectory(farm_store.record(entry)).checkpoints[4][0, 0] == 7.0
    assert admin.get("carnator:store").decode() == farm_store._backend.identity
