"""The farm layout (backends/farm.py) on a real Redis and a real folder: trajectories in the folder, a file of its
own per write, none in Redis, the store bound to its layout, a damaged blob reported and the request generated
in full, garbage collection that waits for grace periods and never costs another entry its file, foreign files
never touched, a full folder that costs a request its write-back, never the request."""
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


def _leases_run_out(url: str) -> None:
    """What ORPHAN_GRACE_SECONDS by Redis's clock does to a killed writer's lease: it expires."""
    import redis
    admin = redis.Redis.from_url(url)
    for key in admin.scan_iter(match="carnator:wl:*"):
        admin.delete(key)


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


def _record(admin, name: str) -> list:
    """The farm's record of blob file `name`: [nonce, entry id, bytes, ...]."""
    return admin.get(f"carnator:n:{name}").decode().split()


def test_trajectories_live_in_the_folder_a_file_per_write_and_redis_holds_none(farm_store, redis_server, blobs):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    entry = _put(farm_store, 1, elems=1 << 19)          # a 1 MB trajectory
    record = farm_store.record(entry)
    [name] = _blob_files(blobs)
    assert len(name) == 32 + len(".blob") and admin.get(f"carnator:f:{entry}").decode() == name
    with open(os.path.join(blobs, name), "rb") as handle:
        data = handle.read()
    nonce, owner_entry, size = _record(admin, name)
    assert owner_entry == entry and int(size) == len(data)
    assert data.startswith(header(nonce)) and nonce != farm_store._backend._folder.identity   # a secret per file
    assert hashlib.sha256(data[HEADER_BYTES:]).hexdigest() == record.blob_sha256
    twin = _put(farm_store, 1, elems=1 << 19)           # the same bytes: a file of its own all the same
    assert len(_blob_files(blobs)) == 2 and admin.get(f"carnator:f:{twin}").decode() != name
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


def test_a_released_blob_waits_for_its_grace_period(farm_store, blobs, monkeypatch):
    first = _put(farm_store, 1)
    record = farm_store.record(first)
    twin = _put(farm_store, 1)                                      # the same trajectory: another file
    assert farm_store.delete(first)
    farm_store._backend.collect()
    assert len(_blob_files(blobs)) == 2                              # in its grace period
    assert farm_store.trajectory(record).checkpoints[4][0, 0] == 1.0  # a reader in flight still reads it whole
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    farm_store._backend.collect()
    assert len(_blob_files(blobs)) == 1
    assert farm_store.trajectory(farm_store.record(twin)).checkpoints[4][0, 0] == 1.0


def _paused_collector(url: str, blobs: str, paused, resume) -> int:
    """A worker whose collection stops between its decision and its unlink (a VM pause, a hung network unlink)
    until `resume`; the bytes it freed."""
    from carnator_engine.store.backends import blob_folder
    real_free = blob_folder.BlobFolder.free

    def free(self, name, nonce):
        paused.set()
        assert resume.wait(120)
        return real_free(self, name, nonce)
    blob_folder.BlobFolder.free = free
    farm.BLOB_GRACE_SECONDS = 0
    store = CarnatorStore(url, 64 << 20, blob_dir=blobs)               # its open collects
    freed = store.orphan_bytes_reclaimed + store._backend.collect()[1]
    store.close()
    return freed


def test_a_collector_paused_before_its_unlink_costs_no_newer_entry_its_file(redis_server, blobs):
    import multiprocessing
    fork = multiprocessing.get_context("fork")
    writer = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    gone = _put(writer, 2)
    writer.delete(gone)                                             # released
    paused, resume, answers = fork.Event(), fork.Event(), fork.Queue()
    collector = fork.Process(target=lambda: (torch.set_num_threads(1), answers.put(
        _paused_collector(redis_server.url, blobs, paused, resume))))
    collector.start()
    assert paused.wait(120)                                         # it decided to delete the released file ...
    again = _put(writer, 2)                                         # ... and the same content is stored again
    resume.set()
    assert answers.get(timeout=120) > 0
    collector.join(timeout=60)
    assert writer.trajectory(writer.record(again)).checkpoints[4][0, 0] == 2.0
    assert writer.drain_problems() == []
    writer.close()


