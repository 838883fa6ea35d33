"""The cache browser's HTTP routes: validation and serialisation as plain functions, then the aiohttp
handlers through aiohttp's test client (no ComfyUI needed; skipped where aiohttp is absent).
The same routes inside a real ComfyUI server: tests/test_host_routes.py."""
import asyncio
import json
import os

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, generate
from carnator_engine.schedule import flow_sigmas
from store_damage import set_raw
from test_store import _put

routes = pytest.importorskip("nodes.routes", reason="nodes.routes does not import here")
stores = pytest.importorskip("nodes.stores")


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A fresh store registry whose default store lives under tmp_path."""
    monkeypatch.setattr(stores, "_stores", {})
    monkeypatch.setattr(stores, "user_directory", lambda: str(tmp_path / "user"))
    default = str(tmp_path / "default_store")
    monkeypatch.setattr(routes, "default_cache_dir", lambda: default)
    yield default
    for store in stores.known_stores().values():
        store.close()


def make_entry(store, model, prompt, seed=0):
    runner = TinyDiTRunner(model, prompt)
    noise = torch.randn((1,) + (3, 8, 32, 32), generator=torch.Generator().manual_seed(seed))
    result = generate(runner, noise, flow_sigmas(6), store, CarnatorConfig(probe_steps=2), prompt=prompt, seed=seed)
    assert result.entry_id
    return result.entry_id


# ---- plain functions ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["", "0123", "0123456789ABCDEF", "0123456789abcdeg", "0123456789abcdef0",
                                 "../../etc/passwd", "0123456789abcdef\n", None, 5])
def test_entry_ids_are_16_lowercase_hex(bad):
    with pytest.raises(routes.RequestError) as caught:
        routes.check_entry_id(bad)
    assert caught.value.status == 400 and "16 lowercase hex" in caught.value.message


def test_a_valid_entry_id_passes():
    assert routes.check_entry_id("0123456789abcdef") == "0123456789abcdef"


def test_default_store_is_not_created_by_reading(registry):
    assert routes.resolve_store(None) is None
    assert routes.resolve_store("") is None
    assert not os.path.exists(registry)
    assert routes.list_entries(None)["entries"] == []
    assert routes.store_stats(None)["entries"] == 0


def test_cache_parameter_must_name_a_known_store(registry, tmp_path):
    other = stores.open_store(str(tmp_path / "other"), 64 << 20)
    assert routes.resolve_store(str(tmp_path / "other")) is other
    assert routes.resolve_store(str(tmp_path / "other") + "/") is other
    assert routes.resolve_store(str(tmp_path / "x" / ".." / "other")) is other  # same store, spelled otherwise
    for attempt in [str(tmp_path), str(tmp_path / "other" / ".."), "/etc", "../../etc", "other",
                    str(tmp_path / "other") + "\x00", "/" + "a" * 5000, str(tmp_path / "other\n"),
                    str(tmp_path / "ot\x7fher"), str(tmp_path / "other") + "\t"]:
        with pytest.raises(routes.RequestError) as caught:
            routes.resolve_store(attempt)
        assert caught.value.status == 400
    assert not os.path.exists(tmp_path / "default_store") and "other" in os.listdir(tmp_path)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("ot") and name != "other"]
    listed = [s["directory"] for s in routes.store_directories()]
    assert listed == [os.path.normpath(registry), os.path.normpath(str(tmp_path / "other"))]


def test_a_known_store_opens_after_a_restart_and_only_a_proven_one(registry, tmp_path, monkeypatch):
    other = stores.open_store(str(tmp_path / "other"), 32 << 20)
    _put(other, 0)
    other.close()
    monkeypatch.setattr(stores, "_stores", {})                      # a restart: nothing opened yet
    reopened = routes.resolve_store(str(tmp_path / "other"))
    assert reopened is not None and reopened.size_limit_bytes == 32 << 20
    assert len(routes.list_entries(reopened)["entries"]) == 1
    assert str(tmp_path / "other") in [s["directory"] for s in routes.store_directories()]
    reopened.close()
    monkeypatch.setattr(stores, "_stores", {})
    (tmp_path / "other" / "carnator-store.json").unlink()            # no longer provably a Carnator store
    (tmp_path / "other" / "cache.db").unlink()
    with pytest.raises(routes.RequestError, match="no longer a Carnator store"):
        routes.resolve_store(str(tmp_path / "other"))


def test_a_refused_cache_parameter_never_echoes_a_password(registry):
    for url in ("redis://:s3cr/et@127.0.0.1:1/0", "redis://user:s3cr%2Fet@127.0.0.1:1/0?x=1"):
        with pytest.raises(routes.RequestError) as caught:
            routes.resolve_store(url)
        assert caught.value.status == 400 and "s3cr" not in caught.value.message


def test_json_safe_turns_what_json_cannot_carry_into_null_or_text():
    value = {"a": float("nan"), "b": [1.5, float("inf")], "c": torch.tensor([1.0, 2.0]), 3: object}
    safe = routes.json_safe(value)
    assert safe["a"] is None and safe["b"] == [1.5, None] and safe["c"] == [1.0, 2.0]
    assert isinstance(safe["3"], str)
    json.dumps(safe, allow_nan=False)


def test_record_json_and_store_functions(registry, tiny_model):
    store = stores.open_store(registry, 64 << 20)
    first = make_entry(store, tiny_model, "a red circle moving left on black background", seed=1)
    second = make_entry(store, tiny_model, "a blue square moving up on white background", seed=2)
    listing = routes.list_entries(routes.resolve_store(None))
    assert [e["id"] for e in listing["entries"]] == [second, first]  # newest first
    entry = listing["entries"][1]
    assert entry["prompt"] == "a red circle moving left on black background"
    assert entry["steps"] == 6 and entry["probe_steps"] == 2 and entry["hits"] == 0
    assert entry["size_bytes"] > 0 and entry["bucket"] and entry["created"] > 0
    assert entry["decision"]["reuse"] is False and "expected_speedup" in entry["decision"]
    json.dumps(listing, allow_nan=False)

    png = routes.entry_thumbnail(store, first)
    assert png.startswith(routes.PNG_SIGNATURE)
    stats = routes.store_stats(store)
    assert stats["entries"] == 2 and stats["stores"][0]["default"] is True

    assert routes.delete_entry(store, first) == {"deleted": first}
    with pytest.raises(routes.RequestError) as caught:
        routes.delete_entry(store, first)
    assert caught.value.status == 404
    with pytest.raises(routes.RequestError) as caught:
        routes.entry_thumbnail(store, first)
    assert caught.value.status == 404

    with pytest.raises(routes.RequestError) as caught:
        routes.clear_store(store, {"confirm": "yes"})
    assert caught.value.status == 400
    assert routes.clear_store(store, {"confirm": True}) == {"deleted": 1}
    assert store.records(include_corrupt=True) == []


def test_corrupt_entries_are_listed_with_their_reason(registry, tiny_model):
    store = stores.open_store(registry, 64 << 20)
    entry = make_entry(store, tiny_model, "a green triangle moving right on gray background")
    set_raw(store, entry, "blob", b"garbage")
    record = store.record(entry)
    with pytest.raises(Exception):
        store.trajectory(record)
    listed = routes.list_entries(store)["entries"][0]
    assert listed["id"] == entry and "checksum" in listed["corrupt"]


def test_damaged_metadata_leaves_the_other_entries_listed_and_counted(registry, tiny_model):
    """Issue 16, fault 1: one metadata value that does not parse used to fail /carnator/entries and its stats."""
    store = stores.open_store(registry, 64 << 20)
    good = make_entry(store, tiny_model, "a red circle moving left on black background", seed=1)
    bad = make_entry(store, tiny_model, "a blue square moving up on white background", seed=2)
    set_raw(store, bad, "meta", b"\x80\x04not a record")
    assert [e["id"] for e in routes.list_entries(store)["entries"]] == [good]
    assert routes.store_stats(store)["entries"] == 1
    assert any(bad in problem and "does not parse" in problem for problem in store.drain_problems())


def test_add_routes_is_idempotent():
    web = pytest.importorskip("aiohttp.web")
    table = web.RouteTableDef()
    assert routes.add_routes(table) is True
    assert routes.add_routes(table) is False
    assert sorted((r.method, r.path) for r in table) == sorted((m, p) for m, p, _ in routes.ROUTES)


# ---- aiohttp handlers ---------------------------------------------------------------------------

def run_client(scenario, client_max_size=1024 ** 2):
    web = pytest.importorskip("aiohttp.web")
    test_utils = pytest.importorskip("aiohttp.test_utils")

    async def main():
        table = web.RouteTableDef()
        routes.add_routes(table)
        app = web.Application(client_max_size=client_max_size)
        app.add_routes(table)
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            await scenario(client)
    asyncio.run(main())


def test_handlers_over_http(registry, tiny_model, tmp_path):
    store = stores.open_store(registry, 64 << 20)
    kept = make_entry(store, tiny_model, "a red circle moving left on black background", seed=1)
    gone = make_entry(store, tiny_model, "a red circle moving right on black background", seed=2)
    other = stores.open_store(str(tmp_path / "other_store"), 64 << 20)
    elsewhere = make_entry(other, tiny_model, "a cyan square moving down on white background", seed=3)

    async def scenario(client):
        response = await client.get("/carnator/entries")
        assert response.status == 200
        body = await response.json()
        assert {e["id"] for e in body["entries"]} == {kept, gone}

        response = await client.get("/carnator/entries", params={"cache": other.location})
        assert [e["id"] for e in (await response.json())["entries"]] == [elsewhere]

        response = await client.get(f"/carnator/entries/{kept}/thumbnail")
        assert response.status == 200 and response.content_type == "image/png"
        assert (await response.read()).startswith(routes.PNG_SIGNATURE)

        response = await client.get("/carnator/stats")
        stats = await response.json()
        assert stats["entries"] == 2 and stats["bytes"] > 0
        assert {s["directory"] for s in stats["stores"]} == {store.location, other.location}

        for method, path in [("GET", "/carnator/entries/NOT-AN-ID/thumbnail"),
                             ("DELETE", "/carnator/entries/0123456789ABCDEF"),
                             ("DELETE", "/carnator/entries/..%2F..%2Fcache.db")]:
            response = await client.request(method, path)
            assert response.status in (400, 404), path
            if response.status == 400:
                assert "hex" in (await response.json())["error"]

        response = await client.delete("/carnator/entries/ffffffffffffffff")
        assert response.status == 404 and "no cache entry" in (await response.json())["error"]

        for attempt in ["/etc", "../..", str(tmp_path), os.path.join(other.location, "..")]:
            response = await client.get("/carnator/entries", params={"cache": attempt})
            assert response.status == 400, attempt
            assert "not a Carnator store" in (await response.json())["error"] or "absolute" in \
                (await response.json())["error"]

        response = await client.delete(f"/carnator/entries/{gone}")
        assert response.status == 200 and (await response.json()) == {"deleted": gone}
        response = await client.get(f"/carnator/entries/{gone}/thumbnail")
        assert response.status == 404

        response = await client.post("/carnator/clear")
        assert response.status == 400
        response = await client.post("/carnator/clear", data="not json", headers={"Content-Type": "application/json"})
        assert response.status == 400
        response = await client.post("/carnator/clear", json={"confirm": True})
        assert (await response.json()) == {"deleted": 1}
        response = await client.get("/carnator/entries")
        assert (await response.json())["entries"] == []
        response = await client.get("/carnator/entries", params={"cache": other.location})
        assert len((await response.json())["entries"]) == 1  # clearing one store leaves the others

    run_client(scenario)
    assert store.records(include_corrupt=True) == []


def test_the_browser_lists_and_clears_the_entries_still_being_written(registry, tiny_model, held_writes):
    store = stores.open_store(registry, 64 << 20)   # held_writes: a write waits until a reader (the route) waits
    runner = TinyDiTRunner(tiny_model, "a red circle moving left")
    noise = torch.randn((1, 3, 8, 32, 32), generator=torch.Generator().manual_seed(1))
    writing = generate(runner, noise, flow_sigmas(6), store, CarnatorConfig(probe_steps=2)).summary()["stored_as"]

    async def scenario(client):
        response = await client.get("/carnator/entries")
        assert [e["id"] for e in (await response.json())["entries"]] == [writing]
        generate(TinyDiTRunner(tiny_model, "a blue square moving up"), noise, flow_sigmas(6), store,
                 CarnatorConfig(probe_steps=2))
        response = await client.post("/carnator/clear", json={"confirm": True})
        assert (await response.json())["deleted"] == 2    # none of them comes back after the clear
    run_client(scenario)
    assert store.records(include_corrupt=True) == []


def test_unexpected_failures_are_json_500(registry):
    web = pytest.importorskip("aiohttp.web")
    test_utils = pytest.importorskip("aiohttp.test_utils")

    def broken(_store):
        raise OSError("disk on fire")

    async def work(request):
        return web.json_response(await routes._call(request, broken))

    async def main():
        app = web.Application()
        app.router.add_get("/boom", routes._handler(work))
        async with test_utils.TestClient(test_utils.TestServer(app)) as client:
            response = await client.get("/boom")
            body = await response.json()
            assert response.status == 500 and body["status"] == 500 and "disk on fire" in body["error"]
    asyncio.run(main())


def test_oversized_and_deeply_nested_bodies_are_413_and_400(registry):
    async def scenario(client):
        response = await client.post("/carnator/clear", data=b"{" + b" " * (2 << 20) + b"}",
                                     headers={"Content-Type": "application/json"})
        assert response.status == 413 and "over 1048576 bytes" in (await response.json())["error"]
        nested = b"[" * 100_000 + b"]" * 100_000
        response = await client.post("/carnator/clear", data=nested, headers={"Content-Type": "application/json"})
        assert response.status == 400 and "not (plain) JSON" in (await response.json())["error"]
    run_client(scenario)


def test_a_chunked_body_over_the_limit_is_413_after_reading_only_the_limit(registry):
    sent = []

    async def chunks():
        for _ in range(75):               # 75 MiB, no Content-Length: the server stops reading past 1 MiB
            sent.append(1)
            yield b" " * (1 << 20)

    async def scenario(client):
        response = await client.post("/carnator/clear", data=chunks(), headers={"Content-Type": "application/json"})
        assert response.status == 413 and "over 1048576 bytes" in (await response.json())["error"]
        assert len(sent) < 75
    run_client(scenario, client_max_size=100 * 1024 ** 2)   # ComfyUI's upload limit, far above the routes' own


def test_a_redis_store_is_listed_without_its_password(registry, tiny_model, tmp_path):
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis"), password="s3cret-Pass").start()
    try:
        url = f"redis://:s3cret-Pass@127.0.0.1:{server.port}/0"
        store = stores.open_store(url, 64 << 20)
        entry = make_entry(store, tiny_model, "a red circle moving left on black background", seed=1)
        assert stores.open_store(url, 64 << 20) is store
        shown = store.location
        assert shown == server.url and "s3cret" not in shown
        listing = routes.list_entries(routes.resolve_store(shown))
        stats = routes.store_stats(store)
        assert [e["id"] for e in listing["entries"]] == [entry]
        assert "s3cret" not in json.dumps([listing, stats, routes.store_directories()])
        with pytest.raises(routes.RequestError):
            routes.resolve_store(url)             # the password-bearing URL is never a name the browser may use
    finally:
        server.stop()


def test_hits_and_exact_repeats_mean_the_same_in_the_routes_and_the_cli(registry, tiny_model, tmp_path, capsys):
    """A miss, its exact repeat and a hit through the gate: /carnator/stats, each listed entry and the CLI's `stats`
    count one hit and one exact repeat, apart (the store once counted the repeat as a hit too)."""
    from carnator_engine import __main__ as cli
    store = stores.open_store(registry, 64 << 20)
    prompt = "a red circle moving left on black background"
    noise = torch.randn((1, 3, 8, 32, 32), generator=torch.Generator().manual_seed(0))
    config = CarnatorConfig(probe_steps=2, risk="aggressive")
    decisions = [generate(TinyDiTRunner(tiny_model, prompt), request, flow_sigmas(10), store, config).decision
                 for request in (noise, noise, noise * 1.0001)]      # a miss, its exact repeat, a request a hair off
    store.writer.settle()
    stats = routes.store_stats(store)
    entries = routes.list_entries(store)["entries"]
    assert (stats["hits"], stats["exact_repeats"]) == (sum(e["hits"] for e in entries),
                                                       sum(e["exact_repeats"] for e in entries))
    assert stats["exact_repeats"] == 1 and decisions[1].exact_repeat
    assert stats["hits"] == decisions[2].reuse == 1, decisions[2].reasons
    store.close()
    assert cli.main(["stats", "--cache", registry]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["hits"], printed["exact_repeats"]) == (stats["hits"], stats["exact_repeats"])


def test_a_deleted_store_is_no_longer_listed(registry, tmp_path):
    import shutil
    gone = stores.open_store(str(tmp_path / "gone"), 32 << 20)
    _put(gone, 0)
    gone.close()
    assert str(tmp_path / "gone") in [s["directory"] for s in routes.store_stats(None)["stores"]]
    shutil.rmtree(tmp_path / "gone")                          # deleted by its owner while ComfyUI runs
    assert [s["directory"] for s in routes.store_stats(None)["stores"]] == [registry]
