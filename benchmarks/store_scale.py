"""Store at scale: open (from the index snapshot, and a rebuild without one), lookup, put and index memory from 10
to 100k entries in one bucket, on the three layouts (disk, Redis, farm: Redis index + shared blob folder), with
synthetic Wan-2.1-1.3B-shaped Early Signatures; what a Wan-sized trajectory blob costs to write and read in Redis
against a file in a shared directory; and what one Wan-1.3B-sized entry costs Redis's memory in the farm layout
against Redis-only (INFO memory and MEMORY USAGE, real-size synthetic entries stored through CarnatorStore.put).

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

    python benchmarks/store_scale.py                       # every layout, 10 .. 100000 entries
    python benchmarks/store_scale.py --sizes 10,1000 --backends disk --out /tmp/s.json
    python benchmarks/store_scale.py --sizes 1000,100000 --backends farm --blob-repeats 0 --memory-entries 8 \
        --out benchmarks/results/store/store_scale_farm.json
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import platform
import re
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
# The farm layout's goals (one Redis for many workers): lookup at 100k entries, and Redis memory per Wan-1.3B entry.
FARM_GOALS = {"lookup_ms_median": {100_000: 50}}
FARM_MEMORY_GOAL_MB = 1.0


def against_goals(rows: list) -> list:
    """One line per goal a measured row bears on: the field, the backend and size, the value, the goal, met or not."""
    return [{"field": name, "backend": r["backend"], "entries": r["entries"], "value": r[name], "goal": goal,
             "met": r[name] <= goal}
            for goals, backends in ((GOALS, None), (FARM_GOALS, "farm"))
            for name, by_size in goals.items() for r in rows for size, goal in by_size.items()
            if r["entries"] == size and backends in (None, r["backend"])]


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


def wan_payload(seed: int) -> TrajectoryPayload:
    """A Wan-1.3B-sized trajectory (12 fp16 checkpoints and the fp32 final latent, as a 50-step run stores them),
    random so that no two entries share a blob."""
    generator = torch.Generator().manual_seed(seed)
    checkpoints = {step: torch.randn(WAN_LATENT, generator=generator).half() for step in range(3, 50, 4)}
    return TrajectoryPayload(checkpoints, {}, final=torch.randn(WAN_LATENT, generator=generator))


def put(store: CarnatorStore, signatures: Signatures, index: int) -> str:
    return store.put(bucket="wan-1.3b", prompt=f"synthetic {index}", seed=index, steps=50, probe_steps=PROBE_STEPS,
                     signature=signatures.get(index), payload=TINY, latent_shape=[1, 16], thumbnail=b"",
                     request_key=f"{index:032x}")


def fill(location: str, signatures: Signatures, start: int, stop: int, batch: int = 500, blob_dir: str = "") -> float:
    """Adds entries start..stop-1 to the store at `location` the fast way: each batch's metadata, signatures and
    blobs encoded as CarnatorStore.put encodes them (vectors in one batched projection), then written in one
    transaction (disk: one SQLite transaction, blob files without fsync; Redis: one pipeline; farm: one pipeline
    and the one blob file every entry's equal tiny blob names). Only the fill takes this path; every measured put
    below goes through CarnatorStore.put."""
    from carnator_engine.store.backends.disk import DiskBackend
    from carnator_engine.store.store import EntryRecord, _encode, _sha256
    from carnator_engine.store.vectors import compact_vectors
    from safetensors.torch import save
    from carnator_engine.store.backends.farm import FarmBackend
    store = CarnatorStore(location, 1 << 50, blob_dir=blob_dir)
    backend = store._backend
    blob = save({f"checkpoint.{s}": t for s, t in TINY.checkpoints.items()})
    if isinstance(backend, FarmBackend):
        blob_name = hashlib.sha256(blob).hexdigest() + ".blob"
        backend._folder.write(blob_name, blob)
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
        elif isinstance(backend, FarmBackend):
            pipe = backend._client.pipeline(transaction=False)
            for entry, meta, data in rows:
                backend._redis.queue_put(pipe, entry, meta, {"sig": data, "thumb": b""})
                pipe.set(backend._name_key(entry), blob_name)
                pipe.sadd(backend._refs_key(blob_name), entry)
            pipe.execute()
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
store = CarnatorStore({location!r}, 1 << 50, blob_dir={blob_dir!r})
print(json.dumps({{"seconds": time.perf_counter() - started, "rss": rss() - before}}))
"""


# How the opens are measured: "fresh", in a new interpreter (a worker's cost); "fork", in a child forked from this
# process (the same code without an interpreter start: for a smoke run, whose figures are not reported)
OPEN_WITH = "fresh"


def open_in_a_fresh_process(location: str, rebuild: bool, blob_dir: str = "") -> dict:
    """What opening the store costs a worker: seconds, and how much the process grew (index and all)."""
    import subprocess
    code = OPENER.format(root=ROOT, threads=torch.get_num_threads(), page=os.sysconf("SC_PAGE_SIZE"),
                         rebuild=rebuild, location=location, blob_dir=blob_dir)
    if OPEN_WITH == "fork":
        return json.loads(_run_forked(code).strip().splitlines()[-1])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_forked(code: str) -> str:
    """What `code` prints, run in a forked child (torch single-threaded there: a pool started before a fork hangs)."""
    read_end, write_end = os.pipe()
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            os.dup2(write_end, 1)
            sys.stdout = open(1, "w", closefd=False)
            torch.set_num_threads(1)
            exec(compile(code, "<open>", "exec"), {"__name__": "__open__"})
            status = 0
        finally:
            sys.stdout.flush()
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end) as output:
        printed = output.read()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the forked open failed (exit status {os.waitstatus_to_exitcode(status)})")
    return printed