def test_killed_writes_are_reclaimed_and_foreign_files_never_touched(redis_server, blobs):
    import redis
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    kept = _put(store, 5)
    marker_header = header(store._backend._folder.identity)         # anyone can copy it from the marker
    store.close()
    admin = redis.Redis.from_url(redis_server.url)
    orphan, young = "a" * 32 + ".blob", "b" * 32 + ".blob"          # killed writers' files: old, and in flight
    replaced, copied = "c" * 32 + ".blob", "d" * 32 + ".blob"       # a user's file in a registered file's place,
    legacy, legacy_temporary = "e" * 64 + ".blob", "e" * 64 + ".blob.0123abcd.tmp"   # and one with the marker's
    foreign = {"notes.txt": b"mine", "d" * 63 + ".blob": b"not ours", "e" * 64 + ".blob.txt": b"mine too",
               "9" * 32 + ".blob": b"named like ours, never written by it", replaced: b"the user's own bytes",
               copied: marker_header + b"a header copied from the marker"}
    files = {orphan: header("1" * 32) + b"x" * 1000, young: header("2" * 32) + b"y" * 2000,
             legacy: marker_header + b"z" * 10, legacy_temporary: marker_header + b"t", **foreign}
    for name, data in files.items():
        with open(os.path.join(blobs, name), "wb") as handle:
            handle.write(data)
    os.mkdir(os.path.join(blobs, "f" * 32 + ".blob"))               # a folder under a blob's name
    os.symlink("/etc/hostname", os.path.join(blobs, "8" * 32 + ".blob"))
    for name in [orphan, legacy, legacy_temporary, "f" * 32 + ".blob", *foreign]:
        os.utime(os.path.join(blobs, name), (OLD, OLD))
    # The writes their writers registered (each with its nonce), the worst case for every other name: registered
    # as a killed write, but with another nonce, or none.
    records = {orphan: "1" * 32, young: "2" * 32, replaced: "3" * 32, "f" * 32 + ".blob": "4" * 32,
               "8" * 32 + ".blob": "5" * 32}
    for name, nonce in records.items():
        admin.set(f"carnator:n:{name}", f"{nonce} 0123456789abcdef {len(files.get(name, b''))}")
    admin.zadd("carnator:w", {name: OLD for name in [*records, copied, legacy, "9" * 32 + ".blob"]})
    admin.set(f"carnator:wl:{young}", 1, ex=600)    # in flight: its lease runs, whatever date the write shows
    admin.hset("carnator:wb", mapping={orphan: 1047, young: 2047})
    reopened = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    present = set(os.listdir(blobs))
    assert {orphan, legacy, legacy_temporary} & present == set() and young in present
    assert {*foreign, "f" * 32 + ".blob", "8" * 32 + ".blob", "carnator-store.json"} <= present
    for name, data in foreign.items():
        assert open(os.path.join(blobs, name), "rb").read() == data
    assert reopened.stats()["overhead_bytes"] == 2047               # the write in flight counts in the size limit
    assert reopened.trajectory(reopened.record(kept)).checkpoints[4][0, 0] == 5.0
    assert admin.get(f"carnator:n:{orphan}") is None and admin.get(f"carnator:n:{young}") is not None
    reopened.close()


def test_a_file_someone_put_at_a_new_blobs_name_is_never_overwritten(farm_store, blobs, monkeypatch):
    import uuid
    taken = "7" * 32
    os.symlink("/etc/hostname", os.path.join(blobs, taken + ".blob"))   # a link, and a file, at the next names
    with open(os.path.join(blobs, "6" * 32 + ".blob"), "wb") as handle:
        handle.write(b"someone's")
    names = iter([uuid.UUID(taken), uuid.UUID("1" * 32), uuid.UUID("6" * 32), uuid.UUID("2" * 32)])
    real = uuid.uuid4
    monkeypatch.setattr(farm.uuid, "uuid4", lambda: next(names, None) or real())
    entry = _put(farm_store, 3)
    assert farm_store.trajectory(farm_store.record(entry)).checkpoints[4][0, 0] == 3.0
    assert os.readlink(os.path.join(blobs, taken + ".blob")) == "/etc/hostname"
    assert open(os.path.join(blobs, "6" * 32 + ".blob"), "rb").read() == b"someone's"
    assert open("/etc/hostname", "rb").read()[:len(HEADER_BYTES * b"x")] != header("1" * 32)


def test_a_file_put_in_place_of_an_entrys_blob_is_never_deleted(farm_store, blobs, redis_server, monkeypatch):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    entry = _put(farm_store, 4)
    name = admin.get(f"carnator:f:{entry}").decode()
    mine = farm_store._backend._folder.identity
    path = os.path.join(blobs, name)
    os.remove(path)
    with open(path, "wb") as handle:                                # the user's file, header copied from the marker
        handle.write(header(mine) + b"the user's own bytes")
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    farm_store.delete(entry)
    assert open(path, "rb").read() == header(mine) + b"the user's own bytes"
    assert admin.get(f"carnator:n:{name}") is None                   # forgotten: no longer counted as ours


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
        if os.path.basename(os.readlink(f"/proc/self/fd/{descriptor}")).endswith(".blob"):
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


