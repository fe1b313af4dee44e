"""Router fixtures: real redis-servers on free loopback ports, and model-free workers."""

from __future__ import annotations

import pytest
from baton.services.router import RouterConfig
from testlib.redis_server import RedisServer, find_redis_server
from testlib.router_setup import Workers, make_config

if find_redis_server() is None:
    pytest.skip("no redis-server binary on this machine", allow_module_level=True)


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_server(shared_redis) -> RedisServer:
    """The session's server, emptied for this test."""
    with shared_redis.client() as client:
        client.flushall()
    return shared_redis


@pytest.fixture
def own_redis(tmp_path):
    """A server of this test's own, for tests that kill and restart it (on the same port)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def config(redis_server) -> RouterConfig:
    return make_config(redis_server)


@pytest.fixture
def workers():
    started = Workers()
    yield started
    started.close_all()
