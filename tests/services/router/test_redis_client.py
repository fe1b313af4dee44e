"""Connection settings from the config: password, database, TLS, timeouts, no retries."""

from __future__ import annotations

import pytest
import redis
from baton.services.router import RedisConfig, create_redis_client


def test_password_and_database_are_used(own_redis):
    own_redis.client().config_set("requirepass", "s3cret")
    with pytest.raises(redis.AuthenticationError):
        create_redis_client(RedisConfig(url=own_redis.url, password="wrong")).ping()
    client = create_redis_client(RedisConfig(url=own_redis.url, password="s3cret", db=3))
    client.set("k", "v")
    assert client.connection_pool.connection_kwargs["db"] == 3
    assert redis.Redis(port=own_redis.port, password="s3cret", db=3).get("k") == b"v"


def test_tls_settings_reach_the_connection():
    config = RedisConfig(url="redis://cache:6380", tls=True, tls_ca_file="/ca.pem", tls_verify=False)
    pool = create_redis_client(config).connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == "/ca.pem"
    assert pool.connection_kwargs["ssl_cert_reqs"] == "none"


def test_a_dead_server_fails_fast_without_retries():
    client = create_redis_client(RedisConfig(url="redis://127.0.0.1:1", connect_timeout_s=0.2))
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert client.connection_pool.connection_kwargs["socket_timeout"] == 0.25
    assert client.connection_pool.make_connection().retry._retries == 0  # redis-py would retry 3 times
