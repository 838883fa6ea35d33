"""Many workers on one Redis, faults included: a worker killed with SIGKILL in the middle of its writes, the
server killed and restarted from its append-only file, connections dropped under a running store. Nothing
acknowledged is lost, nothing torn is ever served, and an affected request is a full generation."""
import os
import signal
import subprocess
import sys
import time

import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, decide, generate, lookup, probe, resume
from carnator_engine.schedule import flow_sigmas
from carnator_engine.store import CarnatorStore

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRITER = """
import sys, torch
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
from carnator_engine.store import CarnatorStore, TrajectoryPayload
from test_store import _signature
store = CarnatorStore({url!r}, 1 << 40)
for seed in range(10_000):
    latent = torch.full((1, 4 << 20), float(seed), dtype=torch.float16)   # 8 MB blobs: writes take a while
    entry = store.put(bucket="b", prompt="w", seed=seed, steps=10, probe_steps=2, signature=_signature(seed),
                      payload=TrajectoryPayload({{4: latent}}, {{}}), latent_shape=latent.shape)
    print(entry, seed, flush=True)
    sys.stdin.readline()              # the go-ahead: never more than one write ahead of the test
"""


def _verify_everything(url, seeded: bool = False) -> dict:
    """Every listed entry reads back whole: its signature and blob match their checksums (and, for the writer's
    entries, `seeded`, its checkpoint holds its seed)."""
    store = CarnatorStore(url, 1 << 40)
    seeds = {}
    for record in store.records(include_corrupt=True):
        assert record.corrupt is None
        payload = store.trajectory(record)
        assert not seeded or bool((payload.checkpoints[4] == float(record.seed)).all())
        store.signature(record)
        seeds[record.entry_id] = record.seed
    assert store.drain_problems() == []
    store.close()
    return seeds


def killed_mid_write(command: list, after: int) -> dict:
    """Runs a writer that prints "<entry id> <seed>" per acknowledged entry, then waits for a line on its stdin
    before its next write, and kills it with SIGKILL just into the write after the `after`th: exactly one write is
    in flight when it dies, however loaded the machine. The acknowledged {id: seed}."""
    writer = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    acknowledged = {}
    for line in writer.stdout:
        entry, seed = line.split()
        acknowledged[entry] = int(seed)
        writer.stdin.write("\n")
        writer.stdin.flush()
        if len(acknowledged) == after:
            time.sleep(0.05)          # into the next write (or before it: at most one more entry either way)
            os.kill(writer.pid, signal.SIGKILL)
            break
    writer.wait()
    writer.stdin.close()
    assert writer.returncode == -signal.SIGKILL
    return acknowledged


def test_kill_9_mid_write_and_a_server_restart_lose_nothing_acknowledged(redis_server):
    acknowledged = killed_mid_write([sys.executable, "-c", WRITER.format(
        root=ROOT, tests=os.path.join(ROOT, "tests"), url=redis_server.url)], after=6)
    stored = _verify_everything(redis_server.url, seeded=True)
    assert acknowledged.items() <= stored.items() and len(stored) <= 7
    redis_server.stop(kill=True)      # the server dies too: only its append-only file is left
    redis_server.start()
    assert _verify_everything(redis_server.url, seeded=True) == stored


def test_a_dropped_connection_between_gate_and_resume_is_reconnected_or_a_full_generation(redis_server, tiny_model):
    import redis
    store = CarnatorStore(redis_server.url, 64 << 20)
    sigmas, config = flow_sigmas(12), CarnatorConfig(probe_steps=2)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(1))
    runner = TinyDiTRunner(tiny_model, "a red circle")
    first = generate(runner, noise, sigmas, store, config)
    probed = probe(runner, noise * 1.0001, sigmas, config)
    decision = decide(probed, lookup(store, probed, config), config)
    assert decision.reuse and decision.entry_id == first.entry_id
    admin = redis.Redis.from_url(redis_server.url)
    assert admin.client_kill_filter(_type="normal", skipme=True) >= 1   # every worker's connection dropped
    result = resume(runner, probed, decision, store, config)              # the client reconnects
    assert result.decision.reuse and result.entry_id and not result.warnings
    redis_server.stop(kill=True)                                           # now the server is gone: a full one
    probed = probe(runner, noise * 1.0002, sigmas, config)
    again = resume(runner, probed, decision, store, config)
    assert not again.decision.reuse and again.model_calls == 12 and again.entry_id is None
    assert any("cannot be reached" in w for w in again.warnings)
    redis_server.start()
    assert _verify_everything(redis_server.url).keys() == {first.entry_id, result.entry_id}
