"""The store marker: Carnator opens only folders it can prove are its stores, and deletes only its own files."""
import json
import os

import pytest

from carnator_engine.store import CarnatorStore, StoreError
from carnator_engine.store.marker import MARKER_FILE, check_location
from carnator_engine.store.owned_files import header
from test_store import _put


def _old_file(path, data=b"user data"):
    """A file written long ago (older than any grace period given to writes in flight)."""
    path.write_bytes(data)
    os.utime(path, (0, 0))
    return path


def test_user_files_in_blobs_of_a_store_survive_every_open_and_delete(tmp_path):
    directory = tmp_path / "c"
    store = CarnatorStore(str(directory), 64 << 20)
    kept = _put(store, 0)
    store._backend._cache.set("k:0000000000000001", "5" * 32)   # a write's nonce, recorded before it crashed
    secret = store._backend._secret
    store.close()
    blobs = directory / "blobs"
    users = [blobs / "holiday.jpg", blobs / "0123456789abcdef.blob.bak", blobs / "notes.blob",
             blobs / "0123456789ABCDEF.blob", directory / "index.snapshot.bak"]
    for path in users:
        _old_file(path)
    (blobs / "0123456789abcdef.blob").mkdir()                 # a folder at an entry's name is not a file to delete
    (blobs / "0123456789abcdef.blob" / "inside.txt").write_bytes(b"user data")
    # Named exactly like Carnator's files and older than any grace period, but without the header that holds what
    # the store recorded for them (a header copied from the marker is no proof either): a name is no proof, so
    # they stay.
    users += [_old_file(blobs / "fedcba9876543210.blob"), _old_file(blobs / "fedcba9876543211.blob.0123abcd.tmp"),
              _old_file(directory / "index.snapshot.0123abcd.tmp"), _old_file(directory / "space.reserve.4567cdef.tmp")]
    copied = [_old_file(blobs / "0000000000000002.blob", header(store._backend.identity) + b"user data"),
              _old_file(blobs / "0000000000000003.blob.89abcdef.tmp", header(store._backend.identity) + b"user data")]
    orphan = _old_file(blobs / "0000000000000001.blob", header("5" * 32) + b"left by a crash")
    temporary = _old_file(directory / "index.snapshot.89abcdef.tmp", header(secret) + b"a snapshot's write")
    reopened = CarnatorStore(str(directory), 64 << 20)
    assert reopened.orphans_reclaimed == 2 and not orphan.exists() and not temporary.exists()   # Carnator's own go
    assert all(path.read_bytes() == b"user data" for path in users)
    assert all(path.read_bytes().endswith(b"user data") for path in copied)
    users += copied
    assert (blobs / "0123456789abcdef.blob" / "inside.txt").exists()
    reopened.delete(kept)
    reopened.clear()
    assert all(path.exists() for path in users)


def test_a_folder_that_is_not_a_carnator_store_is_refused_and_untouched(tmp_path):
    foreign = tmp_path / "photos"
    (foreign / "blobs").mkdir(parents=True)
    photo = _old_file(foreign / "blobs" / "0123456789abcdef.blob", b"mine")
    before = sorted(p.name for p in foreign.rglob("*"))
    with pytest.raises(StoreError, match=r"photos.*not a Carnator store.*choose an empty or new folder") as error:
        CarnatorStore(str(foreign))
    assert "\n" not in str(error.value)
    assert photo.read_bytes() == b"mine" and sorted(p.name for p in foreign.rglob("*")) == before


def test_a_new_or_empty_folder_becomes_a_marked_store(tmp_path):
    (tmp_path / "empty").mkdir()
    for directory in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        store = CarnatorStore(str(directory))
        marker = json.loads((directory / MARKER_FILE).read_text())
        assert marker["format"] == "carnator-store" and marker["identity"] == store._backend.identity
        store.close()
        assert CarnatorStore(str(directory))._backend.identity == marker["identity"]


