"""The farm layout with real worker processes on one machine: one Redis, one blob folder. Four workers writing and
reading each other's entries at once, a worker killed with SIGKILL in the middle of a blob write and the Redis
server killed and restarted from its append-only file, and a blob folder that is full (a real 4 MiB tmpfs where
this machine lets the test mount one, else ENOSPC injected into the worker's writes). Nothing acknowledged is lost,
nothing torn is served, a write that does not fit is refused whole with the reason, and the files in the folder
that are not Carnator's are never touched (the backend's own cases, a request's view of a full folder included:
test_farm_backend.py)."""
import errno
import json
import os
import subprocess
import sys
import time

from carnator_engine.store import CarnatorStore
from test_redis_faults import killed_mid_write

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
WORKERS, PER_WORKER = 4, 3
PRELUDE = """
import errno, json, os, sys, time, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from carnator_engine.store import CarnatorStore, TrajectoryPayload
from test_store import _signature
def put(store, seed, elements):
    latent = torch.full((1, elements), float(seed), dtype=torch.float16)   # its seed in every value: torn shows
    return store.put(bucket="b", prompt="w", seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                     payload=TrajectoryPayload({{4: latent}}, {{}}), latent_shape=latent.shape)
store = CarnatorStore({url!r}, 1 << 40, blob_dir={blobs!r})
"""
SHARING = PRELUDE + """
index, workers, count = {index}, {workers}, {count}
for k in range(count):
    print("put", put(store, index * 100 + k, 1 << 18), flush=True)   # 512 KB blobs
others = {{w * 100 + k for w in range(workers) if w != index for k in range(count)}}
read, deadline = {{}}, time.time() + 60
while len(read) < len(others) and time.time() < deadline:   # the others' entries, as they appear
    for seed in sorted(others - set(read)):
        found = store.shortlist("b", _signature(seed), 1)
        record = store.record(found[0]) if found else None
        if record is not None and record.seed == seed:
            assert bool((store.trajectory(record).checkpoints[4] == float(seed)).all())
            read[seed] = record.entry_id
    time.sleep(0.02)
print("read", json.dumps({{"read": read, "problems": store.drain_problems()}}), flush=True)
store.close()
"""
WRITER = PRELUDE + """
for seed in range(10_000):
    print(put(store, seed, 4 << 20), seed, flush=True)   # 8 MB blobs: a write takes a while
"""
FULL = PRELUDE + """
if {inject!r}:   # no tmpfs here: every fsync of a blob write fails as on a full disk
    real_fsync = os.fsync
    def full(descriptor):
        raise OSError(errno.ENOSPC, "No space left on device")
    os.fsync = full
results = []
for seed in (1, 2):
    try:
        entry = put(store, seed, 1 << 20)   # a 2 MB blob does not fit what is left
    except Exception as error:
        entry = type(error).__name__ + ": " + str(error)
    results.append(entry)
print(json.dumps(results), flush=True)
store.close()
"""


def _script(template: str, url: str, blobs: str, **more) -> list:
    return [sys.executable, "-c", template.format(root=ROOT, tests=TESTS, url=url, blobs=str(blobs), **more)]


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
    workers = [subprocess.Popen(_script(SHARING, redis_server.url, blobs, index=i, workers=WORKERS,
                                        count=PER_WORKER), stdout=subprocess.PIPE, text=True)
               for i in range(WORKERS)]
    written, read = {}, {}
    for index, worker in enumerate(workers):
        out, _ = worker.communicate(timeout=120)
        assert worker.returncode == 0
        lines = out.splitlines()
        written.update({line.split()[1]: index for line in lines if line.startswith("put ")})
        last = json.loads(lines[-1].split(" ", 1)[1])
        read[index] = last["read"]
        assert last["problems"] == []
    assert len(written) == WORKERS * PER_WORKER
    for index, seen in read.items():   # every worker read every other worker's entries, whole
        assert len(seen) == (WORKERS - 1) * PER_WORKER
        assert all(written[entry] == int(seed) // 100 != index for seed, entry in seen.items())
    stored = _verify_everything(redis_server.url, blobs)
    assert sorted(stored) == sorted(written)
    assert len(_carnator_files(blobs)) == WORKERS * PER_WORKER   # one file per blob, no temporaries left
    assert _untouched(blobs, planted)


def test_kill_9_of_a_worker_mid_write_and_of_redis_lose_nothing_acknowledged(redis_server, tmp_path, monkeypatch):
    blobs = tmp_path / "blobs"
    planted = _marked_folder(redis_server, blobs)
    acknowledged = killed_mid_write(_script(WRITER, redis_server.url, blobs), after=4)
    stored = _verify_everything(redis_server.url, blobs)
    assert acknowledged.items() <= stored.items() and len(stored) <= 5
    redis_server.stop(kill=True)      # the server dies too: only its append-only file is left
    redis_server.start()
    assert _verify_everything(redis_server.url, blobs) == stored
    from carnator_engine.store.backends import farm
    monkeypatch.setattr(farm, "ORPHAN_GRACE_SECONDS", 0)   # the killed write's leftovers are past their grace now
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
        done = subprocess.run(_script(FULL, redis_server.url, blobs, inject=not mounted), capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        results = json.loads(done.stdout.splitlines()[-1])
        assert all(r.startswith("StoreError") and "full" in r for r in results)   # refused with the reason
        assert _verify_everything(redis_server.url, blobs) == before           # nothing half-stored
        assert _carnator_files(blobs) == []                                    # no temporary left behind
        assert _untouched(blobs, planted)
    finally:
        if mounted:
            subprocess.run(["umount", str(blobs)], check=True)
