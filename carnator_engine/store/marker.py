"""The store marker: the file that proves a folder is a Carnator store, and the folders a store may never be.

A disk store is a folder Carnator made itself: `carnator-store.json` (format name, format version, the store's
identity) is written into it at creation, before any other file, and read at every open. Carnator deletes files
only inside a folder that carries it (and only under its own file names, backends/disk.py), so a cache path that
names someone else's folder can never cost them a file: a non-empty folder without the marker is refused, nothing
touched. A folder from before the marker existed is adopted (marked) only when it holds Carnator's own database
with the identity key every Carnator store wrote at creation; anything else is refused.

The filesystem root, system folders and the home folder itself are refused before anything is created: a store's
files must live in a folder of their own.
"""
from __future__ import annotations

import errno
import json
import os
import re
import sqlite3
import urllib.parse
import uuid

from ..typed_paths import control_character
from .errors import StoreError, StoreUnavailable
from .owned_files import read_regular

MARKER_FILE = "carnator-store.json"
FORMAT = "carnator-store"
FORMAT_VERSION = 1
DATABASE_FILE = "cache.db"
SQLITE_HEADER = b"SQLite format 3\x00"   # the first bytes of every SQLite database file
IDENTITY = re.compile(r"[0-9a-f]{32}")
MARKER_TEMPORARY = re.compile(re.escape(MARKER_FILE) + r"\.[0-9a-f]{8}\.tmp")
# Never a store: these folders themselves (a store needs a folder of its own) ...
REFUSED_FOLDERS = ("/", "/home", "/root", "/tmp", "/var", "/opt", "/srv", "/mnt", "/media", "/Users", "/Volumes")
# ... nor anything inside these (the operating system's own files).
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin",
                "/sys", "/usr", "/System", "/Library")


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip(os.sep) + os.sep)


def check_location(directory: str, name: str = "the Carnator cache folder") -> str:
    """The folder's absolute real path, or StoreError for a name holding a control character (`name` says which
    folder), the filesystem root, a system folder or the home folder."""
    refused = control_character(directory)
    if refused:
        raise StoreError(f"{name} {refused}")
    real = os.path.realpath(os.path.abspath(os.path.expanduser(directory)))
    home = os.path.realpath(os.path.expanduser("~"))
    refused = (os.path.dirname(real) == real or real == home or real in REFUSED_FOLDERS
               or any(_inside(real, tree) for tree in SYSTEM_TREES))
    if refused:
        raise StoreError(f"Carnator cache {directory!r} is the filesystem root, a system folder or the home folder "
                         "itself: give a folder of its own, such as ~/carnator_cache")
    return real


NO_DATABASE, NOT_SQLITE, NO_RECORD, EMPTY = "none", "not SQLite", "no record", "empty"


def database_identity(directory: str):
    """The identity key Carnator's database in `directory` holds (every Carnator store writes it at creation), else
    why there is none: NO_DATABASE, NOT_SQLITE, NO_RECORD (an SQLite database without that key: another program's)
    or EMPTY (a diskcache database holding nothing: a creation interrupted before its first key). Read without
    changing anything in the folder: a file that is no SQLite database is never opened by SQLite, and a database
    is opened immutable, since even a read-only connection to a WAL-mode database (diskcache's, another
    program's) creates its -wal and -shm files beside it; only where both are there already (a process killed
    before SQLite moved its WAL into the database) is the database read through them."""
    database = os.path.join(directory, DATABASE_FILE)
    try:
        if read_regular(database, len(SQLITE_HEADER)) != SQLITE_HEADER:
            return NOT_SQLITE
    except FileNotFoundError:
        return NO_DATABASE
    except (OSError, ValueError):    # ValueError: a path no file can have (a NUL byte)
        return NOT_SQLITE
    quoted = urllib.parse.quote(database)
    uris = [f"file:{quoted}?immutable=1"]
    if all(os.path.isfile(database + suffix) for suffix in ("-wal", "-shm")):
        uris.append(f"file:{quoted}?mode=ro")
    found = NO_RECORD
    for uri in uris:
        try:
            connection = sqlite3.connect(uri, uri=True)
            try:
                row = connection.execute("SELECT value FROM Cache WHERE key = 'store' AND raw = 1").fetchone()
                rows = connection.execute("SELECT count(*) FROM Cache").fetchone()[0]
                settings = connection.execute("SELECT count(*) FROM Settings").fetchone()[0]   # diskcache's
            finally:
                connection.close()
        except sqlite3.Error:
            continue
        identity = row[0] if row else None
        if isinstance(identity, str) and IDENTITY.fullmatch(identity):
            return identity
        found = EMPTY if rows == 0 and settings and found == NO_RECORD else found
    return found


def _legacy_identity(directory: str):
    """The identity of a store made before the marker existed (Carnator's diskcache database), else None."""
    identity = database_identity(directory)
    return identity if IDENTITY.fullmatch(identity) else None


def read_marker(directory: str) -> dict:
    """The marker's fields (format, version, identity; a blob folder's also `farm`, the identity of the farm
    whose folder it is, and `redis`, where that farm's Redis was when it was made); StoreError when damaged."""
    path = os.path.join(directory, MARKER_FILE)
    try:
        value = json.loads(read_regular(path, 4096))
        identity, version = value["identity"], value["version"]
        if value.get("format") != FORMAT or not isinstance(identity, str) or not IDENTITY.fullmatch(identity) \
                or not isinstance(version, int) or not isinstance(value.get("farm", identity), str):
            raise ValueError("not a Carnator store marker")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise StoreError(f"Carnator cache {directory!r}: its marker {MARKER_FILE} is unreadable or damaged "
                         f"({error}): restore it, or choose another cache path") from None
    if version > FORMAT_VERSION:
        raise StoreError(f"Carnator cache {directory!r} was made by a newer Carnator (store format {version}, this "
                         f"one reads {FORMAT_VERSION}): update Carnator or choose another cache path")
    return value


