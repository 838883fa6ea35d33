"""The files Carnator writes beside other people's files carry the proof that they are Carnator's: their first bytes
name the store that wrote them. A file name is no proof (anyone may name a file `<64 hex>.blob`), so a file is
deleted only when its content proves it is ours (`owner`), whatever its name and age.

A file is written whole or not at all: a temporary file `<final name>.<8 hex>.tmp` (which carries the header from
its first write, so even an interrupted one is provably ours), fsynced, renamed into place, its folder fsynced.
"""
from __future__ import annotations

import os
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


def write_whole(final: str, data: bytes, identity: str = "", shared_name: bool = False) -> None:
    """`data` at `final`, after the header of store `identity` (none when empty), whole or not at all. A failure
    removes what it wrote; a `shared_name` (the farm's content-hash names) only the temporary: the final name may
    be another entry's file of the same bytes."""
    temporary = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(temporary, "wb") as handle:
            if identity:
                handle.write(header(identity))
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
        descriptor = os.open(os.path.dirname(final), os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except BaseException:
        for path in (temporary,) if shared_name else (temporary, final):
            try:
                os.remove(path)
            except OSError:
                pass
        raise
