"""Does the store hold? The store's benchmarks, one subcommand each (`--help` on each lists its options):

    python benchmarks/store.py scale [options]        open, lookup, put and memory from 10 to 100k entries
    python benchmarks/store.py workers [options]      worker processes on one store, with faults
    python benchmarks/store.py write-back [options]   what the background write-back takes off a miss

`scale`: Store at scale: open (from the index snapshot, and a rebuild without one), lookup, put and index memory from 10
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

    python benchmarks/store.py scale                       # every layout, 10 .. 100000 entries
    python benchmarks/store.py scale --sizes 10,1000 --backends disk --out /tmp/s.json
    python benchmarks/store.py scale --sizes 1000,100000 --backends farm --blob-repeats 0 --memory-entries 8 \
        --out $OUT/store_scale_farm.json

`workers`: worker processes serve the evaluation world's request stream, each user's session spread over
the workers (request j of user u goes to worker (u + j) mod W, as a load balancer without affinity would send
it), with one store shared through Redis ("shared"), one shared in the farm layout ("farm": the index in Redis, the
trajectories in one blob folder every worker opens) and one store per worker (the default: a directory each).

Each user sends the next request of their session when the previous one has come back, so a session's
requests run in order while the users' sessions run side by side. Reported per setting: hits (gate reuse),
exact repeats, how many of those reused an entry another worker stored, model calls saved against generating every
request in full, and the share of requests whose six attributes all read back right from the pixels. The farm's
blob folder also holds files that are not Carnator's (planted with old times, names close to Carnator's own):
every one must be there afterwards, bytes and time unchanged; and every entry is checked (lost, torn) as below.

With --faults (the shared and farm stores) the run also survives: a worker killed with SIGKILL (its request is sent again
to the next worker, as a client would retry), the Redis server killed and restarted from its append-only file,
and every client connection dropped. Afterwards every entry a worker acknowledged is checked: present, whole
(checksums) and never served torn; every request that saw a store fault was a full generation.

    python benchmarks/store.py workers               # 4 workers, 6 users x 8 requests, every setting
    python benchmarks/store.py workers --faults --out $OUT/workers_faults.json
    python benchmarks/store.py workers --settings farm --faults --out $OUT/workers_farm.json

`write-back`: What the background write-back (carnator_engine/store/write_back.py) takes off a miss, on gpu_host's Wan model.

ComfyUI's WanModel (gpu_host.build_model, random weights) through ComfyRunner, `--repeats` times, interleaved:
  plain     ComfyUI sampling alone (the baseline)
  returned  a Carnator miss on an empty store, timed until generate() returns: what a request waits for now
  written   the same call, timed on until its entry is written (result.entry_id waits): what it waited for when
            the write-back ran before the return (the same work in the same order), paired with `returned`, so
            their difference (`write_after_return`) is free of the run-to-run noise of sampling
  queueing  what the request still spends on the write-back: copies of the final latent and preview, and the submit
and a session: `--session` requests in a row on one store (different seeds; mostly misses), each waiting for its
write or not, so the overlap of one request's write with the next request's sampling is measured as well (on a CPU
they share the cores; on a GPU the write needs only the host).

Usage:
  python3 benchmarks/store.py write-back --out /tmp/write_back.json                 # CPU-sized defaults
  python3 benchmarks/store.py write-back --device cuda --preset real --out ...      # Wan 1.3B's real size

The committed runs of `scale` and `workers` are packed (benchmarks/reports.py) in benchmarks/results/store/.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing as mp
import os
import platform
import queue
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import reports  # noqa: E402
from carnator_engine.signature import EarlySignature  # noqa: E402
from carnator_engine.store import CarnatorStore, TrajectoryPayload  # noqa: E402
from carnator_engine.store.index import nearest  # noqa: E402
from gpu_host import (PRESETS, PROMPT, TEXT_DIM, build_model, find_comfyui, import_comfy, median,  # noqa: E402
                      plain_sample, timed)

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
    and one blob file shared by every entry's equal tiny blob, in the layout of farms made before per-write files). Only the fill takes this path; every measured put
    below goes through CarnatorStore.put."""
    from carnator_engine.store.backends.disk import DiskBackend
    from carnator_engine.store.store import EntryRecord, _encode, _sha256
    from carnator_engine.store.vectors import compact_vectors
    from safetensors.torch import save
    from carnator_engine.store.backends.farm import FarmBackend
    from carnator_engine.store.owned_files import write_whole
    store = CarnatorStore(location, 1 << 50, blob_dir=blob_dir)
    backend = store._backend
    blob = save({f"checkpoint.{s}": t for s, t in TINY.checkpoints.items()})
    if isinstance(backend, FarmBackend):   # one file shared by every entry, as farms made before per-write files
        blob_name = hashlib.sha256(blob).hexdigest() + ".blob"   # named theirs (still read as such)
        write_whole(backend._folder.path(blob_name), blob, backend._folder.identity)
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
                backend._redis.queue_put(pipe, entry, meta, {"sig": data, "thumb": b""}, len(data) + len(blob))
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


