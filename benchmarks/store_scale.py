"""Store at scale: open (from the index snapshot, and a rebuild without one), lookup, put and index memory from 10
to 100k entries in one bucket, on both backends, with synthetic Wan-2.1-1.3B-shaped Early Signatures; and what a
Wan-sized trajectory blob costs to write and read in Redis against a file in a shared directory.

Signatures: probe 3 steps x 30 blocks x 64 pooled features, the x0-hat grid 16 x 8 x 8 x 8, attention 30 x 16 x 16
(86 KB as stored). They come in sessions (a random centre, then entries a small step from it), as an iteration
stream would leave them. Each store grows through the sizes; at each size the store is opened afresh, then
`lookup` queries (an existing entry's signature slightly moved, 3 nearest through index.nearest: shortlist, exact
re-rank, lineage grouping) and `put`s (a tiny blob: the goal excludes the blob bytes; fsync included) are timed.
While that store is still open (its puts and deletes logged after the snapshot), a fresh process opens the store
as a worker would (snapshot loaded, log replayed: "open"), then another with the snapshot ignored ("rebuild"):
their times and how much each process grew (RSS) are what the index costs. The fill encodes entries as
CarnatorStore.put does but writes them in batches, fsync skipped (it is not what is measured), and ends with a
rebuild, which leaves the snapshot a store written through puts would have.

    python benchmarks/store_scale.py                       # both backends, 10 .. 100000 entries
    python benchmarks/store_scale.py --sizes 10,1000 --backends disk --out /tmp/s.json
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from carnator_engine.store.index import nearest  # noqa: E402
from carnator_engine.signature import EarlySignature  # noqa: E402
from carnator_engine.store import CarnatorStore, TrajectoryPayload  # noqa: E402

PROBE_STEPS, BLOCKS, CHANNELS = 3, 30, 16
WAN_LATENT = (1, 16, 21, 60, 104)   # 480p x 81 frames
# Issue 16's goals on a 2-core machine, by the row field they bound and the store size they apply to; the index
# memory goal bounds what opening the store grew the process by, loaded or rebuilt.
GOALS = {"lookup_ms_median": {10_000: 20, 100_000: 100}, "put_ms_median": {100_000: 30}, "open_s": {100_000: 10},
         "rebuild_s": {100_000: 10}, "open_rss_mb": {100_000: 200}, "rebuild_rss_mb": {100_000: 200}}


def against_goals(rows: list) -> list:
    """One line per goal a measured row bears on: the field, the backend and size, the value, the goal, met or not."""
    return [{"field": name, "backend": r["backend"], "entries": r["entries"], "value": r[name], "goal": goal,
             "met": r[name] <= goal}
            for name, by_size in GOALS.items() for r in rows for size, goal in by_size.items()
            if r["entries"] == size]


class Signatures:
    """Session-clustered synthetic signatures, reproducible by index."""

    def __init__(self, seed: int = 0, per_session: int = 10):
        self.seed, self.per_session = seed, per_session

    @functools.lru_cache(maxsize=4)
    def centre(self, session: int) -> tuple:
        centre = torch.Generator().manual_seed(self.seed * 1_000_003 + session)
        return (torch.randn(PROBE_STEPS, BLOCKS, 64, generator=centre), torch.randn(CHANNELS, 8, 8, 8, generator=centre),
                torch.softmax(torch.randn(BLOCKS, 16, 16, generator=centre), -1))

    def get(self, index: int, jitter: float = 0.0) -> EarlySignature:
        hidden, denoised, attention = self.centre(index // self.per_session)
        own = torch.Generator().manual_seed(self.seed * 1_000_003 + 7_919 * (index + 1))
        hidden = hidden + 0.2 * torch.randn(PROBE_STEPS, BLOCKS, 64, generator=own)
        denoised = denoised + 0.3 * torch.randn(CHANNELS, 8, 8, 8, generator=own)
        if jitter:   # a request near this entry: its own noise moved a little
            moved = torch.Generator().manual_seed(self.seed * 1_000_003 + 104_729 * (index + 1))
            denoised = denoised + jitter * torch.randn(denoised.shape, generator=moved)
            hidden = hidden + jitter * torch.randn(hidden.shape, generator=moved)
        return EarlySignature(hidden=hidden, denoised=denoised, attention=attention)


TINY = TrajectoryPayload({6: torch.zeros(1, 16, dtype=torch.float16)}, {})


def put(store: CarnatorStore, signatures: Signatures, index: int) -> str:
    return store.put(bucket="wan-1.3b", prompt=f"synthetic {index}", seed=index, steps=50, probe_steps=PROBE_STEPS,
                     signature=signatures.get(index), payload=TINY, latent_shape=[1, 16], thumbnail=b"",
                     request_key=f"{index:032x}")


def fill(location: str, signatures: Signatures, start: int, stop: int, batch: int = 500) -> float:
    """Adds entries start..stop-1 to the store at `location` the fast way: each batch's metadata, signatures and
    blobs encoded as CarnatorStore.put encodes them (vectors in one batched projection), then written in one
    transaction (disk: one SQLite transaction, blob files without fsync; Redis: one pipeline). Only the fill
    takes this path; every measured put below goes through CarnatorStore.put."""
    from carnator_engine.store.backends.disk import DiskBackend
    from carnator_engine.store.store import EntryRecord, _encode, _sha256
    from carnator_engine.store.vectors import compact_vectors
    from safetensors.torch import save
    store = CarnatorStore(location, 1 << 50)
    backend = store._backend
    blob = save({f"checkpoint.{s}": t for s, t in TINY.checkpoints.items()})
    started = time.perf_counter()
    for first in range(start, stop, batch):
        indices = range(first, min(stop, first + batch))
        sigs = [signatures.get(i) for i in indices]
        rows = []
        for i, sig, vector in zip(indices, sigs, compact_vectors(sigs)):
            data = save(sig.to_tensors())
            entry = f"{i:016x}"
            record = EntryRecord(entry, "wan-1.3b", f"synthetic {i}", i, 50, PROBE_STEPS, [6], [1, 16], time.time(),
                                 time.time(), _sha256(data), _sha256(blob), len(data) + len(blob),
                                 request_key=f"{i:032x}", lineage=entry)
            rows.append((entry, _encode(record, vector), data))
        if isinstance(backend, DiskBackend):
            for entry, _, _ in rows:
                with open(backend._blob_path(entry), "wb") as handle:
                    handle.write(blob)
            with backend._cache.transact():
                for entry, meta, data in rows:
                    backend._cache.set(f"s:{entry}", data)
                    backend._cache.set(f"t:{entry}", b"")
                    backend._cache.set(f"m:{entry}", meta)
                    backend._log("put", entry)
        else:
            pipe = backend._client.pipeline(transaction=False)
            for entry, meta, data in rows:
                for kind, value in (("sig", data), ("blob", blob), ("thumb", b""), ("meta", meta)):
                    pipe.set(backend._key(kind, entry), value)
                pipe.sadd("carnator:ids", entry)
                backend._log(pipe, "put", entry)
            pipe.execute()
    store._rebuild()   # the batches bypassed the store: take them in and snapshot them, as SNAPSHOT_EVERY would
    store.close()
    return time.perf_counter() - started


OPENER = """
import json, sys, time
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads({threads})
from carnator_engine.store import CarnatorStore
def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * {page}
if {rebuild!r}:
    CarnatorStore._open_index = CarnatorStore._rebuild
