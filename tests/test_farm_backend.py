"""The farm layout (backends/farm.py) on a real Redis and a real folder: trajectories in the folder under their
content hash and none in Redis, the store bound to its layout, a damaged blob reported and the request generated
in full, garbage collection that waits for references and grace periods, foreign files never touched, a full
folder that costs a request its write-back, never the request."""
import errno
import hashlib
import os
import subprocess
import sys
import time

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, generate
from carnator_engine.schedule import flow_sigmas
from carnator_engine.store import CarnatorStore, StoreError, TrajectoryPayload
from carnator_engine.store.backends import farm
from carnator_engine.store.errors import CorruptEntryError, StoreUnavailable
from carnator_engine.store.owned_files import HEADER_BYTES, header
from test_store import _signature

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = time.time() - 3600


def _put(store, seed=0, elems=1000):
    latent = torch.full((1, elems), float(seed), dtype=torch.float16)
    return store.put(bucket="b", prompt="p", seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape, thumbnail=b"png")


@pytest.fixture
def blobs(tmp_path):
    return str(tmp_path / "blobs")


@pytest.fixture
def farm_store(redis_server, blobs):
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    yield store
    store.close()


def _blob_files(blobs):
    return sorted(n for n in os.listdir(blobs) if n.endswith(".blob"))


def test_trajectories_live_in_the_folder_under_their_hash_and_redis_holds_none(farm_store, redis_server, blobs):
    import redis
    entry = _put(farm_store, 1, elems=1 << 19)          # a 1 MB trajectory
    record = farm_store.record(entry)
    assert _blob_files(blobs) == [record.blob_sha256 + ".blob"]
    with open(os.path.join(blobs, record.blob_sha256 + ".blob"), "rb") as handle:
        data = handle.read()
    assert data.startswith(header(farm_store._backend._folder.identity))   # the content proves whose it is
    assert hashlib.sha256(data[HEADER_BYTES:]).hexdigest() == record.blob_sha256
    admin = redis.Redis.from_url(redis_server.url)
    assert admin.keys("carnator:b:*") == []
    assert sum(admin.memory_usage(k) or 0 for k in admin.keys("carnator:*")) < 200_000
    other = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)   # a second worker
    assert bool((other.trajectory(other.record(entry)).checkpoints[4] == 1.0).all())
    other.close()


def test_a_store_is_bound_to_its_layout(farm_store, redis_server, tmp_path, blobs):
    _put(farm_store)
    with pytest.raises(StoreError, match="keeps its trajectories in a shared blob folder.*give blob_dir"):
        CarnatorStore(redis_server.url, 64 << 20)
    elsewhere = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(tmp_path / "another"))
    with pytest.raises(StoreUnavailable, match="is the shared folder mounted"):   # its farm exists: a dropped mount
        elsewhere.stats()
    assert not (tmp_path / "another").exists()                                     # never marked, never made
    with pytest.raises(StoreError, match="is for a redis:// cache"):
        CarnatorStore(str(tmp_path / "disk"), 64 << 20, blob_dir=blobs)
    with pytest.raises(StoreError, match="not an absolute folder path"):
        CarnatorStore(redis_server.url, 64 << 20, blob_dir="relative/blobs")


def test_a_redis_only_store_with_entries_is_not_turned_into_a_farm(redis_server, tmp_path):
    plain = CarnatorStore(redis_server.url, 64 << 20)
    _put(plain)
    plain.close()
    with pytest.raises(StoreError, match="holds Redis-only entries"):
        CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(tmp_path / "blobs"))


def test_a_folder_that_is_not_carnators_is_refused_and_untouched(redis_server, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"jpeg")
    with pytest.raises(StoreError, match="not a Carnator store"):
        CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(folder))
    assert os.listdir(folder) == ["holiday.jpg"]


def test_a_damaged_blob_is_reported_and_the_request_is_generated_in_full(redis_server, blobs, tiny_model):
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    sigmas, config = flow_sigmas(12), CarnatorConfig(probe_steps=2)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(1))
    runner = TinyDiTRunner(tiny_model, "a red circle")
    first = generate(runner, noise, sigmas, store, config)
    store.writer.settle()
    [name] = _blob_files(blobs)
    path = os.path.join(blobs, name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF                                     # one flipped byte in the middle
    with open(path, "wb") as handle:
        handle.write(data)
    again = generate(runner, noise * 1.0001, sigmas, store, config)
    assert not again.decision.reuse and again.model_calls == 12
    assert any(first.entry_id in w and "checksum" in w for w in again.warnings)
    with pytest.raises(CorruptEntryError):
        store.trajectory(store.record(first.entry_id))
    store.close()


def test_a_released_blob_waits_for_its_grace_period_and_a_shared_one_stays(farm_store, blobs, monkeypatch):
    first = _put(farm_store, 1)
    record = farm_store.record(first)
    twin = _put(farm_store, 1)                                      # the same trajectory: the same file
    assert len(_blob_files(blobs)) == 1
    assert farm_store.delete(first)
    farm_store._backend.collect()
    assert len(_blob_files(blobs)) == 1                              # still referenced by the twin
    assert farm_store.delete(twin)
    assert farm_store.trajectory(record).checkpoints[4][0, 0] == 1.0  # a reader in flight still reads it whole
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    farm_store._backend.collect()
    assert _blob_files(blobs) == []


def test_a_blob_released_and_written_again_is_not_collected(farm_store, blobs, monkeypatch):
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    gone = _put(farm_store, 2)
    farm_store.delete(gone)                                         # collected at once (grace 0)
    assert _blob_files(blobs) == []
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 3600)
    kept = _put(farm_store, 3)
    farm_store.delete(_put(farm_store, 3))                          # one of two references released
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    farm_store._backend.collect()
    assert farm_store.trajectory(farm_store.record(kept)).checkpoints[4][0, 0] == 3.0


