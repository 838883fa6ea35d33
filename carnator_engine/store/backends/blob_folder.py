"""The farm layout's shared folder of trajectory blobs (farm.py): one file per distinct blob, named by its content.

A blob is `<sha256 of its bytes>.blob`, written whole or not at all (owned_files.write_whole: a temporary file
`<name>.<8 hex>.tmp`, fsynced, renamed into place), so a reader on any worker sees either no file or the whole one;
the name is the checksum CarnatorStore verifies on every read, so a torn or damaged file is found and reported,
never served. Every file starts with a header naming the folder's identity: that, not its name, is what lets a
file be deleted (a file without it is deleted only when its bytes hash to its name: a blob written before the
header existed). Two workers writing the same blob write the same bytes under the same name.

The folder carries the store marker (marker.py), which names the one farm (its Redis store's identity) it belongs
to: a second farm given the same folder is refused. The folder is marked only when its farm is created; a folder
found missing or empty for a farm that exists is a dropped mount (StoreUnavailable), never marked, never written.
"""
from __future__ import annotations

import hashlib
import os
import re

from ..errors import StoreError, StoreUnavailable
from ..marker import MARKER_FILE, add_to_marker, check_location, claim, read_marker
from ..owned_files import owner, strip, write_whole
from .disk import _advice

BLOB_NAME = re.compile(r"[0-9a-f]{64}\.blob")
BLOB_TEMPORARY = re.compile(r"[0-9a-f]{64}\.blob\.[0-9a-f]{8}\.tmp")
HASH_CHUNK = 1 << 20


class BlobFolder:
    def __init__(self, path: str):
        """The folder's location only (checked); `claim` opens it."""
        if not isinstance(path, str) or not os.path.isabs(os.path.expanduser(path.strip())):
            raise StoreError(f"blob_dir {str(path)[:200]!r} is not an absolute folder path: give the folder every "
                             "worker mounts, such as /mnt/shared/carnator_blobs")
        self.location = check_location(path.strip())
        self.identity = None

    def marker(self):
        """The folder's marker fields, or None where it has none."""
        if not os.path.isfile(os.path.join(self.location, MARKER_FILE)):
            return None
        return read_marker(self.location)

    def claim(self, farm: str, redis_location: str, create: bool) -> str:
        """The folder's identity, the folder bound to `farm` (a marker from before the binding gets it). A new or
        empty folder is marked only when `create` (the farm is new), else StoreUnavailable (a dropped mount).
        StoreError for a folder that is not Carnator's, another farm's, or a folder store's."""
        if os.path.exists(os.path.join(self.location, "cache.db")):
            raise StoreError(f"blob_dir {self.location!r} is a folder cache (it holds cache.db), not a farm's blob "
                             "folder: give the farm a folder of its own")
        self.identity = claim(self.location, create=create, farm=farm, redis=redis_location)
        found = read_marker(self.location)
        if "farm" not in found:
            add_to_marker(self.location, farm=farm, redis=redis_location)
        elif found["farm"] != farm:
            raise StoreError(f"blob_dir {self.location!r} belongs to another farm (store {found['farm'][:8]}..., "
                             f"Redis {found.get('redis', '?')}): give each farm a folder of its own")
        return self.identity

    def check_present(self) -> None:
        """StoreUnavailable when the folder no longer carries its marker (unmounted, or another folder mounted in
        its place): its files are missing for want of the folder, not because they are damaged."""
        try:
            present = read_marker(self.location).get("identity") == self.identity
        except StoreError:
            present = False
        if not present:
            raise StoreUnavailable(f"Carnator blob folder {self.location!r} has lost its marker {MARKER_FILE} "
                                   "(is the shared folder mounted?): requests are generated in full until it is "
                                   "back")

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
        """Whole or not at all, header first; over an existing file of that name too (a damaged copy is replaced, a
        reader of the old one keeps its open file); a failure removes only the temporary file. Never into a folder
        without its marker (an empty mount point)."""
        self.check_present()
        self._guard("write a blob", lambda: write_whole(self.path(name), data, self.identity, shared_name=True))
        try:   # unmounted meanwhile: the file went into the mount point, where no other worker sees it
            written = os.stat(self.path(name)).st_dev == os.stat(os.path.join(self.location, MARKER_FILE)).st_dev
        except OSError:
            written = False
        if not written:
            raise StoreUnavailable(f"Carnator blob folder {self.location!r} was unmounted during a write (is the "
                                   "shared folder mounted?): the entry was not stored")

    def read(self, name: str):
        """The blob's bytes (its header taken off), or None when it is not there."""
        def work():
            try:
                with open(self.path(name), "rb") as handle:
                    return strip(handle.read())
            except FileNotFoundError:
                return None
            except IsADirectoryError:
                return b""   # not a blob: the checksum fails and the entry is reported corrupt
        return self._guard("read a blob", work)

    def size(self, name: str) -> int:
        try:
            return os.stat(self.path(name)).st_size
        except OSError:
            return 0

    def _ours(self, path: str, name: str) -> bool:
        """Whether the file's content proves this folder's farm wrote it: its header, or (a blob from before the
        header) bytes that hash to its name."""
        if owner(path) == self.identity:
            return True
        if not BLOB_NAME.fullmatch(name) or os.path.islink(path) or not os.path.isfile(path):
            return False
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
                    digest.update(chunk)
        except OSError:
            return False
        return digest.hexdigest() + ".blob" == name

    def remove(self, name: str) -> int:
        """Deletes one of this farm's files (a blob or a temporary) when its content proves it is ours; returns
        the bytes freed."""
        if not (BLOB_NAME.fullmatch(name) or BLOB_TEMPORARY.fullmatch(name)):
            return 0
        path = os.path.join(self.location, name)
        try:
            if not self._ours(path, name):
                return 0      # someone else's file under that name, a folder or a link: left alone
            size = os.path.getsize(path)
            os.remove(path)
            return size
        except OSError:
            return 0

    def temporaries(self, name: str, older_than: float) -> list:
        """The temporary files of writes of blob `name` last modified before `older_than`."""
        found = []
        for item in self._guard("list its files", lambda: list(os.scandir(self.location))):
            if item.name.startswith(name + ".") and BLOB_TEMPORARY.fullmatch(item.name):
                try:
                    if item.stat(follow_symlinks=False).st_mtime < older_than:
                        found.append(item.name)
                except OSError:
                    continue
        return found
