"""The farm layout's shared folder of trajectory blobs (farm.py): one file per write, never shared by two entries.

A blob is `<32 random hex>.blob`, a name chosen for that one write, created with O_EXCL (owned_files.create_new:
nothing at that name is ever overwritten or followed) and starting with a header that holds the write's nonce, a
secret the farm's Redis records for that name before the file is written. A file is deleted only when its header
holds the nonce recorded for it (`free`): not a file someone put in its place, nor one whose header was copied
from the marker or from another blob. Readers only ever open names their entries committed, after the file was
written whole and fsynced; the entry's checksum (CarnatorStore) finds a damaged file on every read.

Farms made before this layout named blobs `<sha256 of the bytes>.blob` (64 hex), shared by equal entries, with the
folder's identity in the header: those are still read, and deleted (`free_legacy`) only when their header names
the folder or their bytes hash to their name, and no entry refers to them.

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
from ..owned_files import create_new, holds, owner, read_part, remove_own
from .disk import _advice

BLOB_NAME = re.compile(r"[0-9a-f]{32}\.blob")
LEGACY_NAME = re.compile(r"[0-9a-f]{64}\.blob")
BLOB_TEMPORARY = re.compile(r"[0-9a-f]{64}\.blob\.[0-9a-f]{8}\.tmp")   # a legacy write's temporary file
HASH_CHUNK = 1 << 20


class BlobFolder:
    def __init__(self, path: str):
        """The folder's location only (checked); `claim` opens it."""
        if not isinstance(path, str) or not os.path.isabs(os.path.expanduser(path.strip())):
            raise StoreError(f"blob_dir {str(path)[:200]!r} is not an absolute folder path: give the folder every "
                             "worker mounts, such as /mnt/shared/carnator_blobs")
        self.location = check_location(path.strip(), "blob_dir")
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
        if not (BLOB_NAME.fullmatch(name) or LEGACY_NAME.fullmatch(name)):
            raise StoreError(f"Carnator blob folder {self.location!r}: {name[:80]!r} is not a blob name")
        return os.path.join(self.location, name)

    def create(self, name: str, nonce: str, data: bytes) -> bool:
        """The blob in a new file `name`, header (`nonce`) first, fsynced; False (nothing touched) where anything
        is at that name already. Never into a folder without its marker (an empty mount point). A failure
        removes the file it created."""
        self.check_present()
        path = self.path(name)
        try:
            self._guard("write a blob", lambda: create_new(path, data, nonce))
        except StoreError as error:
            if isinstance(error.__cause__, FileExistsError):
                return False
            raise
        try:   # unmounted meanwhile: the file went into the mount point, where no other worker sees it
            written = os.stat(path).st_dev == os.stat(os.path.join(self.location, MARKER_FILE)).st_dev
        except FileNotFoundError:
            if os.path.isfile(os.path.join(self.location, MARKER_FILE)):
                raise StoreError(f"Carnator blob folder {self.location!r}: the file of this write ({name}) was "
                                 "deleted before its commit (a collector took it for a killed write, or someone "
                                 "removed it): the entry was not stored") from None
            written = False
        except OSError:
            written = False
        if not written:
            remove_own(path, nonce)
            raise StoreUnavailable(f"Carnator blob folder {self.location!r} was unmounted during a write (is the "
                                   "shared folder mounted?): the entry was not stored")
        return True

    def holds(self, name: str, nonce: str) -> bool:
        """Whether blob `name` is there, a regular file whose header holds `nonce`."""
        return holds(self.path(name), nonce) is not None

    def free(self, name: str, nonce: str):
        """Deletes blob `name` when its header holds `nonce`: the bytes freed, 0 when it is not there, None when
        something else is at that name (left alone). StoreError when the unlink fails (a read-only folder), or
        when nothing proved the file gone or not ours but the folder's absence (unmounted: its marker gone)."""
        freed = self._guard("delete a blob", lambda: remove_own(self.path(name), nonce))
        if not freed:
            self.check_present()
        return freed

    def read(self, name: str, limit=None):
        """The blob's bytes (its header taken off, at most `limit` of them), or None when it is not there; b"" for
        anything at its name that is no regular file (a FIFO, a device, a link): its entry is reported corrupt."""
        return self._guard("read a blob", lambda: read_part(self.path(name), limit))

    def size(self, name: str) -> int:
        try:
            return os.stat(self.path(name)).st_size
        except OSError:
            return 0

    def _ours(self, path: str, name: str) -> bool:
        """Whether a legacy file's content proves this folder's farm wrote it: its header, or (a blob from before
        the header) bytes that hash to its name."""
        if owner(path) == self.identity:
            return True
        if not LEGACY_NAME.fullmatch(name) or os.path.islink(path) or not os.path.isfile(path):
            return False
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as handle:
                for chunk in iter(lambda: handle.read(HASH_CHUNK), b""):
                    digest.update(chunk)
        except OSError:
            return False
        return digest.hexdigest() + ".blob" == name

    def free_legacy(self, name: str) -> int:
        """Deletes one of this farm's legacy files (a blob or a temporary) when its content proves it is ours;
        returns the bytes freed."""
        if not (LEGACY_NAME.fullmatch(name) or BLOB_TEMPORARY.fullmatch(name)):
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
        """The temporary files of legacy writes of blob `name` last modified before `older_than`."""
        found = []
        for item in self._guard("list its files", lambda: list(os.scandir(self.location))):
            if item.name.startswith(name + ".") and BLOB_TEMPORARY.fullmatch(item.name):
                try:
                    if item.stat(follow_symlinks=False).st_mtime < older_than:
                        found.append(item.name)
                except OSError:
                    continue
        return found