def _read_marker(directory: str) -> str:
    return read_marker(directory)["identity"]


def _write_marker(directory: str, identity: str, replace: bool = False, **fields) -> None:
    """Whole or not at all, and never over another process's marker (unless `replace`: the same store's marker
    with `fields` added): a temporary file, hard-linked into place (fails where the marker exists), so two
    processes creating one store at once agree on its identity."""
    final = os.path.join(directory, MARKER_FILE)
    temporary = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
    data = json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "identity": identity, **fields}).encode()
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            if replace:
                os.replace(temporary, final)
                return
            os.link(temporary, final)
        except FileExistsError:
            pass                           # another process marked it first: its identity is the store's
        except OSError as error:
            if error.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            if not os.path.exists(final):  # a filesystem without hard links
                os.replace(temporary, final)
    finally:
        try:
            os.remove(temporary)
        except OSError:
            pass


def marker_temporary(name: str) -> bool:
    return MARKER_TEMPORARY.fullmatch(name) is not None


def is_marked(directory: str) -> bool:
    """Whether `directory` holds a Carnator store (marked, or adoptable from before the marker), found read-only."""
    directory = os.path.abspath(os.path.expanduser(directory))
    return os.path.isfile(os.path.join(directory, MARKER_FILE)) or _legacy_identity(directory) is not None


def inspect(directory: str):
    """Read-only, what claim would find in `directory` (an absolute path checked by check_location): the identity of
    the Carnator store there (marked, or from before the marker), None for a missing or empty folder (claim makes a
    new store there), StoreError for a folder claim refuses. Creates, changes and deletes nothing."""
    if os.path.isfile(os.path.join(directory, MARKER_FILE)):
        return _read_marker(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise StoreError(f"Carnator cache {directory!r} is a file, not a folder: choose a folder path")
    identity = _legacy_identity(directory)
    if identity is not None:
        return identity
    try:
        present = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None                        # made by claim (or found not writable there)
    except OSError as error:
        raise StoreError(f"Carnator cache directory {directory!r} cannot be read ({error.strerror or error}): "
                         f"{_path_advice(error)}") from error
    if [name for name in present if not marker_temporary(name)]:  # only a marker in flight: still empty
        raise StoreError(f"Carnator cache {directory!r} is a folder that is not a Carnator store (not empty, "
                         f"no {MARKER_FILE}): choose an empty or new folder; nothing in it was touched")
    return None


def refuse_farm_folder(directory: str) -> None:
    """StoreError when `directory` (an absolute path checked by check_location) is a farm's blob folder, its marker
    naming the farm: a folder cache opened there would write its database beside the farm's blobs, and every worker
    of that farm would then refuse the folder. Read-only."""
    try:
        found = read_marker(directory) if os.path.isfile(os.path.join(directory, MARKER_FILE)) else {}
    except StoreError:
        return                             # a damaged marker: claim and inspect say so
    if found.get("farm"):
        raise StoreError(f"Carnator cache {directory!r} is the blob folder of a farm (store {found['farm'][:8]}..., "
                         f"Redis {found.get('redis', '?')}): to use that farm, set cache_dir to its redis:// URL and "
                         "blob_dir to this folder; for a folder cache, choose another folder (nothing was written)")


def _path_advice(error: OSError) -> str:
    """What to do about a cache folder the system refused, by the refusal's cause."""
    if error.errno == errno.ENAMETOOLONG:
        return "its name is longer than the filesystem allows: choose a shorter cache path"
    if error.errno in (errno.EACCES, errno.EPERM):
        return "fix its permissions or choose another cache path"
    return "choose another cache path"


def claim(directory: str, create: bool = True, **fields) -> str:
    """The identity of the Carnator store in `directory` (an absolute path checked by check_location): read from
    its marker; a legacy store adopted (marked with its own identity); a missing or empty folder made a new store
    (marked with `fields` too) when `create`, else StoreUnavailable: a store known to exist whose folder is
    missing or empty is a dropped mount, and marking the mount point would hide the store behind a new one.
    StoreError for a folder that is not a Carnator store, with nothing in it touched (inspect decides)."""
    identity = inspect(directory)
    if os.path.isfile(os.path.join(directory, MARKER_FILE)):
        return identity
    if identity is None and not create:
        raise StoreUnavailable(f"Carnator folder {directory!r} is missing or empty, but its store exists: is "
                               "the shared folder mounted? (nothing was written there)")
    try:
        os.makedirs(directory, exist_ok=True)
        _write_marker(directory, identity or uuid.uuid4().hex, **fields)
    except OSError as error:
        raise StoreError(f"Carnator cache directory {directory!r} is not writable ({error.strerror or error}): "
                         "choose another cache path") from error
    return _read_marker(directory)


def add_to_marker(directory: str, **fields) -> None:
    """Writes `fields` into the folder's marker, identity and what it held kept (a marker from before a field)."""
    value = read_marker(directory)
    value.update(fields)
    try:
        _write_marker(directory, value.pop("identity"), replace=True,
                      **{k: v for k, v in value.items() if k not in ("format", "version")})
    except OSError as error:
        raise StoreError(f"Carnator folder {directory!r}: its marker could not be written "
                         f"({error.strerror or error}): fix its permissions") from error