def test_a_store_from_before_the_marker_is_adopted_anything_else_with_a_database_refused(tmp_path):
    import diskcache
    legacy = tmp_path / "legacy"
    store = CarnatorStore(str(legacy), 64 << 20)
    entry, identity = _put(store, 0), store._backend.identity
    store.close()
    (legacy / MARKER_FILE).unlink()                           # what an earlier Carnator left
    adopted = CarnatorStore(str(legacy), 64 << 20)
    assert [r.entry_id for r in adopted.records()] == [entry]
    assert json.loads((legacy / MARKER_FILE).read_text())["identity"] == identity
    other = tmp_path / "other_app"
    diskcache.Cache(str(other)).set("key", "value")           # another program's diskcache: no Carnator identity
    with pytest.raises(StoreError, match="not a Carnator store"):
        CarnatorStore(str(other))
    assert not (other / MARKER_FILE).exists() and not (other / "blobs").exists()


def test_a_damaged_or_foreign_marker_is_refused(tmp_path):
    directory = tmp_path / "c"
    CarnatorStore(str(directory)).close()
    marker = directory / MARKER_FILE
    identity = json.loads(marker.read_text())["identity"]
    marker.write_text(json.dumps({"format": "carnator-store", "version": 99, "identity": identity}))
    with pytest.raises(StoreError, match="newer Carnator"):
        CarnatorStore(str(directory))
    marker.write_text("{not json")
    with pytest.raises(StoreError, match="marker .* is unreadable or damaged"):
        CarnatorStore(str(directory))
    marker.write_text(json.dumps({"format": "carnator-store", "version": 1, "identity": "0" * 32}))
    with pytest.raises(StoreError, match="cache.db belongs to another store than its marker"):
        CarnatorStore(str(directory))


@pytest.mark.parametrize("location", ["/", "/etc", "/etc/carnator_cache", "/usr/share/carnator", "~", "/tmp",
                                      "/home", "/proc/self"])
def test_the_root_and_system_folders_are_refused_before_anything_is_written(location, monkeypatch):
    import diskcache

    def no_writes(*args, **kwargs):   # so that a regression fails here instead of writing into a system folder
        raise AssertionError(f"{location}: a store was being created in a system folder")
    monkeypatch.setattr(os, "makedirs", no_writes)
    monkeypatch.setattr(diskcache, "Cache", no_writes)
    with pytest.raises(StoreError, match="filesystem root, a system folder or the home folder"):
        CarnatorStore(location)


@pytest.mark.parametrize("char", ["\n", "\t", "\x00", "\x1b", "\x7f", "\x9b"])
def test_a_control_character_in_a_store_location_is_refused_before_any_folder_is_made(tmp_path, char):
    """Through the engine: a folder, a trailing one (strip() would take it away unseen), a Redis URL and a farm's
    blob folder."""
    said = rf"holds the control character '.+' \(U\+{ord(char):04X}\) at character \d+, which no path or URL holds"
    for location in (str(tmp_path / f"ca{char}che" / "inner"), str(tmp_path / "cache") + char):
        with pytest.raises(StoreError, match="^the cache location " + said):
            CarnatorStore(location)
    with pytest.raises(StoreError, match="^the cache location " + said):
        CarnatorStore(f"redis://localhost:6379/0{char}")
    with pytest.raises(StoreError, match="^blob_dir " + said):
        CarnatorStore("redis://localhost:6379/0", blob_dir=str(tmp_path / f"blobs{char}"))
    with pytest.raises(StoreError, match="^the Carnator cache folder " + said):
        check_location(str(tmp_path / f"ca{char}che"))
    assert os.listdir(tmp_path) == []


def test_a_relative_cache_dir_stays_inside_the_user_directory(tmp_path, monkeypatch):
    from nodes import stores
    user = tmp_path / "user"
    monkeypatch.setattr(stores, "user_directory", lambda: str(user))
    assert stores._key("caches/one") == str(user / "caches" / "one")
    for escaping in ("../outside", "caches/../../outside", ".."):
        with pytest.raises(StoreError, match="leaves ComfyUI's user directory"):
            stores._key(escaping)
    for itself in (".", "./", "caches/.."):
        with pytest.raises(StoreError, match="names ComfyUI's user directory itself .*a store needs a folder of its "
                                             "own, such as 'carnator_cache'"):
            stores._key(itself)
    for char in ("\x00", "\n", "\r", "\t", "\x1f", "\x7f", "\x9f"):
        for typed in (f"my{char}cache", f"caches/one{char}", f"redis://host:6379/0{char}"):
            with pytest.raises(StoreError, match=rf"^cache_dir holds the control character '.+' \(U\+{ord(char):04X}\) "
                                                 r"at character \d+, which no path or URL holds: retype it$"):
                stores._key(typed)
    assert not (tmp_path / "outside").exists()