def main_scale(argv=None) -> int:
    """`scale`: open, lookup, put and index memory from 10 to 100k entries on each layout."""
    parser = argparse.ArgumentParser(prog="store.py scale", description="The store at scale, on each layout.")
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
    parser.add_argument("--out", default="benchmarks/out/store_scale.json")
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

# ---- workers: many workers on one store ----------------------------------------------------------------------------

def worker(index: int, location: tuple, inbox, outbox, steps: int, risk: str, weights: str, grace_s) -> None:
    import torch
    torch.set_num_threads(1)
    from carnator_engine.backbones.tiny_dit import load_tiny_dit
    from carnator_engine.demo import DEMO_GUIDANCE, world
    from carnator_engine.euler import TinyDiTRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.schedule import flow_sigmas
    from carnator_engine.store import CarnatorStore
    from carnator_engine.store.backends import farm
    if grace_s is not None:   # short grace periods: the run's own leftovers (a killed worker's) are reclaimed in it
        farm.BLOB_GRACE_SECONDS = farm.ORPHAN_GRACE_SECONDS = grace_s
    model = load_tiny_dit(weights)
    url, blob_dir = location
    store = CarnatorStore(url, 1 << 30, blob_dir=blob_dir)
    config, sigmas = CarnatorConfig(probe_steps=3, risk=risk), flow_sigmas(steps)
    outbox.put(("ready", index))
    while True:
        job = inbox.get()
        if job is None:
            break
        user, step, attributes, seed = job
        prompt = world.prompt(attributes)
        started = time.perf_counter()
        result = generate(TinyDiTRunner(model, prompt, guidance_scale=DEMO_GUIDANCE), world.initial_noise([seed]),
                          sigmas, store, config, prompt, seed)
        read = world.analyze(result.latent[0].clamp(-1, 1))
        outbox.put(("done", index, user, step, {
            "worker": index, "user": user, "step": step, "reuse": result.decision.reuse,
            "exact_repeat": result.decision.exact_repeat, "model_calls": result.model_calls,
            "reused": result.decision.entry_id if result.decision.reuse else None,
            "stored_as": result.entry_id, "warnings": result.warnings, "seconds": time.perf_counter() - started,
            "all_right": all(read[name] == attributes[name] for name in world.ATTRIBUTES)}))
    store.close()


class Pool:
    def __init__(self, context, count: int, locations: list, args):
        self.context, self.args, self.locations = context, args, locations
        self.outbox = context.Queue()
        self.held: list = []   # answers that arrived while a restarted worker was awaited
        self.inboxes, self.processes = [None] * count, [None] * count
        for index in range(count):
            self.start(index)
        for _ in range(count):
            self.wait_ready()

    def start(self, index: int) -> None:
        self.inboxes[index] = self.context.Queue()
        self.processes[index] = self.context.Process(target=worker, args=(
            index, self.locations[index], self.inboxes[index], self.outbox, self.args.steps, self.args.risk,
            self.args.weights, self.args.grace_s), daemon=True)
        self.processes[index].start()

    def wait_ready(self) -> None:
        while True:
            message = self.outbox.get(timeout=300)
            if message[0] == "ready":
                return
            self.held.append(message)

    def answer(self, timeout: float):
        return self.held.pop(0) if self.held else self.outbox.get(timeout=timeout)

    def stop(self) -> None:
        for index, inbox in enumerate(self.inboxes):
            if self.processes[index].is_alive():
                inbox.put(None)
        for process in self.processes:
            process.join(timeout=60)


