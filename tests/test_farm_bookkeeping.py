"""The farm layout keeps what it holds: its own bookkeeping (eviction, garbage collection, clear, an open) never
destroys a live entry or someone else's file, on a real Redis and a real folder (a real tmpfs or bind mount where
this machine lets the test mount one), with forked workers where two workers matter: an open never evicts for
files that wait for collection, the folder stays within its limit for every worker, a second farm is refused, a
dropped mount is a fault (nothing marked corrupt, nothing written into the mount point), a full disk gets its
released files back, a lost Redis neither locks workers out nor costs a file, an unreachable Redis opens a store
that generates in full and reconnects, clear() racing writers leaves nothing unreachable, and files named like
Carnator's are kept unless their content proves they are its own."""
import errno
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, generate
from carnator_engine.schedule import flow_sigmas
from carnator_engine.store import CarnatorStore, StoreError
from carnator_engine.store import store as store_module
from carnator_engine.store.backends import farm
from carnator_engine.store.errors import StoreUnavailable
from carnator_engine.store.marker import MARKER_FILE
from carnator_engine.store.owned_files import header
from test_farm_backend import _leases_run_out, _put

FORK = multiprocessing.get_context("fork")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = 600_000                      # float16 elements: a 1.2 MB trajectory
OLD = time.time() - 7 * 24 * 3600    # a week ago: past every grace period


def _folder_bytes(blobs) -> int:
    return sum(os.path.getsize(os.path.join(blobs, n)) for n in os.listdir(blobs) if n.endswith(".blob"))


def _in_child(target, *args):
    """Runs target(*args) in a forked worker process; what it returned."""
    answers = FORK.Queue()

    def run():
        torch.set_num_threads(1)   # an OpenMP pool the parent started hangs a forked child that uses it
        answers.put(target(*args))
    process = FORK.Process(target=run)
    process.start()
    answer = answers.get(timeout=120)
    process.join(timeout=60)
    assert process.exitcode == 0
    return answer


def _fill(url: str, blobs: str, limit: int, count: int) -> list:
    """A worker that writes `count` 1.2 MB entries into a farm of `limit` bytes; the ids still stored after."""
    store = CarnatorStore(url, limit, blob_dir=blobs)
    for seed in range(count):
        _put(store, seed, elems=ENTRY)
    kept = sorted(r.entry_id for r in store.records())
    store.close()
    return kept


def test_an_open_never_evicts_live_entries_for_files_waiting_for_collection(redis_server, tmp_path):
    blobs, limit = str(tmp_path / "blobs"), 20 << 20
    live = _in_child(_fill, redis_server.url, blobs, limit, 40)            # worker A: 40 x 1.2 MB into 20 MiB
    assert 10 <= len(live) <= 17
    second = CarnatorStore(redis_server.url, limit, blob_dir=blobs)         # worker B opens
    assert sorted(r.entry_id for r in second.records()) == live             # nothing evicted at its open
    _put(second, 1000, elems=ENTRY)
    assert len(set(live) - {r.entry_id for r in second.records()}) <= 1     # one put makes room for one entry
    second.close()


def test_the_folder_stays_within_the_limit_for_every_worker(redis_server, tmp_path):
    blobs, limit = str(tmp_path / "blobs"), 20 << 20
    watching = CarnatorStore(redis_server.url, limit, blob_dir=blobs)       # a worker open all along
    _in_child(_fill, redis_server.url, blobs, limit, 40)
    on_disk = _folder_bytes(blobs)
    assert on_disk <= limit + 1.3e6, on_disk                                # the limit and one entry, at most
    stats = watching.stats()
    assert abs(stats["bytes"] - on_disk) <= 0.1 * on_disk                   # what it counts is what is there
    watching.close()


