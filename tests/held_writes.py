"""Store writes held until they matter: for tests of the background write-back (carnator_engine/store/write_back.py)
that need a write still pending at an exact moment, with no timing (the `held_writes` fixture in conftest.py)."""
import threading

from carnator_engine.store import CarnatorStore
from carnator_engine.store.write_back import BackgroundWriter

GUARD = 60.0   # seconds: ends a test whose event never came; a passing test never reaches it


def hold_writes(monkeypatch) -> threading.Event:
    """Each store write (CarnatorStore.put, in the store's background writer) waits until some thread has to wait
    for a writer (a reader settling, a submit with a full queue, close): a write still pending exactly when a
    missing wait would show. Set the returned event to let a write go; the write clears it, so the next one is held
    again."""
    release = threading.Event()
    put, wait = CarnatorStore.put, BackgroundWriter._wait_for_the_thread

    def held(self, **entry):
        assert release.wait(GUARD), "nothing waited for this write"
        release.clear()
        return put(self, **entry)

    def waiting(self):
        release.set()
        wait(self)
    monkeypatch.setattr(CarnatorStore, "put", held)
    monkeypatch.setattr(BackgroundWriter, "_wait_for_the_thread", waiting)
    return release
