"""The files Carnator writes beside other people's files carry the proof that they are Carnator's: their first bytes
(the header) name a secret that only the store's own records hold. A file name is no proof (anyone may name a file
`<32 hex>.blob`), and neither is a value anyone can read in the folder (the marker's identity, which older files
carry): a file is deleted only when its header holds the per-file nonce the store recorded for that very file
before writing it (`remove_own`), whatever its name and age. A file copied over another keeps its own nonce, so
it is never taken for the one it replaced.

New files are created with O_EXCL (`create_new`): whatever sits at the name (someone's file, a link, a folder) is
never overwritten or followed. `write_whole` (a temporary, fsynced, renamed into place) replaces a file in place,
for files whose name is fixed (the index snapshot): the caller checks first that what it replaces is its own.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import uuid
from typing import Optional

MAGIC = b"carnator file\n"
HEADER_BYTES = len(MAGIC) + 32 + 1   # the magic, the store's identity (32 hex digits), a newline


def header(identity: str) -> bytes:
    return MAGIC + identity.encode("ascii") + b"\n"


def strip(data: bytes) -> bytes:
    """A file's bytes without its header (those of a file written before the header existed are returned as
    they are: the checksum its entry holds still decides whether they are whole)."""
    if data[:len(MAGIC)] == MAGIC and data[HEADER_BYTES - 1:HEADER_BYTES] == b"\n":
        return data[HEADER_BYTES:]
    return data


def read_regular(path: str, limit: Optional[int] = None) -> bytes:
    """At most `limit` bytes (None: all) of the regular file at `path`, opened without blocking and without
    following a link: a FIFO, a device (/dev/zero), a folder or a link there gives OSError (never a hang, never an
    endless read). FileNotFoundError where nothing is there."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        left = found.st_size if limit is None else limit
        chunks = []
        while left > 0:
            chunk = os.read(descriptor, min(left, 1 << 24))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


NOT_A_FILE = (errno.ELOOP, errno.EINVAL, errno.EISDIR, errno.ENXIO, errno.ENODEV)   # what read_regular refuses


def read_part(path: str, size: Optional[int] = None) -> Optional[bytes]:
    """The bytes of a file Carnator wrote, its header taken off, at most `size` of them past the header (one more
    byte, so that a longer file fails its checksum rather than being read whole): None where nothing is at `path`,
    b"" where something that is no regular file is (its checksum fails: the entry is reported corrupt)."""
    try:
        return strip(read_regular(path, None if size is None else HEADER_BYTES + size + 1))
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in NOT_A_FILE:
            return b""
        raise


def owner(path: str) -> Optional[str]:
    """The identity of the store whose header the regular file at `path` starts with, else None (not a file, a
    link, someone else's file, or one written before the header existed)."""
    try:
        if os.path.islink(path) or not os.path.isfile(path):
            return None
        with open(path, "rb") as handle:
            start = handle.read(HEADER_BYTES)
    except OSError:
        return None
    if len(start) == HEADER_BYTES and start.startswith(MAGIC) and start.endswith(b"\n"):
        return start[len(MAGIC):-1].decode("ascii", "replace")
    return None


def _sync_folder(folder: str) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def holds(path: str, secret: str):
    """(the file's identity (st_dev, st_ino), its size) when the regular file at `path` starts with the header of
    `secret`; None for anything else (no file, a link, a folder, a FIFO, someone else's bytes)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode) or os.read(descriptor, HEADER_BYTES) != header(secret):
            return None
        return (found.st_dev, found.st_ino), found.st_size
    except OSError:
        return None
    finally:
        os.close(descriptor)


def remove_own(path: str, secret: str) -> Optional[int]:
    """Deletes the file at `path` when its header holds `secret` (and it is still that same file when unlinked):
    the bytes freed; 0 when nothing is at `path`; None when something else is there (left alone). OSError when
    the unlink itself fails (a read-only folder): the caller keeps its records of the file."""
    if not os.path.lexists(path):
        return 0
    held = holds(path, secret)
    if held is None:
        return None
    identity, size = held
    now = os.lstat(path)
    if (now.st_dev, now.st_ino) != identity:
        return None            # replaced since it was read: not the file that proved itself
    os.remove(path)
    return size


def create_new(final: str, data: bytes, secret: str) -> None:
    """`data` after the header of `secret`, in a file this call creates at `final` (O_EXCL, no link followed:
    FileExistsError where anything is at that name, which is left untouched), fsynced with its folder. A failure
    removes the file it created, and only that one."""
    descriptor = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    made = os.fstat(descriptor)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(header(secret))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        _sync_folder(os.path.dirname(final))
    except BaseException:
        try:
            now = os.lstat(final)
            if (now.st_dev, now.st_ino) == (made.st_dev, made.st_ino):
                os.remove(final)
        except OSError:
            pass
        raise


class LockFile:
    """A lock the processes sharing a folder take (flock, released by the kernel when its holder dies, however it
    dies), on a file of the store's own: made with O_EXCL when missing, opened without following a link or
    blocking, and only ever locked, never written or deleted."""

    def __init__(self, path: str, secret: str):
        try:
            create_new(path, b"", secret)
        except FileExistsError:
            pass
        try:
            self._descriptor = os.open(path, os.O_RDWR | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except PermissionError:   # a read-only folder: flock needs no write access (NFS's exclusive lock does)
            self._descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        if not stat.S_ISREG(os.fstat(self._descriptor).st_mode):
            os.close(self._descriptor)
            raise OSError(errno.EINVAL, "not a regular file: a lock file of the store's own is expected", path)

    @contextlib.contextmanager
    def held(self, exclusive: bool = True):
        fcntl.flock(self._descriptor, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def held_if_free(self):
        """Yields whether the exclusive lock was taken (False at once where any process holds it)."""
        try:
            fcntl.flock(self._descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self._descriptor, fcntl.LOCK_UN)

    def close(self) -> None:
        """Idempotent, as a store's close is."""
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


def write_whole(final: str, data: bytes, identity: str = "") -> None:
    """`data` at `final`, after the header of `identity` (none when empty), whole or not at all, replacing what is
    there (the caller proved it its own). A failure removes what it wrote."""
    temporary = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
    written = [temporary]
    try:
        with open(temporary, "wb") as handle:
            if identity:
                handle.write(header(identity))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        written = [final]     # ours now; what stood there before is never removed by a failure
        _sync_folder(os.path.dirname(final))
    except BaseException:
        for path in written:
            try:
                os.remove(path)
            except OSError:
                pass
        raise