def test_a_second_farm_on_the_same_folder_is_refused_and_touches_nothing(redis_server, tmp_path):
    import redis
    blobs = str(tmp_path / "blobs")
    first = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    entries = [_put(first, seed) for seed in range(4)]
    before = {n: os.path.getmtime(os.path.join(blobs, n)) for n in os.listdir(blobs)}
    other_db = redis_server.url[:-1] + "1"                                  # an empty database of the server
    with pytest.raises(StoreError, match="belongs to the farm .* holds no Carnator store.*Give each farm a folder of "
                                         "its own") as caught:
        CarnatorStore(other_db, 64 << 20, blob_dir=blobs)
    assert "\n" not in str(caught.value)
    redis.Redis.from_url(redis_server.url[:-1] + "2").set("carnator:store", "f" * 32)   # another farm's Redis
    with pytest.raises(StoreError, match="belongs to another farm"):
        CarnatorStore(redis_server.url[:-1] + "2", 64 << 20, blob_dir=blobs)
    assert {n: os.path.getmtime(os.path.join(blobs, n)) for n in os.listdir(blobs)} == before
    for entry in entries:
        assert first.trajectory(first.record(entry)).checkpoints
    assert first.drain_problems() == []
    first.close()


def _mount(source, target) -> bool:
    """Bind-mounts `source` at `target` where this machine allows it (root, no container veto)."""
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True).returncode == 0


def _unmount(target, mounted: bool, source) -> None:
    """The folder gone from `target`, as an unmounted share leaves it: the empty mount point."""
    if mounted:
        subprocess.run(["umount", str(target)], check=True)
    else:
        os.rename(target, str(source) + ".away")
        os.mkdir(target)


def _remount(target, mounted: bool, source) -> None:
    if mounted:
        assert _mount(source, target)
    else:
        os.rmdir(target)
        os.rename(str(source) + ".away", target)


@pytest.fixture
def share_mount(tmp_path):
    """(the shared folder, its mount point, whether it is bind-mounted there); unmounted at the end (if still)."""
    share, blobs = tmp_path / "share", tmp_path / "mnt"
    share.mkdir()
    blobs.mkdir()
    mounted = _mount(share, blobs)
    yield share, blobs, mounted
    if mounted:
        subprocess.run(["umount", str(blobs)], capture_output=True)


def test_a_dropped_mount_is_a_fault_never_damage_and_nothing_is_written_into_the_mount_point(redis_server,
                                                                                             share_mount, tiny_model):
    share, blobs, mounted = share_mount
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(blobs))
    entries = [_put(store, seed) for seed in range(4)]
    _unmount(blobs, mounted, share)
    for entry in entries:
        with pytest.raises(StoreUnavailable, match="mounted"):
            store.trajectory(store.record(entry))
    with pytest.raises(StoreUnavailable, match="mounted"):
        _put(store, 9)
    during = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(blobs))   # a worker started meanwhile
    runner, sigmas = TinyDiTRunner(tiny_model, "a red circle"), flow_sigmas(12)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(3))
    result = generate(runner, noise, sigmas, during, CarnatorConfig(probe_steps=2))
    assert result.model_calls == 12 and any("mounted" in w for w in result.warnings)
    assert os.listdir(blobs) == []                                     # no marker, no blob in the mount point
    _remount(blobs, mounted, share)
    assert all(not r.corrupt for r in store.records(include_corrupt=True))
    for entry in entries:
        assert store.trajectory(store.record(entry)).checkpoints
    store.close()
    during.close()