def test_a_farms_blob_folder_is_refused_as_a_folder_cache_and_nothing_is_written(farm_store, redis_server, blobs,
                                                                                 tmp_path, monkeypatch):
    """cache_dir set to a farm's blob folder (blob_dir empty) would write a folder store beside the farm's blobs,
    and every worker of the farm would then refuse the folder: refused when the prompt is checked and when a store
    is opened, naming the farm, with nothing written."""
    from pathlib import Path
    from nodes import stores
    from test_store_marker import folder_state
    entry = _put(farm_store, 3)
    monkeypatch.setattr(stores, "_stores", {})
    monkeypatch.setattr(stores, "user_directory", lambda: str(tmp_path / "user"))
    before = folder_state(Path(blobs))
    refused = r"is the blob folder of a farm \(store [0-9a-f]{8}\.\.\., Redis redis://.*set cache_dir to its redis://"
    for open_it in (lambda: stores.check_cache_dir(blobs), lambda: stores.open_store(blobs, 64 << 20),
                    lambda: CarnatorStore(blobs, 64 << 20)):
        with pytest.raises(StoreError, match=refused):
            open_it()
        assert folder_state(Path(blobs)) == before
    worker = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)    # the farm's workers still open it
    assert bool((worker.trajectory(worker.record(entry)).checkpoints[4] == 3.0).all())
    worker.close()


def test_a_folder_away_for_a_moment_costs_a_read_nothing(farm_store, monkeypatch):
    from carnator_engine.store.backends import blob_folder
    entry = _put(farm_store, 6)
    real_read, reads = blob_folder.BlobFolder.read, []

    def read(self, name, limit=None):          # the first read finds the empty mount point, the folder is back right after
        reads.append(name)
        return None if len(reads) == 1 else real_read(self, name, limit)
    monkeypatch.setattr(blob_folder.BlobFolder, "read", read)
    assert farm_store.trajectory(farm_store.record(entry)).checkpoints[4][0, 0] == 6.0
    assert not farm_store.record(entry).corrupt and farm_store.drain_problems() == []


def _as_made_before_per_write_files(store, admin, blobs, entries) -> set:
    """Rewrites `entries` as a farm of an older Carnator kept them: plain-JSON metadata (no checksum), no sizes in
    Redis, the blob in a file named by its SHA-256 (shared by equal blobs) with the folder's identity as header,
    its entries listed in r:<name>. The legacy names."""
    names = set()
    for entry in entries:
        admin.set(f"carnator:m:{entry}", admin.get(f"carnator:m:{entry}").partition(b"\n")[2])
        name = admin.get(f"carnator:f:{entry}").decode()
        path = os.path.join(blobs, name)
        data = open(path, "rb").read()[HEADER_BYTES:]
        legacy = hashlib.sha256(data).hexdigest() + ".blob"
        with open(os.path.join(blobs, legacy), "wb") as handle:
            handle.write(header(store._backend._folder.identity) + data)
        os.remove(path)
        admin.delete(f"carnator:n:{name}")
        admin.set(f"carnator:f:{entry}", legacy)
        admin.sadd(f"carnator:r:{legacy}", entry)
        names.add(legacy)
    admin.delete("carnator:sz", "carnator:bytes")
    return names


def test_a_farm_made_before_per_write_files_is_read_evicted_and_freed(redis_server, blobs, monkeypatch):
    import redis
    admin = redis.Redis.from_url(redis_server.url)
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    entries = [_put(store, seed % 2, elems=1 << 18) for seed in range(4)]   # two pairs of equal blobs
    store.close()
    legacy = _as_made_before_per_write_files(store, admin, blobs, entries)
    assert set(_blob_files(blobs)) == legacy and len(legacy) == 2
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    old = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    for seed, entry in enumerate(entries):
        assert old.trajectory(old.record(entry)).checkpoints[4][0, 0] == seed % 2
    size = old.record(entries[0]).size_bytes
    assert old._backend.total_bytes() == 4 * size                        # counted from the old metadata
    new = _put(old, 5, elems=1 << 18)
    assert len(old.set_size_limit(3 * size)) == 2                          # two leave: the limit, not more
    assert old._backend.total_bytes() == 3 * size == sum(r.size_bytes for r in old.records())
    for entry in [e for e in entries if e in {r.entry_id for r in old.records()}]:
        old.delete(entry)
    assert _blob_files(blobs) == [admin.get(f"carnator:f:{new}").decode()]   # each legacy file once unreferenced
    old.close()