before = rss()
started = time.perf_counter()
store = CarnatorStore({location!r}, 1 << 50)
print(json.dumps({{"seconds": time.perf_counter() - started, "rss": rss() - before}}))
"""


def open_in_a_fresh_process(location: str, rebuild: bool) -> dict:
    """What opening the store costs a worker: seconds, and how much the process grew (index and all)."""
    import subprocess
    code = OPENER.format(root=ROOT, threads=torch.get_num_threads(), page=os.sysconf("SC_PAGE_SIZE"),
                         rebuild=rebuild, location=location)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(location: str, signatures: Signatures, size: int, queries: int, puts: int) -> dict:
    store = CarnatorStore(location, 1 << 50)
    lookups, found = [], 0
    for q in range(queries):
        target = (q * 7919) % size
        query = signatures.get(target, jitter=0.05)
        started = time.perf_counter()
        candidates = nearest(store, "wan-1.3b", query, limit=3)
        lookups.append(time.perf_counter() - started)
        found += bool(candidates) and candidates[0].record.seed == target
    writes = []
    for p in range(puts):
        started = time.perf_counter()
        put(store, signatures, 10_000_000 + size + p)
        writes.append(time.perf_counter() - started)
    for p in range(puts):   # the store keeps its size for the next step
        store.delete(store.exact_repeat("wan-1.3b", f"{10_000_000 + size + p:032x}").entry_id)
    stats = store.stats()
    opened, rebuilt = open_in_a_fresh_process(location, False), open_in_a_fresh_process(location, True)
    store.close()
    return {"entries": size, "open_s": round(opened["seconds"], 3), "rebuild_s": round(rebuilt["seconds"], 3),
            "lookup_ms_median": round(1e3 * statistics.median(lookups), 2),
            "lookup_ms_p95": round(1e3 * sorted(lookups)[int(0.95 * (len(lookups) - 1))], 2),
            "nearest_found": f"{found}/{queries}", "put_ms_median": round(1e3 * statistics.median(writes), 2),
            "put_ms_p95": round(1e3 * sorted(writes)[int(0.95 * (len(writes) - 1))], 2),
            "index_matrix_mb": round(stats["index_bytes"] / 2**20, 1),
            "open_rss_mb": round(opened["rss"] / 2**20, 1), "rebuild_rss_mb": round(rebuilt["rss"] / 2**20, 1),
            "stored_mb": round(stats["bytes"] / 2**20, 1)}


def blob_transport(redis_url: str, directory: str, repeats: int) -> dict:
    """One Wan-1.3B entry's trajectory blob (12 fp16 checkpoints + the fp32 final latent): SET/GET in Redis
    against write + fsync + rename / read of a file, the two places the Redis backend could keep it."""
    import redis
    checkpoints = 12 * torch.Size(WAN_LATENT).numel() * 2
    blob = os.urandom(checkpoints + torch.Size(WAN_LATENT).numel() * 4)
    client = redis.Redis.from_url(redis_url, socket_timeout=120)
    times = {"redis_write_s": [], "redis_read_s": [], "file_write_s": [], "file_read_s": []}
    path = os.path.join(directory, "blob.bin")
    for repeat in range(repeats):
        started = time.perf_counter()
        client.set(f"bench:blob:{repeat}", blob)
        times["redis_write_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        assert len(client.get(f"bench:blob:{repeat}")) == len(blob)
        times["redis_read_s"].append(time.perf_counter() - started)
        client.delete(f"bench:blob:{repeat}")
        started = time.perf_counter()
        with open(path + ".tmp", "wb") as handle:
            handle.write(blob)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(path + ".tmp", path)
        times["file_write_s"].append(time.perf_counter() - started)
        started = time.perf_counter()
        with open(path, "rb") as handle:
            assert len(handle.read()) == len(blob)
        times["file_read_s"].append(time.perf_counter() - started)
    client.close()
    return {"blob_mb": round(len(blob) / 2**20, 1), **{k: round(statistics.median(v), 3) for k, v in times.items()}}


def table(rows: list) -> str:
    header = (f"{'backend':8} {'entries':>8} {'open s':>7} {'rebuild s':>9} {'lookup ms':>10} {'p95':>7} "
              f"{'found':>7} {'put ms':>7} {'p95':>7} {'index MB':>9} {'RSS open':>9} {'RSS rebuild':>11}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r['backend']:8} {r['entries']:>8} {r['open_s']:>7.2f} {r['rebuild_s']:>9.2f} "
                     f"{r['lookup_ms_median']:>10.2f} {r['lookup_ms_p95']:>7.2f} {r['nearest_found']:>7} "
                     f"{r['put_ms_median']:>7.2f} {r['put_ms_p95']:>7.2f} {r['index_matrix_mb']:>9.1f} "
                     f"{r['open_rss_mb']:>9.1f} {r['rebuild_rss_mb']:>11.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000,100000")
    parser.add_argument("--backends", default="disk,redis")
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--puts", type=int, default=20)
    parser.add_argument("--blob-repeats", type=int, default=3, help="0 skips the blob transport measurement")
    parser.add_argument("--root", default=None, help="parent of the temporary stores (default: /tmp)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary stores (17 GB at 100k entries on disk) to profile them afterwards")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default="benchmarks/results/store/store_scale.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    backends = [b for b in args.backends.split(",") if b]
    root = tempfile.mkdtemp(prefix="carnator-scale-", dir=args.root)
    server = None
    if "redis" in backends or args.blob_repeats:
        from redis_server import RedisServer
        server = RedisServer(os.path.join(root, "redis")).start()   # no AOF: the fill is not what is measured
    rows, blob, load = [], None, os.getloadavg()
    try:
        for backend in backends:
            location = os.path.join(root, "disk") if backend == "disk" else server.url
            signatures, have = Signatures(), 0
            for size in sizes:
                fill_s = fill(location, signatures, have, size)
                have = size
                row = {"backend": backend, **measure(location, signatures, size, args.queries, args.puts),
                       "fill_s": round(fill_s, 1), "load_average_1min": round(os.getloadavg()[0], 1)}
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                write(args.out, rows, None, load, args)   # a run cut short keeps what it measured
            if backend == "redis":
                import redis
                redis.Redis.from_url(server.url).flushall()
        if args.blob_repeats:
            blob = blob_transport(server.url, root, args.blob_repeats)
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n" + table(rows))
    for verdict in against_goals(rows):
        print(f"{verdict['field']} {verdict['backend']} {verdict['entries']}: {verdict['value']} against <= "
              f"{verdict['goal']}: {'met' if verdict['met'] else 'NOT met'}")
    if blob:
        print(f"\nWan-1.3B trajectory blob ({blob['blob_mb']} MB): Redis write {blob['redis_write_s']} s, read "
              f"{blob['redis_read_s']} s; file (fsync + rename) write {blob['file_write_s']} s, read "
              f"{blob['file_read_s']} s")
    write(args.out, rows, blob, load, args)
    print(f"wrote {args.out}")
    return 0


def write(path: str, rows: list, blob, load, args) -> None:
    result = {"rows": rows, "blob": blob, "goals": against_goals(rows), "load_average_at_start": load,
              "load_average_at_end": os.getloadavg(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
              "args": vars(args)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)


if __name__ == "__main__":
    sys.exit(main())