def _tmpfs(path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_folder_gets_the_space_of_released_blobs_back_at_once(redis_server, tmp_path, monkeypatch):
    blobs = tmp_path / "blobs"
    mounted = _tmpfs(blobs, "4m")
    try:
        if not mounted:   # no tmpfs here: a disk of 4 MiB, as the folder's bytes say
            from carnator_engine.store import owned_files
            real_fsync = os.fsync

            def fsync(descriptor):
                if _folder_bytes(blobs) + sum(os.path.getsize(blobs / n) for n in os.listdir(blobs)
                                              if n.endswith(".tmp")) > 4 << 20:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_fsync(descriptor)
            monkeypatch.setattr(owned_files.os, "fsync", fsync)
        store = CarnatorStore(redis_server.url, 1 << 40, blob_dir=str(blobs))   # the limit is not what binds
        entries = [_put(store, seed, elems=ENTRY) for seed in range(3)]         # 3.6 MB of 4 MiB
        for entry in entries[:2]:
            store.delete(entry)                                                 # released, in their grace period
        assert _folder_bytes(blobs) > 3e6
        again = _put(store, 10, elems=ENTRY)                                    # ENOSPC: collected, then written
        assert store.trajectory(store.record(again)).checkpoints[4][0, 0] == 10.0
        assert store.trajectory(store.record(entries[2])).checkpoints[4][0, 0] == 2.0
        store.close()
    finally:
        if mounted:
            subprocess.run(["umount", str(blobs)], check=True)


def test_another_server_at_the_same_address_is_refused_and_touches_nothing(redis_server, tmp_path):
    from redis_server import RedisServer
    blobs = str(tmp_path / "blobs")
    first = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    entries = [_put(first, seed) for seed in range(6)]
    first.close()
    before = {n: open(os.path.join(blobs, n), "rb").read() for n in os.listdir(blobs)}
    redis_server.stop()                                                     # another host's own Redis, which
    other = RedisServer(str(tmp_path / "other-redis"), appendonly=True)     # reads redis://127.0.0.1:PORT/0 too
    other.port = redis_server.port
    other.start()
    try:
        for _ in range(2):                                                  # refused, every time
            with pytest.raises(StoreError, match="holds no Carnator store: another server"):
                CarnatorStore(other.url, 64 << 20, blob_dir=blobs)
        assert {n: open(os.path.join(blobs, n), "rb").read() for n in os.listdir(blobs)} == before
    finally:
        other.stop()
    redis_server.start()
    back = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    for entry in entries:
        assert back.trajectory(back.record(entry)).checkpoints
    back.close()


def test_redis_losing_its_data_locks_no_running_worker_out_and_costs_no_file(redis_server, tmp_path, monkeypatch):
    import redis
    blobs = str(tmp_path / "blobs")
    running = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    for seed in range(3):
        _put(running, seed)
    files_before = set(os.listdir(blobs))
    admin = redis.Redis.from_url(redis_server.url)
    admin.flushall()                                                        # the farm's Redis loses its data
    after = _put(running, 7)                                                # a running worker goes on writing
    with pytest.raises(StoreError, match="keeps its trajectories in a shared blob folder"):
        CarnatorStore(redis_server.url, 64 << 20)                           # refused, never reads and marks
    monkeypatch.setattr(farm, "ORPHAN_GRACE_SECONDS", 0)
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    joining = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)     # a new worker is let in
    assert joining.trajectory(joining.record(after)).checkpoints[4][0, 0] == 7.0
    joining.close()
    redis_server.stop(kill=True)                                            # and a restart without its data:
    for name in os.listdir(redis_server.directory):
        if name.startswith("appendonly"):
            subprocess.run(["rm", "-rf", os.path.join(redis_server.directory, name)], check=True)
    redis_server.start()
    with pytest.raises(StoreError, match="after a data loss, run once: python -m carnator_engine reattach"):
        CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)          # no guess from the URL's text
    done = subprocess.run([sys.executable, "-m", "carnator_engine", "reattach", "--cache", redis_server.url,
                           "--blob-dir", blobs], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)       # the farm's identity, on your word
    assert fresh._backend.identity == running._backend.identity
    _put(fresh, 8)
    assert files_before <= set(os.listdir(blobs))                           # not one of the farm's files deleted
    assert fresh.drain_problems() == [] and running.drain_problems() == []
    fresh.close()
    running.close()


