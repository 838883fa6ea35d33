"""The Redis backend against a real redis-server (started here on a free loopback port): passwords, restarts,
dropped connections. Both backends' shared behaviour is in test_store.py."""
import logging

import pytest
import torch

from carnator_engine.euler import TinyDiTRunner
from carnator_engine.pipeline import CarnatorConfig, generate
from carnator_engine.schedule import flow_sigmas
from carnator_engine.store import CarnatorStore, StoreError
from redis_server import RedisServer, require_redis_server
from test_store import _put, _signature

PASSWORD = "pa55:w/rd-Secret"   # a colon and a slash: the URL carries it percent-encoded
QUOTED = "pa55%3Aw%2Frd-Secret"


@pytest.fixture
def locked(tmp_path):
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis"), password=PASSWORD).start()
    yield server
    server.stop()


def test_a_password_from_the_url_or_the_environment_and_never_shown(locked, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    url = f"redis://:{QUOTED}@127.0.0.1:{locked.port}/0"
    store = CarnatorStore(url, 64 << 20)
    entry = _put(store, 0)
    monkeypatch.setenv("CARNATOR_REDIS_PASSWORD", PASSWORD)
    from_env = CarnatorStore(locked.url, 64 << 20)
    assert from_env.record(entry).entry_id == entry
    shown = [store.location, from_env.location, repr(store.stats()), repr(from_env.stats()), caplog.text]
    assert all(PASSWORD not in text and QUOTED not in text and "Secret" not in text for text in shown)
    assert store.location == f"redis://127.0.0.1:{locked.port}/0"


@pytest.mark.parametrize("given, expected", [("", "asks for a password and none was given"),
                                             ("wrong", "password was refused")])
def test_a_missing_or_wrong_password_is_a_clear_error(locked, monkeypatch, given, expected):
    monkeypatch.delenv("CARNATOR_REDIS_PASSWORD", raising=False)
    url = f"redis://:{given}@127.0.0.1:{locked.port}/0" if given else locked.url
    with pytest.raises(StoreError) as caught:
        CarnatorStore(url, 64 << 20)
    message = str(caught.value)
    assert expected in message and "CARNATOR_REDIS_PASSWORD" in message and locked.url in message


def test_an_unreachable_server_names_the_url_and_what_to_do(tmp_path):
    from redis_server import free_port
    store = CarnatorStore(f"redis://:hidden@127.0.0.1:{free_port()}/0", 64 << 20)   # opens: requests run in full
    with pytest.raises(StoreError, match=r"redis://127\.0\.0\.1:\d+/0.*cannot be reached.*start redis-server") \
            as caught:
        store.shortlist("b", _signature(1), 1)
    assert "hidden" not in str(caught.value) and "hidden" not in store.location


def test_acknowledged_entries_survive_a_restart_and_the_store_reconnects(redis_server):
    store = CarnatorStore(redis_server.url, 64 << 20)
    entries = [_put(store, seed) for seed in range(3)]
    redis_server.stop(kill=True)                           # kill -9: only the append-only file is left
    redis_server.start()
    assert store.shortlist("b", _signature(1), 1) == [entries[1]]
    reopened = CarnatorStore(redis_server.url, 64 << 20)
    assert sorted(r.entry_id for r in reopened.records()) == sorted(entries)
    for entry in entries:
        assert reopened.trajectory(reopened.record(entry)).checkpoints


def test_a_dropped_connection_mid_request_is_a_full_generation(redis_server, tiny_model):
    store = CarnatorStore(redis_server.url, 64 << 20)
    sigmas, config = flow_sigmas(8), CarnatorConfig(probe_steps=2)
    noise = torch.randn(1, 3, 8, 32, 32, generator=torch.Generator().manual_seed(1))
    first = generate(TinyDiTRunner(tiny_model, "a red circle"), noise, sigmas, store, config)
    assert first.entry_id
    redis_server.stop()
    result = generate(TinyDiTRunner(tiny_model, "a red circle"), noise, sigmas, store, config)
    assert result.entry_id is None and not result.decision.reuse and result.model_calls == 8
    assert any("cannot be reached" in w for w in result.warnings)
    torch.testing.assert_close(result.latent, first.latent, atol=1e-5, rtol=0)
    redis_server.start()
    again = generate(TinyDiTRunner(tiny_model, "a red circle"), noise, sigmas, store, config)
    assert again.decision.exact_repeat and again.model_calls == 0


def test_the_cli_takes_a_redis_url_and_never_prints_its_password(locked, capsys, monkeypatch):
    from carnator_engine.__main__ import main
    monkeypatch.delenv("CARNATOR_REDIS_PASSWORD", raising=False)
    assert main(["stats", "--cache", f"redis://:{QUOTED}@127.0.0.1:{locked.port}/0"]) == 0
    assert main(["stats", "--cache", locked.url]) == 2
    out = capsys.readouterr()
    assert '"entries": 0' in out.out and "asks for a password" in out.err
    assert "Secret" not in out.out + out.err


def test_the_size_limit_is_recorded_in_redis_and_kept_by_a_store_opened_without_one(redis_server):
    made = CarnatorStore(redis_server.url, 2 << 20)
    made.close()
    assert CarnatorStore(redis_server.url, None).stats()["size_limit_bytes"] == 2 << 20