def measure(location: str, signatures: Signatures, size: int, queries: int, puts: int, blob_dir: str = "") -> dict:
    store = CarnatorStore(location, 1 << 50, blob_dir=blob_dir)
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
    opened = open_in_a_fresh_process(location, False, blob_dir)
    rebuilt = open_in_a_fresh_process(location, True, blob_dir)
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


def redis_memory_per_entry(redis_url: str, root: str, layout: str, count: int, signatures: Signatures) -> dict:
    """Wan-1.3B-sized entries (trajectory, 86 KB signature, a 128-pixel thumbnail of a noisy frame) stored
    through CarnatorStore.put in one layout ("farm": blobs in a folder; "redis": Redis-only) on an empty server:
    what Redis's memory grew by per entry (INFO memory's used_memory), what MEMORY USAGE counts for all the
    store's keys per entry, and the bytes on disk in the blob folder; each entry read back whole."""
    import redis
    from carnator_engine.preview import thumbnail_png
    client = redis.Redis.from_url(redis_url, socket_timeout=120)
    client.flushall()
    blob_dir = os.path.join(root, f"memory-{layout}-blobs") if layout == "farm" else ""
    store = CarnatorStore(redis_url, 1 << 50, blob_dir=blob_dir)
    thumbnail = thumbnail_png(torch.rand(3, 480, 832, generator=torch.Generator().manual_seed(0)))
    before = client.info("memory")["used_memory"]
    entries, puts = [], []
    for index in range(count):
        payload = wan_payload(index)
        started = time.perf_counter()
        entries.append(store.put(bucket="wan-1.3b", prompt=f"synthetic {index}", seed=index, steps=50,
                                 probe_steps=PROBE_STEPS, signature=signatures.get(index), payload=payload,
                                 latent_shape=WAN_LATENT, thumbnail=thumbnail, request_key=f"{index:032x}"))
        puts.append(time.perf_counter() - started)
    used = client.info("memory")["used_memory"] - before
    keys = [key for key in client.scan_iter(match="carnator:*", count=1000) if key != b"carnator:snapshot"]
    counted = sum(client.memory_usage(key, samples=0) or 0 for key in keys)
    for entry in entries:
        record = store.record(entry)
        assert sorted(store.trajectory(record).checkpoints) == record.checkpoint_steps
    on_disk = sum(item.stat().st_size for item in os.scandir(blob_dir) if item.name.endswith(".blob")) \
        if blob_dir else 0
    entry_bytes = store.stats()["entry_bytes"] / count
    store.close()
    client.flushall()
    client.close()
    if blob_dir:
        shutil.rmtree(blob_dir, ignore_errors=True)
    return {"layout": layout, "entries": count, "entry_mb": round(entry_bytes / 2**20, 2),
            "redis_used_memory_mb_per_entry": round(used / count / 2**20, 3),
            "redis_memory_usage_mb_per_entry": round(counted / count / 2**20, 3),
            "blob_folder_mb_per_entry": round(on_disk / count / 2**20, 2),
            "thumbnail_kb": round(len(thumbnail) / 1024, 1), "put_s_median": round(statistics.median(puts), 3)}


MEMORY_COLUMNS = [("layout", "layout", "<7"), ("entries", "entries", ">7"), ("entry MB", "entry_mb", ">8.1f"),
                  ("Redis MB/entry (INFO)", "redis_used_memory_mb_per_entry", ">21.3f"),
                  ("(MEMORY USAGE)", "redis_memory_usage_mb_per_entry", ">14.3f"),
                  ("folder MB/entry", "blob_folder_mb_per_entry", ">15.1f"), ("put s", "put_s_median", ">6.2f")]
SCALE_COLUMNS = [("backend", "backend", "<8"), ("entries", "entries", ">8"), ("open s", "open_s", ">7.2f"),
                 ("rebuild s", "rebuild_s", ">9.2f"), ("lookup ms", "lookup_ms_median", ">10.2f"),
                 ("p95", "lookup_ms_p95", ">7.2f"), ("found", "nearest_found", ">7"), ("put ms", "put_ms_median", ">7.2f"),
                 ("p95", "put_ms_p95", ">7.2f"), ("index MB", "index_matrix_mb", ">9.1f"),
                 ("RSS open", "open_rss_mb", ">9.1f"), ("RSS rebuild", "rebuild_rss_mb", ">11.1f")]