def test_an_unreachable_redis_opens_a_store_that_generates_in_full_and_reconnects(tmp_path, tiny_model,
                                                                                  monkeypatch):
    from nodes import stores
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    monkeypatch.setattr(stores, "_stores", {})
    monkeypatch.setattr(stores, "user_directory", lambda: str(tmp_path / "user"))
    server = RedisServer(str(tmp_path / "redis"), appendonly=True)          # its port chosen, not started
    blobs = tmp_path / "blobs"
    store = stores.open_store(server.url, 64 << 20, str(blobs))             # what the Carnator Cache node calls
    assert not blobs.exists()                                               # nothing marked before it is reached
    assert stores.open_store(server.url, 32 << 20, str(blobs)) is store     # a node run with another limit too
    runner, sigmas, config = TinyDiTRunner(tiny_model, "a red circle"), flow_sigmas(12), CarnatorConfig(probe_steps=2)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(4))
    result = generate(runner, noise, sigmas, store, config)
    store.writer.settle()
    assert result.model_calls == 12 and result.latent.isfinite().all()
    assert any("cannot be reached" in w for w in result.warnings + store.drain_problems())
    server.start()
    try:
        monkeypatch.setattr(store_module, "RECONNECT_SECONDS", 0)
        store._retry_at = 0.0
        first = generate(runner, noise, sigmas, store, config)
        store.writer.settle()
        again = generate(runner, noise * 1.0001, sigmas, store, config)
        assert first.entry_id and again.decision.reuse and again.decision.entry_id == first.entry_id
        assert (blobs / MARKER_FILE).exists()
        store.close()
    finally:
        server.stop()


def _writer(url: str, blobs: str, stop) -> int:
    store = CarnatorStore(url, 1 << 40, blob_dir=blobs)
    count = 0
    while not stop.is_set():
        _put(store, count, elems=100)
        count += 1
    store.close()
    return count


@pytest.mark.parametrize("layout", ["redis-only", "farm"])
def test_clear_racing_a_writer_leaves_nothing_unreachable(redis_server, tmp_path, monkeypatch, layout):
    import redis
    from carnator_engine.store.backends.redis_store import RedisBackend
    blobs = str(tmp_path / "blobs") if layout == "farm" else ""
    admin = redis.Redis.from_url(redis_server.url)
    clearing = CarnatorStore(redis_server.url, 1 << 40, blob_dir=blobs)
    listed = RedisBackend.entry_ids

    def entry_ids(self):   # the race made certain: the writer commits between clear's listing and its deletions
        ids = listed(self)
        count = admin.scard("carnator:ids")
        deadline = time.time() + 10
        while admin.scard("carnator:ids") <= count and time.time() < deadline:
            time.sleep(0.005)
        return ids
    monkeypatch.setattr(RedisBackend, "entry_ids", entry_ids)
    stop, answers = FORK.Event(), FORK.Queue()
    writer = FORK.Process(target=lambda: (torch.set_num_threads(1), answers.put(_writer(redis_server.url, blobs,
                                                                                        stop))))
    writer.start()
    for _ in range(5):
        clearing.clear()
    stop.set()
    assert answers.get(timeout=60) >= 5
    writer.join(timeout=60)
    ids = {i.decode() for i in admin.smembers("carnator:ids")}
    for kind in "msbt":                                                     # every entry's keys are listed
        assert {k.decode().split(":")[2] for k in admin.keys(f"carnator:{kind}:*")} <= ids
    if layout == "farm":
        named = {k.decode().split(":")[2] for k in admin.keys("carnator:f:*") if admin.ttl(k) == -1}
        assert named <= ids
        referring = {admin.get(f"carnator:f:{entry}").decode() for entry in ids}
        waiting = {n.decode() for n in admin.zrange("carnator:gc", 0, -1)}
        files = {n for n in os.listdir(blobs) if n.endswith(".blob")}
        assert files <= referring | waiting                                 # every file referenced or collectable
        assert all(admin.exists(f"carnator:n:{name}") for name in files)    # and recorded as the farm's
    clearing.close()


