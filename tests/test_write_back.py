"""The write-back in the background (carnator_engine/store/write_back.py): a request has its result before its entry is
written; this process's later reads see what it queued, another process sees an entry whole or not at all; a failed
write is the next request's warning and leaves the committed entries as they were; the queue is bounded, written
out by close() and at exit, and the size limit still holds.

Ordering is made with events, never with timing: the `held_writes` fixture (tests/held_writes.py) keeps every store
write waiting until some thread has to wait for the writer, which is exactly the moment a missing wait would show.
GUARD only ends a test that went wrong; no passing test reaches it.
"""
import os
import subprocess
import sys
import threading

import pytest
import torch

from carnator_engine.store.backends.disk import DiskBackend
from carnator_engine.store import CarnatorStore
from carnator_engine.store.write_back import BackgroundWriter
from held_writes import GUARD
from test_pipeline import _run, _through_the_gate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "a red circle moving left"


@pytest.fixture(params=["disk", "redis"])
def either_store(request, tmp_path):
    location = str(tmp_path / "cache") if request.param == "disk" else request.getfixturevalue("redis_server").url
    opened = CarnatorStore(location, 64 << 20)
    yield opened
    opened.close()


def test_the_result_is_out_before_its_entry_is_written(tiny_model, store, held_writes):
    result = _run(tiny_model, store, PROMPT, 1)
    named = result.summary()["stored_as"]
    assert named and store.records() == []              # returned while its write still waits
    held_writes.set()
    assert result.entry_id == named                     # entry_id waits for the write
    assert store.trajectory(store.record(named)).final is not None


def test_the_entry_keeps_the_result_as_it_was_returned(tiny_model, store, held_writes):
    result = _run(tiny_model, store, PROMPT, 1)
    returned = result.latent.clone()
    result.latent.add_(1.0)             # the caller changes its tensor in place before the write has run
    held_writes.set()
    torch.testing.assert_close(store.trajectory(store.record(result.entry_id)).final, returned, atol=0, rtol=0)


def test_a_hit_right_after_a_miss_finds_the_entry_being_written(tiny_model, either_store, held_writes):
    first = _run(tiny_model, either_store, PROMPT, 1)
    hit = _through_the_gate(tiny_model, either_store, PROMPT, 1, nudge=1e-4)    # probe, lookup, gate, resume
    assert hit.decision.reuse and hit.decision.entry_id == first.summary()["stored_as"]


def test_an_exact_repeat_right_after_a_miss_finds_the_entry_being_written(tiny_model, either_store, held_writes):
    first = _run(tiny_model, either_store, PROMPT, 1)
    again = _run(tiny_model, either_store, PROMPT, 1)
    assert again.decision.exact_repeat and again.decision.entry_id == first.summary()["stored_as"]
    assert again.model_calls == 0 and torch.equal(again.latent, first.latent)


def test_another_process_sees_an_entry_whole_or_not_at_all(tiny_model, store, monkeypatch):
    """The write is held inside the disk backend's commit (its blob written, its metadata not yet): another worker's
    store on the same folder, which cannot wait for this process's queue, misses; once committed it hits."""
    blob_written, release = threading.Event(), threading.Event()
    write_blob = DiskBackend._write_blob

    def held(backend, entry_id, data):
        nonce = write_blob(backend, entry_id, data)
        blob_written.set()
        assert release.wait(GUARD)
        return nonce
    monkeypatch.setattr(DiskBackend, "_write_blob", held)
    first = _run(tiny_model, store, PROMPT, 1)
    assert blob_written.wait(GUARD)
    other = CarnatorStore(store.location, 64 << 20)
    try:
        assert other.records(include_corrupt=True) == []
        assert not _through_the_gate(tiny_model, other, PROMPT, 1, nudge=1e-4).decision.reuse
        release.set()
        assert first.entry_id
        again = _run(tiny_model, other, PROMPT, 1)
        assert again.decision.exact_repeat and again.decision.entry_id == first.entry_id
        assert other.drain_problems() == []
    finally:
        release.set()
        other.close()


