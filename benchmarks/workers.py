"""Many workers: worker processes serve the evaluation world's request stream, each user's session spread over
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

    python benchmarks/workers.py                       # 4 workers, 6 users x 8 requests, every setting
    python benchmarks/workers.py --faults --out benchmarks/results/store/workers_faults.json
    python benchmarks/workers.py --settings farm --faults --out benchmarks/results/store/workers_farm.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


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


# Files a user could keep beside the blobs, named close to Carnator's own names (<64 hex>.blob, its .tmp/.gc).
FOREIGN = ["notes.txt", "a" * 64 + ".blob.bak", "b" * 63 + ".blob", "C" * 64 + ".blob", "e" * 64 + ".blob.tmp",
           "f" * 64 + ".blob.1234abcd.tmp.keep", "d" * 64 + ".blob/inside.txt"]
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
    names = [n for n in os.listdir(blob_dir) if n.endswith(".blob") and len(n) == 69]
    return {"blob_files": len(names), "blob_mb": round(sum(os.path.getsize(os.path.join(blob_dir, n))
                                                           for n in names) / 2**20, 1)}


def main(argv=None) -> int:
    from carnator_engine.demo import DEMO_STEPS, DEMO_WEIGHTS, world
    from redis_server import RedisServer
    from store_scale import cpu_model
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    parser.add_argument("--out", default="benchmarks/results/store/workers.json")
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


if __name__ == "__main__":
    sys.exit(main())