def test_files_named_like_carnators_are_kept_unless_their_content_proves_them_ours(redis_server, tmp_path):
    import redis
    blobs = tmp_path / "blobs"
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(blobs))
    kept = _put(store, 5)
    identity = store._backend._folder.identity
    store.close()
    foreign = {"a" * 64 + ".blob": b"someone's", "b" * 64 + ".blob.0123abcd.tmp": b"someone's too",
               "c" * 64 + ".blob": header("0" * 32) + b"another farm's"}
    ours = {"d" * 64 + ".blob": header(identity) + b"a killed write's", "e" * 64 + ".blob": header(identity) + b"x",
            "e" * 64 + ".blob.89abcdef.tmp": header(identity) + b"its temporary"}
    admin = redis.Redis.from_url(redis_server.url)
    for name, data in {**foreign, **ours}.items():
        (blobs / name).write_bytes(data)
        os.utime(blobs / name, (OLD, OLD))
    # The worst case for a name: each was registered as a write that never committed (a killed writer).
    stale = {name.split(".")[0] + ".blob" for name in {**foreign, **ours}}
    admin.zadd("carnator:w", {name: OLD for name in stale})
    reopened = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(blobs))
    present = set(os.listdir(blobs))
    assert set(foreign) <= present and not set(ours) & present
    for name, data in foreign.items():
        assert (blobs / name).read_bytes() == data
    assert reopened.trajectory(reopened.record(kept)).checkpoints[4][0, 0] == 5.0
    reopened.close()
    marker = json.loads((blobs / MARKER_FILE).read_text())
    assert marker["farm"] == reopened._backend.identity


def _evict_at_once(url: str, blobs: str, limit: int, seed: int, ready) -> list:
    """A worker that stores one entry, then evicts for it at the same moment as another worker (`ready`, a
    barrier both reach once each has decided it must evict); the ids it evicted."""
    from carnator_engine.store.eviction import EvictionQueue
    real_first, waited = EvictionQueue.first, []

    def first(self, skip=None):
        if not waited:
            waited.append(ready.wait(60))   # both decided: over the limit
        return real_first(self, skip)
    store = CarnatorStore(url, limit, blob_dir=blobs)
    enforce = CarnatorStore.enforce_size_limit
    CarnatorStore.enforce_size_limit = lambda self, keep=None: []   # the put alone, then both evict at once
    entry = _put(store, seed, elems=ENTRY)
    CarnatorStore.enforce_size_limit = enforce
    ready.wait(60)            # both entries stored
    EvictionQueue.first = first
    evicted = store.enforce_size_limit(keep=entry)
    store.close()
    return evicted


def test_workers_evicting_at_once_never_take_the_farm_below_its_limit(redis_server, tmp_path):
    blobs = str(tmp_path / "blobs")
    store = CarnatorStore(redis_server.url, 1 << 40, blob_dir=blobs)
    kept = [_put(store, seed, elems=ENTRY) for seed in range(5)]
    for entry in kept:                                   # each saved steps: the two new entries go first
        store.record_hit(entry, steps_saved=5)
    size = store.record(kept[0]).size_bytes
    limit = int(6.5 * size)                              # the five fit; with two more, one must leave, not two
    ready, answers = FORK.Barrier(2), FORK.Queue()
    workers = [FORK.Process(target=lambda seed=seed: (torch.set_num_threads(1), answers.put(
        _evict_at_once(redis_server.url, blobs, limit, seed, ready)))) for seed in (100, 101)]
    for worker in workers:
        worker.start()
    evicted = [answers.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(len(e) for e in evicted) == [0, 1]     # one eviction made room; the other found it made
    store.set_size_limit(1 << 40)
    held = sum(r.size_bytes for r in store.records())
    assert limit - size < held <= limit and set(kept) <= {r.entry_id for r in store.records()}
    store.close()


def test_a_worker_running_through_a_redis_rollback_forgets_the_lost_entries_and_hands_none_on(redis_server,
                                                                                               tmp_path):
    import shutil
    blobs = str(tmp_path / "blobs")
    running = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    before = [_put(running, seed) for seed in range(3)]
    aof = os.path.join(redis_server.directory, "appendonlydir")
    shutil.copytree(aof, str(tmp_path / "aof-then"))                       # what Redis will roll back to
    lost = [_put(running, seed) for seed in range(3, 5)]                    # the running worker's index has them
    redis_server.stop(kill=True)
    shutil.rmtree(aof)
    shutil.copytree(str(tmp_path / "aof-then"), aof)
    redis_server.start()                                                    # rolled back: those two are gone
    other = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    later = [_put(other, seed) for seed in range(5, 8)]                     # the log grows past the worker's cursor
    other.close()
    assert running.stats()["entries"] == len(before + later)
    assert {r.entry_id for r in running.records()} == set(before + later)
    running._unsaved = 1
    running.close()                                                         # its snapshot, as a worker leaves
    joining = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    assert set(joining._index.entries) == set(before + later) and not set(lost) & set(joining._index.entries)
    joining.close()


def _files(blobs) -> set:
    return {n for n in os.listdir(blobs) if n != MARKER_FILE}


def test_a_file_that_cannot_be_deleted_now_stays_listed_and_counted_until_it_can(redis_server, share_mount,
                                                                                   monkeypatch):
    from carnator_engine.store import owned_files
    share, blobs, mounted = share_mount
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=str(blobs))
    entries = [_put(store, seed, elems=ENTRY) for seed in range(3)]
    files = _files(blobs)
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    real_remove = os.remove

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(blobs)):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_remove(path, *args, **kwargs)
    monkeypatch.setattr(owned_files.os, "remove", read_only)          # the folder read-only for a while
    for entry in entries:
        store.delete(entry)
    assert _files(blobs) == files and store.stats()["overhead_bytes"] >= 3 * ENTRY * 2
    monkeypatch.setattr(owned_files.os, "remove", real_remove)
    _unmount(blobs, mounted, share)                                     # then gone for a while
    assert store._backend.collect() == (0, 0)
    _remount(blobs, mounted, share)
    assert _files(blobs) == files and store.stats()["overhead_bytes"] >= 3 * ENTRY * 2
    assert store._backend.collect()[0] == 3                             # back: deleted, no longer counted
    assert _files(blobs) == set() and store.stats()["overhead_bytes"] == 0
    store.close()


