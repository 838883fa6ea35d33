"""The farm layout's shared folder of trajectory blobs (farm.py): one file per distinct blob, named by its content.

A blob is `<sha256 of its bytes>.blob`, written whole or not at all (a temporary file `<name>.<8 hex>.tmp`,
fsynced, renamed into place, the folder fsynced), so a reader on any worker sees either no file or the whole one;
the name is the checksum CarnatorStore verifies on every read, so a torn or damaged file is found and reported,
never served. Two workers writing the same blob write the same bytes under the same name. The folder carries the
store marker (marker.py): it is opened only when it is a Carnator folder (or empty, and then marked), and only
files under the two names above are ever deleted from it; anything else someone puts there is never touched.
"""
from __future__ import annotations

import os
import re

from ..errors import StoreError
from ..marker import check_location, claim
from .disk import DiskBackend, _advice

BLOB_NAME = re.compile(r"[0-9a-f]{64}\.blob")
BLOB_TEMPORARY = re.compile(r"[0-9a-f]{64}\.blob\.[0-9a-f]{8}\.tmp")


class BlobFolder:
    def __init__(self, path: str):
        if not isinstance(path, str) or not os.path.isabs(os.path.expanduser(path.strip())):
            raise StoreError(f"blob_dir {str(path)[:200]!r} is not an absolute folder path: give the folder every "
                             "worker mounts, such as /mnt/shared/carnator_blobs")
        self.location = check_location(path.strip())
        self.identity = claim(self.location)   # StoreError for a folder that is not Carnator's; nothing touched

    def _guard(self, action: str, work):
        try:
            return work()
        except OSError as error:
            raise StoreError(f"Carnator blob folder {self.location!r} could not {action} ({error}): "
                             f"{_advice(error)}") from error

    def path(self, name: str) -> str:
        if not BLOB_NAME.fullmatch(name):
            raise StoreError(f"Carnator blob folder {self.location!r}: {name[:80]!r} is not a blob name")
        return os.path.join(self.location, name)

    def write(self, name: str, data: bytes) -> None:
        """Whole or not at all; over an existing file of that name too (a damaged copy is replaced, a reader of the
        old one keeps its open file); a failure removes only the temporary file."""
        self._guard("write a blob", lambda: DiskBackend._write_file(self.path(name), data, shared_name=True))

    def read(self, name: str):
        """The file's bytes, or None when it is not there."""
        def work():
            try:
                with open(self.path(name), "rb") as handle:
                    return handle.read()
            except FileNotFoundError:
                return None
            except IsADirectoryError:
                return b""   # not a blob: the checksum fails and the entry is reported corrupt
        return self._guard("read a blob", work)

    def mtime(self, name: str):
        try:
            return os.stat(self.path(name)).st_mtime
        except OSError:
            return None

    def remove(self, name: str) -> int:
        """Deletes one of Carnator's files (a blob or a temporary, by name only); returns the bytes freed."""
        if not (BLOB_NAME.fullmatch(name) or BLOB_TEMPORARY.fullmatch(name)):
            return 0
        path = os.path.join(self.location, name)
        try:
            if os.path.islink(path) or not os.path.isfile(path):
                return 0      # a folder or a link someone put under that name: left alone
            size = os.path.getsize(path)
            os.remove(path)
            return size
        except OSError:
            return 0

    def files(self):
        """(name, bytes, mtime, is_blob) of Carnator's own files in the folder, nothing else."""
        for item in self._guard("list its files", lambda: list(os.scandir(self.location))):
            blob = BLOB_NAME.fullmatch(item.name) is not None
            if not (blob or BLOB_TEMPORARY.fullmatch(item.name)):
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    continue
                stat = item.stat(follow_symlinks=False)
            except OSError:
                continue
            yield item.name, stat.st_size, stat.st_mtime, blob