def serve(pool: Pool, sessions: list, workers: int, faults=None) -> list:
    """Runs every session to its end; returns one row per request. `faults(done, pool, in_flight)` may break
    things after each answer; it returns the (user, step) jobs to send again."""
    rows, in_flight = [], {}

    def send(user: int, step: int, shift: int = 0) -> None:
        target = (user + step + shift) % workers
        request = sessions[user][step]
        in_flight[(user, step)] = target
        pool.inboxes[target].put((user, step, request.attributes, request.seed))

    for user in range(len(sessions)):
        send(user, 0)
    while in_flight:
        try:
            message = pool.answer(timeout=600)
        except queue.Empty:
            raise RuntimeError(f"no answer for 10 minutes; waiting for {sorted(in_flight)}") from None
        if message[0] != "done":
            continue
        _, _, user, step, row = message
        if in_flight.get((user, step)) != row["worker"]:
            continue   # the answer of a request already sent again elsewhere
        del in_flight[(user, step)]
        rows.append(row)
        if step + 1 < len(sessions[user]):
            send(user, step + 1)
        for again in (faults(len(rows), pool, dict(in_flight)) if faults else []):
            send(*again, shift=1)
    return rows


def summarize(rows: list, steps: int) -> dict:
    calls = sum(r["model_calls"] for r in rows)
    stored_by = {r["stored_as"]: r["worker"] for r in rows if r["stored_as"]}
    return {"requests": len(rows), "hits": sum(r["reuse"] and not r["exact_repeat"] for r in rows),
            "exact_repeats": sum(r["exact_repeat"] for r in rows),
            # hits and repeats served from an entry that another worker stored: what sharing the store bought
            "reused_across_workers": sum(r["reuse"] and stored_by.get(r["reused"], r["worker"]) != r["worker"]
                                         for r in rows),
            "model_calls": calls,
            "calls_saved": round(1 - calls / (steps * len(rows)), 4),
            "all_attributes_right": round(sum(r["all_right"] for r in rows) / len(rows), 4),
            "with_warnings": sum(bool(r["warnings"]) for r in rows),
            "seconds": round(sum(r["seconds"] for r in rows), 1)}


