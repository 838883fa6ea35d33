import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from carnator_engine.backbones.tiny_dit import TinyDiTConfig, TinyVideoDiT  # noqa: E402

WORDS = "a red green blue circle square moving left right up down on black white background".split()


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return TinyVideoDiT(TinyDiTConfig(vocabulary=WORDS, dim=64, heads=2, layers=2, text_layers=1)).eval()


@pytest.fixture
def store(tmp_path):
    from carnator_engine.store import CarnatorStore
    opened = CarnatorStore(str(tmp_path / "cache"), size_limit_bytes=64 << 20)
    yield opened
    opened.close()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server for one test (AOF on, so a restart keeps what was acknowledged)."""
    from redis_server import RedisServer, require_redis_server
    require_redis_server()
    server = RedisServer(str(tmp_path / "redis"), appendonly=True).start()
    yield server
    server.stop()