def test_a_failed_write_is_the_next_requests_warning_and_keeps_the_committed_entries(tiny_model, store, monkeypatch):
    kept = _run(tiny_model, store, "a green square moving right", 3).entry_id
    kept_record = store.record(kept)
    put, attempts = CarnatorStore.put, []

    def second_one_fails(self, **entry):
        attempts.append(entry["prompt"])
        if len(attempts) == 1:
            raise RuntimeError("the serialiser crashed")
        return put(self, **entry)
    monkeypatch.setattr(CarnatorStore, "put", second_one_fails)
    failed = _run(tiny_model, store, PROMPT, 1)
    assert failed.entry_id is None and not failed.warnings and torch.isfinite(failed.latent).all()
    following = _run(tiny_model, store, "a blue square moving up", 2)
    assert [w for w in following.warnings if failed.storing.entry_id in w and "serialiser crashed" in w]
    assert following.entry_id                                        # the writer went on
    assert {r.entry_id for r in store.records(include_corrupt=True)} == {kept, following.entry_id}
    now = store.record(kept)
    assert (now.sig_sha256, now.blob_sha256, now.corrupt) == (kept_record.sig_sha256, kept_record.blob_sha256, None)
    store.signature(now), store.trajectory(now)
    assert store.drain_problems() == []


def test_a_further_write_waits_while_the_queue_is_full(held_writes):
    problems = []
    writer = BackgroundWriter(problems.append, depth=2)
    queued = [writer.submit(f"held{n}", lambda: held_writes.wait(GUARD)) for n in range(2)]
    assert not any(p.done for p in queued)
    writer.submit("third", lambda: None)   # no room: returns once the oldest write is done
    assert queued[0].done
    held_writes.set()
    writer.settle()
    assert problems == []


def test_the_size_limit_holds_with_queued_writes(tiny_model, tmp_path):
    small = CarnatorStore(str(tmp_path / "small"), size_limit_bytes=1 << 20)
    for seed in range(6):
        _run(tiny_model, small, PROMPT, seed)
    small.writer.settle()
    stats = small.stats()
    assert stats["bytes"] <= 1 << 20 and 0 < stats["entries"] < 6
    small.close()


def test_close_writes_out_the_queue(tiny_model, tmp_path, held_writes):
    location = str(tmp_path / "cache")
    opened = CarnatorStore(location, 64 << 20)
    stored_as = _run(tiny_model, opened, PROMPT, 1).summary()["stored_as"]
    opened.close()
    reopened = CarnatorStore(location, 64 << 20)
    reopened.trajectory(reopened.record(stored_as))
    reopened.close()


EXITING = """
import sys, threading
sys.path[:0] = [{root!r}, {tests!r}]
import torch
from carnator_engine.backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT
from carnator_engine.store import CarnatorStore
from conftest import WORDS
from test_pipeline import _run
put = CarnatorStore.put
def after_the_main_thread(self, **entry):
    threading.main_thread().join()     # returns once the main thread has ended: the process is exiting
    return put(self, **entry)
CarnatorStore.put = after_the_main_thread
torch.manual_seed(0)
model = TinyVideoDiT(TinyDiTConfig(vocabulary=WORDS, dim=64, heads=2, layers=2, text_layers=1)).eval()
store = CarnatorStore({location!r}, 64 << 20)
def request():   # in a daemon thread, as ComfyUI's prompt worker runs
    print(_run(model, store, {prompt!r}, 1).summary()["stored_as"], flush=True)
worker = threading.Thread(target=request, daemon=True)
worker.start()
worker.join()
"""


def test_the_end_of_the_process_writes_out_the_queue(tmp_path):
    location = str(tmp_path / "cache")
    script = EXITING.format(root=ROOT, tests=os.path.join(ROOT, "tests"), location=location, prompt=PROMPT)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stored_as = done.stdout.split()[-1]
    reopened = CarnatorStore(location, 64 << 20)
    record = reopened.record(stored_as)           # written after the main thread had ended
    reopened.signature(record), reopened.trajectory(record)
    assert reopened.drain_problems() == []
    reopened.close()
