"""The farm layout with real worker processes on one machine: one Redis, one blob folder. Four workers writing and
reading each other's entries at once, a worker killed with SIGKILL in the middle of a blob write and the Redis
server killed and restarted from its append-only file, and a blob folder that is full (a real 4 MiB tmpfs where
this machine lets the test mount one, else ENOSPC injected into the worker's writes). Nothing acknowledged is lost,
nothing torn is served, a write that does not fit is refused whole with the reason, and the files in the folder
that are not Carnator's are never touched (the backend's own cases, a request's view of a full folder included:
test_farm_backend.py)."""
import errno
import multiprocessing
import os
import signal
import subprocess
import time

import torch

from carnator_engine.store import CarnatorStore, TrajectoryPayload
from test_store import _signature

WORKERS, PER_WORKER = 4, 3
# Workers are forked from this process, which has imported torch and the engine already: a spawned interpreter
# spends seconds importing them (tens of seconds on a busy 2-core machine) before its first write.
FORK = multiprocessing.get_context("fork")


def _put(store, seed: int, elements: int) -> str:
    latent = torch.full((1, elements), float(seed), dtype=torch.float16)   # its seed in every value: torn shows
    return store.put(bucket="b", prompt="w", seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=TrajectoryPayload({4: latent}, {}), latent_shape=latent.shape)


def _sharing_worker(url: str, blobs: str, index: int, answers) -> None:
    """Writes its entries, then reads every other worker's as they appear, found through the index."""
    torch.set_num_threads(1)   # every worker: an OpenMP pool the parent started hangs a forked child that uses it
    store = CarnatorStore(url, 1 << 40, blob_dir=blobs)
    written = [_put(store, index * 100 + k, 1 << 18) for k in range(PER_WORKER)]   # 512 KB blobs
    others = {w * 100 + k for w in range(WORKERS) if w != index for k in range(PER_WORKER)}
    read, deadline = {}, time.time() + 60
    while len(read) < len(others) and time.time() < deadline:
        for seed in sorted(others - set(read)):
            found = store.shortlist("b", _signature(seed), 1)
            record = store.record(found[0]) if found else None
            if record is not None and record.seed == seed:
                assert bool((store.trajectory(record).checkpoints[4] == float(seed)).all())
                read[seed] = record.entry_id
        time.sleep(0.02)
    answers.put((index, written, read, store.drain_problems()))
    store.close()


def _writer(url: str, blobs: str, go_ahead, answers) -> None:
    """Acknowledges each entry, then waits for the test's go-ahead before the next write: never more than one write
    ahead of the test, however loaded the machine."""
    torch.set_num_threads(1)
    store = CarnatorStore(url, 1 << 40, blob_dir=blobs)
    for seed in range(10_000):
        answers.put((_put(store, seed, 4 << 20), seed))   # 8 MB blobs: a write takes a while
        go_ahead.get()


def _full_writer(url: str, blobs: str, inject: bool, answers) -> None:
    """Two entries whose 2 MB blobs do not fit what is left of the folder; what each put raised."""
    torch.set_num_threads(1)
    if inject:   # no tmpfs here: every fsync fails as on a full disk
        def full(descriptor):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.fsync = full
    store = CarnatorStore(url, 1 << 40, blob_dir=blobs)
    results = []
    for seed in (1, 2):
        try:
            results.append(_put(store, seed, 1 << 20))
        except Exception as error:  # noqa: BLE001 - what the request's write-back would report
            results.append(f"{type(error).__name__}: {error}")
    answers.put(results)
    store.close()


def _run(target, *args):
    answers = FORK.Queue()
    process = FORK.Process(target=target, args=(*args, answers))
    process.start()
    return process, answers


FOREIGN = {"notes.txt": b"mine", "a" * 64 + ".blob.bak": b"mine too", "B" * 64 + ".blob": b"upper case: not ours",
           "c" * 64 + ".blob.tmp": b"no random part: not ours"}


def _plant(blobs) -> dict:
    """Foreign files a week old (past every grace period), named close to Carnator's own names; name -> (bytes,
    modification time)."""
    old = time.time() - 7 * 24 * 3600
    for name, data in FOREIGN.items():
        (blobs / name).write_bytes(data)
        os.utime(blobs / name, (old, old))
    return {name: _state(blobs / name) for name in FOREIGN}


def _state(path) -> tuple:
    return path.read_bytes(), os.stat(path).st_mtime


def _untouched(blobs, planted: dict) -> bool:
    return all(_state(blobs / name) == state for name, state in planted.items())