def folder_state(folder) -> dict:
    """Every file's and folder's bytes (None for a folder) and mtime under `folder`, the folder itself included."""
    state = {".": (None, os.stat(folder).st_mtime_ns)}
    for path in sorted(folder.rglob("*")):
        state[str(path.relative_to(folder))] = (path.read_bytes() if path.is_file() else None,
                                                path.stat().st_mtime_ns)
    return state


def foreign_wal_database(folder):
    """A folder of another program: its WAL-mode SQLite cache.db (as a diskcache makes) and a note, all written
    long ago. Nothing but that program may create its -wal and -shm files."""
    import sqlite3
    folder.mkdir()
    connection = sqlite3.connect(str(folder / "cache.db"))
    assert connection.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    connection.execute("CREATE TABLE Cache (key TEXT, raw INTEGER, value BLOB)")
    connection.execute("INSERT INTO Cache VALUES ('settings', 1, 'theirs')")
    connection.commit()
    connection.close()                      # the last connection: SQLite checkpoints and removes -wal and -shm
    _old_file(folder / "notes.txt")
    for path in (folder / "cache.db", folder):
        os.utime(path, (0, 0))
    assert sorted(p.name for p in folder.iterdir()) == ["cache.db", "notes.txt"]
    return folder


@pytest.mark.parametrize("command", [["stats"], ["stats", "--verify"], ["clear", "--yes"]])
def test_the_cli_refuses_another_programs_wal_database_and_touches_nothing(tmp_path, capsys, command):
    from carnator_engine import __main__ as cli
    folder = foreign_wal_database(tmp_path / "their_app")
    before = folder_state(folder)
    assert cli.main(command + ["--cache", str(folder)]) == 1
    assert "(nothing created)" in capsys.readouterr().err
    assert folder_state(folder) == before


def test_opening_another_programs_wal_database_as_a_store_is_refused_and_touches_nothing(tmp_path, monkeypatch):
    from nodes import stores
    folder = foreign_wal_database(tmp_path / "their_app")
    before = folder_state(folder)
    for open_it in (lambda: CarnatorStore(str(folder)), lambda: stores.open_store(str(folder))):
        with pytest.raises(StoreError, match="not a Carnator store.*nothing in it was touched"):
            open_it()
        assert folder_state(folder) == before


def test_deleting_an_id_that_is_no_entry_touches_no_file(tmp_path):
    """A header copied from the marker (which anyone can read) proves nothing: only an entry the store holds, or
    the nonce it recorded for a file, lets it delete a file."""
    directory = tmp_path / "c"
    store = CarnatorStore(str(directory), 64 << 20)
    kept = _put(store, 0)
    planted = directory / "blobs" / "00000000000000aa.blob"
    planted.write_bytes(header(store._backend.identity) + b"user data")
    assert not store.delete("00000000000000aa")
    assert planted.read_bytes().endswith(b"user data") and store.record(kept)
    store.close()


@pytest.mark.parametrize("beside", ["a foreign cache.db", "an empty SQLite cache.db", "user files"])
def test_a_copied_marker_beside_files_the_store_did_not_make_is_refused_and_untouched(tmp_path, beside):
    import sqlite3
    CarnatorStore(str(tmp_path / "original")).close()
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / MARKER_FILE).write_bytes((tmp_path / "original" / MARKER_FILE).read_bytes())
    if beside == "user files":
        (folder / "notes.txt").write_text("mine")
        expected = r"mine.*holds a Carnator marker but not the store's records.*notes.txt"
    else:
        connection = sqlite3.connect(folder / "cache.db")
        connection.execute("CREATE TABLE Cache (key TEXT, raw INTEGER, value BLOB)")
        if beside == "a foreign cache.db":
            connection.execute("INSERT INTO Cache VALUES ('orders', 1, 'mine')")
        connection.commit()
        connection.close()
        expected = r"mine.*cache.db is not this store's .*another program's"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    if beside == "an empty SQLite cache.db":
        expected = r"mine.*cache.db is not this store's"   # not diskcache's: no empty database of Carnator's
    with pytest.raises(StoreError, match=expected):
        CarnatorStore(str(folder))
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
