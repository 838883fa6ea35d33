"""Stores generations without making the request wait for it: each store has one BackgroundWriter (store.writer)
whose thread runs the queued writes in order, while the caller already has its latent.

Why: serialising an entry (checkpoints, connectivity, checksums) and the backend's commit (SQLite's fsync, or a
round trip to Redis) took ~0.36 s of a 30 s generation on an H200, most of a miss's cost over plain sampling; in a
workflow the write now overlaps what comes next (the VAE decode, the next request's probe).

What holds:
  - this process reads what it queued: the pipeline and the cache browser's routes wait for the store's writes
    (settle) before they read it, so a repeat or a hit right after a miss finds the entry; another process sees an
    entry whole or not at all (the backends commit its parts before, or with, its metadata);
  - at most DEPTH generations wait in memory per store: a further one waits for the oldest to be written (the
    request then pays that write, as it did before; nothing is dropped);
  - a write that fails is reported (store.report_problem): logged at once, and a warning on the next request's
    result; the entries already committed are untouched;
  - store.close() and the end of the process write the queue out: the thread is not a daemon, even when a daemon
    thread (ComfyUI's prompt worker) queued the write, and it ends once its queue is empty, so an idle store holds
    no thread. A process killed meanwhile loses its queued entries whole.
"""
from __future__ import annotations

import collections
import threading
from typing import Callable, Optional

DEPTH = 2   # generations queued or being written per store (each holds its checkpoints in host memory)


class PendingWrite:
    """A generation queued for the store, under the entry id it will have."""

    def __init__(self, entry_id: str):
        self.entry_id = entry_id
        self._done = threading.Event()
        self.failure: Optional[str] = None    # once done: why it was not stored (as reported), None when it was

    def finish(self, failure: Optional[str]) -> None:
        self.failure = failure
        self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Optional[str]:
        """The entry id once it is written, or None if the write failed (the store reported why)."""
        self._done.wait()
        return self.entry_id if self.failure is None else None


class BackgroundWriter:
    """The write queue of one store. A job is a callable that stores one entry; what it raises goes to `report`."""

    def __init__(self, report: Callable[[str], object], depth: int = DEPTH):
        self._report = report
        self._depth = depth
        self._jobs: collections.deque = collections.deque()
        self._submitted = 0           # writes queued so far; the thread finishes them in this order
        self._finished = 0            # of those, written or reported
        self._draining = False        # a thread is running the queue
        self._changed = threading.Condition()

    def submit(self, entry_id: str, write: Callable[[], object]) -> PendingWrite:
        """Queues `write` under `entry_id`; waits first while DEPTH writes are unfinished."""
        pending = PendingWrite(entry_id)
        with self._changed:
            while self._submitted - self._finished >= self._depth:
                self._wait_for_the_thread()
            self._jobs.append((pending, write))
            self._submitted += 1
            starting, self._draining = not self._draining, True
        if starting:
            try:
                threading.Thread(target=self._drain, name="carnator-store-writer", daemon=False).start()
            except RuntimeError:   # no new thread at interpreter shutdown: the caller writes the queue itself
                self._drain()
        return pending

    def settle(self) -> None:
        """Returns once every write queued before the call is done (written or reported)."""
        with self._changed:
            queued = self._submitted
            while self._finished < queued:
                self._wait_for_the_thread()

    def _wait_for_the_thread(self) -> None:
        """Where a caller waits for queued writes (self._changed held): one place, so a test can act exactly then."""
        self._changed.wait()

    def _drain(self) -> None:
        while True:
            with self._changed:
                if not self._jobs:
                    self._draining = False
                    return
                pending, write = self._jobs.popleft()
            pending.finish(self._run(pending.entry_id, write))
            with self._changed:
                self._finished += 1
                self._changed.notify_all()

    def _run(self, entry_id: str, write) -> Optional[str]:
        """None once written; the failure as reported when the write failed."""
        try:
            write()
            return None
        except Exception as error:  # noqa: BLE001 - whatever failed, the request's result is already out: report it
            failure = f"the generation to be stored as {entry_id} was not stored: {error}"
            self._report(failure)
            return failure