def _marked_folder(redis_server, blobs) -> dict:
    CarnatorStore(redis_server.url, 1 << 40, blob_dir=str(blobs)).close()   # marks the folder, binds the store
    return _plant(blobs)


def _verify_everything(url: str, blobs) -> dict:
    """seed by id of every entry, each read back whole and holding its seed."""
    store = CarnatorStore(url, 1 << 40, blob_dir=str(blobs))
    seeds = {}
    for record in store.records(include_corrupt=True):
        assert record.corrupt is None
        assert bool((store.trajectory(record).checkpoints[4] == float(record.seed)).all())
        store.signature(record)
        seeds[record.entry_id] = record.seed
    assert store.drain_problems() == []
    store.close()
    return seeds


def _carnator_files(blobs) -> list:
    return sorted(name for name in os.listdir(blobs) if name not in FOREIGN and name != "carnator-store.json"
                  and name != "filler.bin")


def test_four_workers_share_their_entries_and_lose_nothing(redis_server, tmp_path):
    blobs = tmp_path / "blobs"
    planted = _marked_folder(redis_server, blobs)
    answers = FORK.Queue()
    workers = [FORK.Process(target=_sharing_worker, args=(redis_server.url, str(blobs), i, answers))
               for i in range(WORKERS)]
    for worker in workers:
        worker.start()
    written, read = {}, {}
    for _ in workers:
        index, mine, seen, problems = answers.get(timeout=120)
        written.update({entry: index for entry in mine})
        read[index] = seen
        assert problems == []
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert len(written) == WORKERS * PER_WORKER
    for index, seen in read.items():   # every worker read every other worker's entries, whole
        assert len(seen) == (WORKERS - 1) * PER_WORKER
        assert all(written[entry] == int(seed) // 100 != index for seed, entry in seen.items())
    stored = _verify_everything(redis_server.url, blobs)
    assert sorted(stored) == sorted(written)
    assert len(_carnator_files(blobs)) == WORKERS * PER_WORKER   # one file per blob, no temporaries left
    assert _untouched(blobs, planted)


def test_kill_9_of_a_worker_mid_write_and_of_redis_lose_nothing_acknowledged(redis_server, tmp_path):
    blobs = tmp_path / "blobs"
    planted = _marked_folder(redis_server, blobs)
    go_ahead = FORK.Queue()
    writer, answers = _run(_writer, redis_server.url, str(blobs), go_ahead)
    acknowledged = {}
    for _ in range(4):
        entry, seed = answers.get(timeout=120)
        acknowledged[entry] = seed
        go_ahead.put(None)
    time.sleep(0.05)                  # into the fifth write (or before it: at most one more entry either way)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join()
    assert writer.exitcode == -signal.SIGKILL
    stored = _verify_everything(redis_server.url, blobs)
    assert acknowledged.items() <= stored.items() and len(stored) <= 5
    redis_server.stop(kill=True)      # the server dies too: only its append-only file is left
    redis_server.start()
    assert _verify_everything(redis_server.url, blobs) == stored
    from test_farm_backend import _leases_run_out
    _leases_run_out(redis_server.url)                      # the killed write's leftovers are past their lease now
    reopened = CarnatorStore(redis_server.url, 1 << 40, blob_dir=str(blobs))
    reopened.close()
    assert len(_carnator_files(blobs)) == len(stored)   # the killed write's temporary or orphan reclaimed
    assert _verify_everything(redis_server.url, blobs) == stored
    assert _untouched(blobs, planted)


def _tmpfs(path, size: str) -> bool:
    """Mounts a tmpfs of `size` at `path` where this machine allows it (root, no container veto)."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


def _fill(path) -> None:
    with open(path / "filler.bin", "wb") as handle:   # not Carnator's: it must stay
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_a_full_blob_folder_costs_the_entries_never_the_store(redis_server, tmp_path):
    blobs = tmp_path / "blobs"
    mounted = _tmpfs(blobs, "4m")
    try:
        planted = _marked_folder(redis_server, blobs)
        before = _verify_everything(redis_server.url, blobs)
        if mounted:
            _fill(blobs)
            planted["filler.bin"] = _state(blobs / "filler.bin")
        writer, answers = _run(_full_writer, redis_server.url, str(blobs), not mounted)
        results = answers.get(timeout=60)
        writer.join(timeout=60)
        assert all(r.startswith("StoreError") and "full" in r for r in results)   # refused with the reason
        assert _verify_everything(redis_server.url, blobs) == before           # nothing half-stored
        assert _carnator_files(blobs) == []                                    # no temporary left behind
        assert _untouched(blobs, planted)
    finally:
        if mounted:
            subprocess.run(["umount", str(blobs)], check=True)