class Faults:
    """SIGKILL a worker, kill -9 and restart Redis, drop every connection: each once, at set points of the run."""

    def __init__(self, server, total: int):
        self.server, self.log = server, []
        self.at = {max(2, total // 4): "kill_worker", max(3, total // 2): "restart_redis",
                   max(4, 3 * total // 4): "drop_connections"}

    def __call__(self, done: int, pool: Pool, in_flight: dict) -> list:
        fault = self.at.pop(done, None)
        if fault is None:
            return []
        self.log.append({"after_requests": done, "fault": fault, "in_flight": len(in_flight)})
        if fault == "kill_worker":
            victim = next(iter(in_flight.values()), 0)
            os.kill(pool.processes[victim].pid, signal.SIGKILL)
            pool.processes[victim].join()
            pool.start(victim)
            pool.wait_ready()
            return [job for job, where in in_flight.items() if where == victim]
        if fault == "restart_redis":
            self.server.stop(kill=True)
            time.sleep(0.5)   # requests in flight meanwhile find no server
            self.server.start()
        else:
            import redis
            redis.Redis.from_url(self.server.url).client_kill_filter(_type="normal", skipme=True)
        return []


def verify(location: tuple, rows: list, steps: int) -> dict:
    """Every acknowledged entry present and whole; every request with a store warning a full generation."""
    from carnator_engine.store import CarnatorStore
    url, blob_dir = location
    store = CarnatorStore(url, 1 << 30, blob_dir=blob_dir)
    acknowledged = [r["stored_as"] for r in rows if r["stored_as"]]
    lost = torn = 0
    for entry in acknowledged:
        try:
            record = store.record(entry)
            store.signature(record)
            store.trajectory(record)
        except Exception:  # noqa: BLE001 - counted, not raised: this is the measurement
            lost += 1
    for record in store.records(include_corrupt=True):
        try:
            store.signature(record), store.trajectory(record)
        except Exception:  # noqa: BLE001
            torn += 1
    faulted = [r for r in rows if r["warnings"]]
    degraded = [r for r in faulted if any("generated in full" in w for w in r["warnings"])]
    store.close()
    return {"acknowledged": len(acknowledged), "acknowledged_lost": lost, "torn_entries": torn,
            "requests_with_store_warnings": len(faulted),
            # a lookup or read that failed: the request must have been generated in full
            "reuse_lost_to_a_fault": len(degraded),
            "of_them_full_generations": sum(not r["reuse"] and r["model_calls"] == steps for r in degraded),
            # the request was served (hit or full) but its entry or hit count could not be written
            "served_but_not_stored_or_counted": len(faulted) - len(degraded)}


# Files a user could keep beside the blobs, named like Carnator's own (<32 hex>.blob) or its older names (<64
# hex>.blob, its .tmp/.gc) or close to them.
FOREIGN = ["notes.txt", "a" * 64 + ".blob.bak", "b" * 63 + ".blob", "C" * 64 + ".blob", "e" * 64 + ".blob.tmp",
           "f" * 64 + ".blob.1234abcd.tmp.keep", "d" * 64 + ".blob/inside.txt", "9" * 32 + ".blob",
           "8" * 64 + ".blob"]
FOREIGN_AGE_S = 7 * 24 * 3600   # a week old: past every grace period


def plant_foreign_files(blob_dir: str) -> dict:
    """The foreign files, each with its bytes and modification time, to compare with afterwards."""
    planted = {}
    for name in FOREIGN:
        path = os.path.join(blob_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(f"not Carnator's: {name}".encode())
        old = time.time() - FOREIGN_AGE_S
        os.utime(path, (old, old))
        planted[name] = os.stat(path).st_mtime
    return planted


def foreign_files_touched(blob_dir: str, planted: dict) -> list:
    touched = []
    for name, mtime in planted.items():
        path = os.path.join(blob_dir, name)
        try:
            with open(path, "rb") as handle:
                whole = handle.read() == f"not Carnator's: {name}".encode()
            if not whole or os.stat(path).st_mtime != mtime:
                touched.append(name)
        except OSError:
            touched.append(name)
    return touched


def blob_files(blob_dir: str) -> dict:
    names = [n for n in os.listdir(blob_dir) if n.endswith(".blob") and len(n) == 37 and n not in FOREIGN]
    return {"blob_files": len(names), "blob_mb": round(sum(os.path.getsize(os.path.join(blob_dir, n))
                                                           for n in names) / 2**20, 1)}


def main_workers(argv=None) -> int:
    """`workers`: worker processes serving sessions on one shared store, a farm, or a store each."""
    from carnator_engine.demo import DEMO_STEPS, DEMO_WEIGHTS, world
    from redis_server import RedisServer
    parser = argparse.ArgumentParser(prog="store.py workers", description="Many workers on one store.")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--session", type=int, default=8, help="requests per user session")
    parser.add_argument("--steps", type=int, default=DEMO_STEPS)
    parser.add_argument("--risk", default="balanced", choices=("safe", "balanced", "aggressive"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights", default=DEMO_WEIGHTS)
    parser.add_argument("--fixed-seed", action="store_true",
                        help="each session keeps its first noise seed (ComfyUI's 'fixed' habit: more reuse)")
    parser.add_argument("--settings", default="shared,farm,per_worker")
    parser.add_argument("--faults", action="store_true", help="break things during the shared and farm runs and "
                                                              "check")
    parser.add_argument("--grace-s", type=float, default=None,
                        help="the farm's grace periods in seconds (default: the store's own, 60 s and 600 s)")
    parser.add_argument("--start-method", choices=("spawn", "fork"), default="spawn",
                        help="how workers start: spawn (default: fresh interpreters, as separate workers are) or fork "
                             "(from this process's imports: seconds instead of tens on a busy machine, for a smoke "
                             "run)")
    parser.add_argument("--out", default="benchmarks/out/workers.json")
    args = parser.parse_args(argv)
    stream = world.iteration_stream(args.users * args.session, seed=args.seed, restart_every=args.session,
                                    one_seed_per_session=args.fixed_seed)
    sessions = [stream[u * args.session:(u + 1) * args.session] for u in range(args.users)]
    # the Redis servers' and the workers' folders, removed when main returns or fails (the finalizer)
    scratch = tempfile.TemporaryDirectory(prefix="carnator-workers-")
    root = scratch.name
    context = mp.get_context(args.start_method)
    results, load = {}, os.getloadavg()
    for setting in [s for s in args.settings.split(",") if s]:
        server = RedisServer(os.path.join(root, f"redis-{setting}"), appendonly=True).start() \
            if setting in ("shared", "farm") else None
        blob_dir, planted = os.path.join(root, "farm-blobs") if setting == "farm" else "", {}
        if blob_dir:
            from carnator_engine.store import CarnatorStore
            CarnatorStore(server.url, 1 << 30, blob_dir=blob_dir).close()   # marks the folder, binds the store
            planted = plant_foreign_files(blob_dir)
        locations = [(server.url, blob_dir)] * args.workers if server else \
            [(os.path.join(root, f"{setting}-{i}"), "") for i in range(args.workers)]
        faults = Faults(server, len(stream)) if args.faults and server else None
        started = time.perf_counter()
        pool = Pool(context, args.workers, locations, args)
        try:
            rows = serve(pool, sessions, args.workers, faults)
        finally:
            pool.stop()
        results[setting] = {**summarize(rows, args.steps), "wall_s": round(time.perf_counter() - started, 1),
                            "rows": rows}
        if faults:
            results[setting]["faults"] = faults.log
        if server:
            results[setting]["check"] = verify(locations[0], rows, args.steps)
        if blob_dir:
            results[setting]["check"].update(blob_files(blob_dir), foreign_files=len(planted),
                                             foreign_files_touched=foreign_files_touched(blob_dir, planted))
        if server:
            server.stop()
    header = (f"{'store':12} {'requests':>8} {'hits':>5} {'repeats':>7} {'across':>6} {'calls saved':>11} "
              f"{'all right':>9} {'wall s':>7}")
    print(f"{args.workers} workers, {args.users} users x {args.session} requests, {args.steps} steps, {args.risk}")
    print(header + "\n" + "-" * len(header))
    for setting, r in results.items():
        print(f"{setting:12} {r['requests']:>8} {r['hits']:>5} {r['exact_repeats']:>7} {r['reused_across_workers']:>6} "
              f"{100 * r['calls_saved']:>10.1f}% "
              f"{100 * r['all_attributes_right']:>8.1f}% {r['wall_s']:>7.1f}")
        if "check" in r:
            print(f"  faults {[f['fault'] for f in r.get('faults', [])]}: {r['check']}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"args": vars(args), "machine": {"cpus": os.cpu_count(), "cpu": cpu_model()},
                   "load_average_at_start": load, "load_average_at_end": os.getloadavg(),
                   "results": results}, handle, indent=2)
    print(f"wrote {args.out}")
    scratch.cleanup()
    return 0

# ---- write-back: what the write takes off a miss -------------------------------------------------------------------

CPU_PRESET = dict(PRESETS["smoke"], dim=128, layers=2, ffn=256, latent=(1, 16, 8, 32, 32), steps=10, probe=2)


def parse_write_back_args(argv=None):
    parser = argparse.ArgumentParser(prog="store.py write-back",
                                     description="What the background write-back takes off a miss.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", choices=["cpu", "smoke", "real"], default="cpu")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--session", type=int, default=3, help="requests in a row for the session rows")
    parser.add_argument("--comfyui", default=None)
    parser.add_argument("--store-dir", default=None)
    return parser.parse_args(argv)


def write_back(args):
    """`write-back`: plain, a miss until it returns and until its entry is written, a session of misses."""
    preset = CPU_PRESET if args.preset == "cpu" else PRESETS[args.preset]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    version = import_comfy(find_comfyui(args.comfyui), cpu=not cuda)
    from carnator_engine.hosts.comfyui import ComfyRunner
    from carnator_engine.pipeline import CarnatorConfig, generate
    from carnator_engine.store import CarnatorStore

    model, params = build_model(preset, device, torch.bfloat16 if cuda else torch.float32, 0)
    n = preset["steps"]
    context = torch.randn(1, preset["text_len"], TEXT_DIM, generator=torch.Generator().manual_seed(0))
    positive, negative = [[context, {}]], [[torch.zeros_like(context), {}]]
    config = CarnatorConfig(probe_steps=preset["probe"], block_size=preset["block_size"])
    root = tempfile.mkdtemp(prefix="carnator_write_back_", dir=args.store_dir)
    stores = []

    def noise(seed):
        return torch.randn(tuple(preset["latent"]), generator=torch.Generator().manual_seed(seed))

    def fresh_store():
        stores.append(CarnatorStore(os.path.join(root, str(len(stores))), 16 << 30))
        return stores[-1]

    def carnator(store, seed, wait_for_the_write):
        """(the result, seconds until generate() returns, seconds until its entry is written if waited for)."""
        runner = ComfyRunner(model, positive, negative, cfg=1.0, sampler_name="euler", scheduler="simple", steps=n,
                             seed=seed)
        with timed() as returned:
            result = generate(runner, noise(seed), runner.sigmas, store, config, PROMPT, seed)
        if wait_for_the_write and result.entry_id is None:
            raise RuntimeError(f"the entry was not written: {result.warnings}")
        return result, returned["seconds"], time.perf_counter() - returned["start"]

    def plain(seed):
        sigmas = ComfyRunner.schedule(model, "euler", "simple", n)
        with timed() as span:
            plain_sample(model, noise(seed), sigmas, positive, negative, seed)
        return span["seconds"]

    out = {"device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
           "cpu_count": os.cpu_count(), "torch": torch.__version__, "comfyui_version": version, "params": params,
           "preset": {**preset, "latent": list(preset["latent"])}, "repeats": args.repeats}
    try:
        plain(0), carnator(fresh_store(), 0, True)     # warm-ups, not counted
        times = {"plain": [], "returned": [], "written": [], "queueing": []}
        for _ in range(args.repeats):
            times["plain"].append(plain(1))
            result, returned, written = carnator(fresh_store(), 1, True)
            if result.decision.reuse:
                raise RuntimeError(f"expected a miss on an empty store, got {result.summary()}")
            times["returned"].append(returned), times["written"].append(written)
            times["queueing"].append(result.seconds["write_back"])
        out["entry_bytes"] = stores[-1].stats()["entry_bytes"]
        session = {}
        for waits in (True, False):     # the same requests in the same order: the gate decides alike in both
            store = fresh_store()
            started = time.perf_counter()
            hits = sum(carnator(store, seed, waits)[0].decision.reuse for seed in range(2, 2 + args.session))
            store.writer.settle()
            session["waiting for each write" if waits else "in the background"] = time.perf_counter() - started
        out["session_hits"] = hits
    finally:
        for store in stores:
            store.close()
        shutil.rmtree(root, ignore_errors=True)
    medians = {name: median(values) for name, values in times.items()}
    medians["write_after_return"] = median([w - r for w, r in zip(times["written"], times["returned"])])
    out.update(seconds=times, medians=medians, session_seconds=session,
               returned_vs_plain_pct=100 * (medians["returned"] / medians["plain"] - 1),
               written_vs_plain_pct=100 * (medians["written"] / medians["plain"] - 1))
    reports.write(args.out, out)
    print(f"{out['device']} ({out['cpu_count']} cores), latent {preset['latent']}, N={n}, entry "
          f"{out['entry_bytes'] / 2**20:.1f} MiB, {args.repeats} repeats, medians:")
    print(f"  plain ComfyUI                          {medians['plain']:.3f} s")
    print(f"  miss, until it returns (now)           {medians['returned']:.3f} s  "
          f"{out['returned_vs_plain_pct']:+.1f} %")
    print(f"  miss, until its entry is written       {medians['written']:.3f} s  "
          f"{out['written_vs_plain_pct']:+.1f} %")
    print(f"  the write after the return (paired)    {medians['write_after_return'] * 1e3:.1f} ms")
    print(f"  the write-back inside the request      {medians['queueing'] * 1e3:.1f} ms (copies, submit)")
    for name, seconds in session.items():
        print(f"  {args.session} requests in a row ({hits} hits), {name}: {seconds:.2f} s")
    return out


def main_write_back(argv=None) -> int:
    write_back(parse_write_back_args(argv))
    return 0


SUBCOMMANDS = {"scale": main_scale, "workers": main_workers, "write-back": main_write_back}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        print(f"store.py: name a subcommand: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