def test_a_writer_waits_for_a_collectors_tombstone_then_writes_the_file_again(farm_store, blobs, redis_server):
    import redis
    entry = _put(farm_store, 4)
    name = farm_store.record(entry).blob_sha256 + ".blob"
    farm_store.delete(entry)
    admin = redis.Redis.from_url(redis_server.url)
    admin.set(f"carnator:x:{name}", "1", px=300)                   # a collector deleting this very blob
    os.remove(os.path.join(blobs, name))
    started = time.monotonic()
    again = _put(farm_store, 4)
    assert time.monotonic() - started >= 0.2
    assert farm_store.trajectory(farm_store.record(again)).checkpoints[4][0, 0] == 4.0


def test_killed_writes_are_reclaimed_and_foreign_files_never_touched(redis_server, blobs):
    import redis
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    kept = _put(store, 5)
    mine = header(store._backend._folder.identity)
    store.close()
    orphan, young = "a" * 64 + ".blob", "b" * 64 + ".blob"          # killed writers' files: old, and in flight
    temporary = "a" * 64 + ".blob.0123abcd.tmp"
    foreign = {"notes.txt": b"mine", "d" * 63 + ".blob": b"not ours", "e" * 64 + ".blob.txt": b"mine too",
               "9" * 64 + ".blob": b"named like ours, never written by it"}
    for name, data in {orphan: mine + b"x" * 1000, young: mine + b"y" * 2000, temporary: mine + b"z" * 10,
                       **foreign}.items():
        with open(os.path.join(blobs, name), "wb") as handle:
            handle.write(data)
    os.mkdir(os.path.join(blobs, "f" * 64 + ".blob"))               # a folder under a blob's name
    os.symlink("/etc/hostname", os.path.join(blobs, "1" * 64 + ".blob"))
    for name in [orphan, temporary, "f" * 64 + ".blob", *foreign]:
        os.utime(os.path.join(blobs, name), (OLD, OLD))
    admin = redis.Redis.from_url(redis_server.url)                  # the writes their writers registered
    admin.zadd("carnator:w", {orphan: OLD, young: time.time(), "f" * 64 + ".blob": OLD, "1" * 64 + ".blob": OLD})
    admin.hset("carnator:wb", mapping={orphan: 1047, young: 2047})
    reopened = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    present = set(os.listdir(blobs))
    assert orphan not in present and temporary not in present and young in present
    assert {*foreign, "f" * 64 + ".blob", "1" * 64 + ".blob", "carnator-store.json"} <= present
    for name, data in foreign.items():
        assert open(os.path.join(blobs, name), "rb").read() == data
    assert reopened.stats()["overhead_bytes"] == 2047               # the write in flight counts in the size limit
    assert reopened.trajectory(reopened.record(kept)).checkpoints[4][0, 0] == 5.0
    reopened.close()


def test_the_size_limit_counts_the_blobs(redis_server, blobs):
    store = CarnatorStore(redis_server.url, 3 << 20, blob_dir=blobs)
    for seed in range(5):
        _put(store, seed, elems=1 << 19)                            # 1 MiB each
    assert 1 <= store.stats()["entries"] <= 2
    store.close()


def test_a_full_folder_costs_the_write_back_never_the_request(farm_store, blobs, tiny_model, monkeypatch):
    from carnator_engine.store.backends import blob_folder
    real_fsync = os.fsync

    def full(descriptor):
        if os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")).endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(descriptor)
    monkeypatch.setattr(blob_folder.os, "fsync", full)
    with pytest.raises(StoreError, match="full"):
        _put(farm_store, 6)
    sigmas, config = flow_sigmas(12), CarnatorConfig(probe_steps=2)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(2))
    result = generate(TinyDiTRunner(tiny_model, "a red circle"), noise, sigmas, farm_store, config)
    farm_store.writer.settle()
    assert result.model_calls == 12 and result.latent.isfinite().all()
    assert any("full" in p for p in farm_store.drain_problems() + result.warnings)
    assert farm_store.stats()["entries"] == 0
    assert [n for n in os.listdir(blobs) if n != "carnator-store.json"] == []   # no temporary left behind


def test_the_cli_reads_a_farm(farm_store, redis_server, blobs):
    _put(farm_store, 7)
    done = subprocess.run([sys.executable, "-m", "carnator_engine", "stats", "--cache", redis_server.url,
                           "--blob-dir", blobs], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert '"entries": 1' in done.stdout and blobs in done.stdout


def test_the_cache_browser_reopens_a_farm_after_a_restart(redis_server, blobs, tmp_path, monkeypatch):
    routes = pytest.importorskip("nodes.routes", reason="nodes.routes does not import here")
    from nodes import stores
    monkeypatch.setattr(stores, "_stores", {})
    monkeypatch.setattr(stores, "user_directory", lambda: str(tmp_path / "user"))
    opened = stores.open_store(redis_server.url, 32 << 20, blob_dir=blobs)
    _put(opened, 8)
    location = opened.location
    opened.close()
    monkeypatch.setattr(stores, "_stores", {})                      # a restart: nothing opened yet
    reopened = routes.resolve_store(location)
    assert reopened.location == location and reopened.size_limit_bytes == 32 << 20
    [entry] = routes.list_entries(reopened)["entries"]
    assert reopened.trajectory(reopened.record(entry["id"])).checkpoints[4][0, 0] == 8.0
    reopened.close()
