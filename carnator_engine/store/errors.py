"""The store's errors, below both the store and its backends so that neither imports the other to raise one."""


class StoreError(RuntimeError):
    """A store's medium failed or refused: the message names the location and what to do."""


class CorruptEntryError(StoreError):
    """An entry's bytes do not match what was written (torn, truncated or overwritten)."""


class StoreUnavailable(StoreError):
    """The medium cannot be reached now (a server down, a shared folder not mounted), though the store exists: a
    store opened this way serves full generations and reconnects (store.py), instead of failing the request."""
