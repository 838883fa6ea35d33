"""A Carnator Cache's redis:// URL names a server on this machine unless the user allowed another one
(CARNATOR_ALLOW_REMOTE_REDIS=1): a shared workflow cannot send generations to a host the user never set up."""
from __future__ import annotations

import pytest

from carnator_engine.store import StoreError
from carnator_engine.store.backends import ALLOW_REMOTE_VARIABLE, open_backend, refuse_remote_redis
from nodes.stores import check_cache_dir


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis://localhost/1", "rediss://:pw@[::1]:6380/0",
                                 "redis://127.0.0.2:6379", "redis://", "REDIS://LOCALHOST:6379/0"])
def test_loopback_servers_are_allowed(url, monkeypatch):
    monkeypatch.delenv(ALLOW_REMOTE_VARIABLE, raising=False)
    refuse_remote_redis(url)
    check_cache_dir(url)


@pytest.mark.parametrize("url, host", [("redis://:s3cret@10.0.0.5:6379/0", "10.0.0.5"),
                                       ("rediss://redis-host:6379/0", "redis-host"),
                                       ("redis://user:s3cret@[2001:db8::1]:6379/0", "2001:db8::1")])
def test_another_machine_is_refused_in_one_line_unless_allowed(url, host, monkeypatch):
    monkeypatch.delenv(ALLOW_REMOTE_VARIABLE, raising=False)
    for check in (lambda: open_backend(url), lambda: check_cache_dir(url)):
        with pytest.raises(StoreError) as refused:
            check()
        message = str(refused.value)
        assert f"Redis server on another machine ({host})" in message and ALLOW_REMOTE_VARIABLE + "=1" in message
        assert "s3cret" not in message and "\n" not in message
    monkeypatch.setenv(ALLOW_REMOTE_VARIABLE, "1")
    refuse_remote_redis(url)
    check_cache_dir(url)