def table(rows: list, columns: list = SCALE_COLUMNS) -> str:
    """Rows under a header, one column per (title, field, format spec: alignment, width, precision)."""
    def width(spec: str) -> str:
        return re.match(r"[<>]\d+", spec).group()
    header = " ".join(f"{title:{width(spec)}}" for title, _, spec in columns)
    lines = [header, "-" * len(header)]
    lines += [" ".join(f"{r[field]:{spec}}" for _, field, spec in columns) for r in rows]
    return "\n".join(lines)


def memory_goals(rows: list) -> list:
    return [{"field": "redis_used_memory_mb_per_entry", "backend": "farm", "entries": r["entries"],
             "value": r["redis_used_memory_mb_per_entry"], "goal": FARM_MEMORY_GOAL_MB,
             "met": r["redis_used_memory_mb_per_entry"] <= FARM_MEMORY_GOAL_MB} for r in rows if r["layout"] == "farm"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000,100000")
    parser.add_argument("--backends", default="disk,redis,farm")
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--puts", type=int, default=20)
    parser.add_argument("--blob-repeats", type=int, default=3, help="0 skips the blob transport measurement")
    parser.add_argument("--memory-entries", type=int, default=8,
                        help="Wan-1.3B-sized entries stored to measure Redis memory per entry in the farm layout "
                             "(0 skips it)")
    parser.add_argument("--memory-redis-entries", type=int, default=2,
                        help="the same in the Redis-only layout, for comparison (each holds ~59 MB in Redis)")
    parser.add_argument("--root", default=None, help="parent of the temporary stores (default: /tmp)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary stores (17 GB at 100k entries on disk) to profile them afterwards")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--open-with", choices=("fresh", "fork"), default="fresh",
                        help="measure each open in a fresh interpreter (default, a worker's cost) or in a forked "
                             "child (a smoke run: no interpreter start)")
    parser.add_argument("--out", default="benchmarks/results/store/store_scale.json")
    args = parser.parse_args(argv)
    global OPEN_WITH
    OPEN_WITH = args.open_with
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    backends = [b for b in args.backends.split(",") if b]
    root = tempfile.mkdtemp(prefix="carnator-scale-", dir=args.root)
    server = None
    if {"redis", "farm"} & set(backends) or args.blob_repeats or args.memory_entries:
        from redis_server import RedisServer
        server = RedisServer(os.path.join(root, "redis")).start()   # no AOF: the fill is not what is measured
    rows, blob, memory, load = [], None, [], os.getloadavg()
    try:
        for backend in backends:
            location = os.path.join(root, "disk") if backend == "disk" else server.url
            blob_dir = os.path.join(root, "farm-blobs") if backend == "farm" else ""
            signatures, have = Signatures(), 0
            for size in sizes:
                fill_s = fill(location, signatures, have, size, blob_dir=blob_dir)
                have = size
                row = {"backend": backend, **measure(location, signatures, size, args.queries, args.puts, blob_dir),
                       "fill_s": round(fill_s, 1), "load_average_1min": round(os.getloadavg()[0], 1)}
                rows.append(row)
                print(table([row]).splitlines()[-1], flush=True)
                write(args.out, rows, None, memory, load, args)   # a run cut short keeps what it measured
            if backend != "disk":
                import redis
                redis.Redis.from_url(server.url, socket_timeout=600).flushall()   # 100k entries: seconds
        if args.blob_repeats:
            blob = blob_transport(server.url, root, args.blob_repeats)
        for layout, count in (("farm", args.memory_entries), ("redis", args.memory_redis_entries)):
            if count and args.memory_entries:
                memory.append(redis_memory_per_entry(server.url, root, layout, count, Signatures(seed=1)))
                write(args.out, rows, blob, memory, load, args)
    finally:
        if server is not None:
            server.stop()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n" + table(rows))
    if memory:
        print("\nRedis memory per Wan-1.3B-sized entry\n" + table(memory, MEMORY_COLUMNS))
    for verdict in against_goals(rows) + memory_goals(memory):
        print(f"{verdict['field']} {verdict['backend']} {verdict['entries']}: {verdict['value']} against <= "
              f"{verdict['goal']}: {'met' if verdict['met'] else 'NOT met'}")
    if blob:
        print(f"\nWan-1.3B trajectory blob ({blob['blob_mb']} MB): Redis write {blob['redis_write_s']} s, read "
              f"{blob['redis_read_s']} s; file (fsync + rename) write {blob['file_write_s']} s, read "
              f"{blob['file_read_s']} s")
    write(args.out, rows, blob, memory, load, args)
    print(f"wrote {args.out}")
    return 0


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def write(path: str, rows: list, blob, memory: list, load, args) -> None:
    result = {"rows": rows, "blob": blob, "redis_memory": memory, "goals": against_goals(rows) + memory_goals(memory),
              "load_average_at_start": load,
              "load_average_at_end": os.getloadavg(),
              "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "platform": platform.platform(),
                          "python": platform.python_version(),
                          "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
              "args": vars(args)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(result, handle, indent=2)


if __name__ == "__main__":
    sys.exit(main())