def _killed_in(url: str, blobs: str, work: str) -> None:
    """A worker killed (SIGKILL, as by the OOM killer) in the middle of `work`: "free" deletes a released file,
    "write" writes a blob."""
    torch.set_num_threads(1)   # an OpenMP pool the parent started hangs a forked child that uses it
    store = CarnatorStore(url, 64 << 20, blob_dir=blobs)
    real_fsync, real_remove = os.fsync, os.remove

    def fsync(descriptor):
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith(".blob"):
            os.kill(os.getpid(), 9)                                         # its data half written
        return real_fsync(descriptor)

    def remove(path, *args, **kwargs):
        if str(path).endswith(".blob"):
            os.kill(os.getpid(), 9)                                         # about to unlink
        return real_remove(path, *args, **kwargs)
    if work == "free":
        os.remove = remove
        farm.BLOB_GRACE_SECONDS = 0
        store._backend.collect()
    else:
        os.fsync = fsync
        _put(store, 9, elems=ENTRY)


def test_a_worker_killed_while_freeing_or_writing_strands_no_file(redis_server, tmp_path, monkeypatch):
    import redis
    blobs = str(tmp_path / "blobs")
    store = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)
    store.delete(_put(store, 8, elems=ENTRY))                               # released, in its grace period
    for work in ("free", "write"):
        child = FORK.Process(target=_killed_in, args=(redis_server.url, blobs, work))
        child.start()
        child.join(timeout=120)
        assert child.exitcode == -9
    assert len(_files(blobs)) == 2                                          # the released one, a half write
    again = _put(store, 9, elems=ENTRY)                                     # the killed write's content, stored
    monkeypatch.setattr(farm, "BLOB_GRACE_SECONDS", 0)
    _leases_run_out(redis_server.url)
    reopened = CarnatorStore(redis_server.url, 64 << 20, blob_dir=blobs)   # the next open reclaims both
    name = redis.Redis.from_url(redis_server.url).get(f"carnator:f:{again}").decode()
    assert _files(blobs) == {name} and reopened.stats()["overhead_bytes"] == 0
    assert reopened.trajectory(reopened.record(again)).checkpoints[4][0, 0] == 9.0
    reopened.close()
    store.close()
