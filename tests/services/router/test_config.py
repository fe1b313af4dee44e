"""Router config: defaults load, and every bad value is refused with a message naming it."""

from __future__ import annotations

import pytest
from baton.services.router import PolicyConfig, RedisConfig, RouterConfig, WorkerConfig
from pydantic import ValidationError


def test_defaults_are_valid_and_frozen():
    config = RouterConfig(model="llama")
    assert config.block_size == 16 and config.redis.url == "redis://127.0.0.1:6379"
    assert config.policy.temperature == 0 and config.worker.load_report_interval_s <= 0.5
    with pytest.raises(ValidationError):
        config.block_size = 32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"url": "http://localhost:6379"}, "url must start with"),
        ({"key_prefix": "a b"}, "key_prefix"),
        ({"key_prefix": "x{y}"}, "key_prefix"),
        ({"tls_ca_file": "/ca.pem"}, "TLS is off"),
        ({"tls": True, "tls_cert_file": "/c.pem"}, "given together"),
        ({"url": "unix:///tmp/redis.sock", "tls": True}, "unix"),
        ({"socket_timeout_s": 0}, "socket_timeout_s"),
        ({"db": -1}, "db"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_redis_settings_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        RedisConfig(**kwargs)


def test_tls_follows_the_url_scheme_and_the_password_stays_secret():
    config = RedisConfig(url="rediss://cache:6380", password="hunter2")
    assert config.use_tls
    assert "hunter2" not in repr(config) and config.password.get_secret_value() == "hunter2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "my model"}, "model"),
        ({"model": "m", "block_size": 12}, "power of two"),
        ({"model": "m", "policy": {"balance_rel_threshold": 0.5}}, "balance_rel_threshold"),
        ({"model": "m", "policy": {"temperature": -1}}, "temperature"),
        ({"model": "m", "worker": {"load_report_interval_s": 1.0}}, "load_report_interval_s"),
        ({"model": "m", "worker": {"heartbeat_ttl_s": 0.3, "load_report_interval_s": 0.25}}, "at least twice"),
        ({"model": "m", "index": {"pending_ttl_s": 0}}, "pending_ttl_s"),
    ],
)
def test_bad_router_settings_are_named(kwargs, message):
    with pytest.raises(ValidationError, match=message):
        RouterConfig(**kwargs)


def test_sections_build_from_plain_dicts_as_yaml_gives_them():
    config = RouterConfig(
        model="qwen3",
        block_size=32,
        redis={"url": "redis://10.0.0.5:6379", "db": 2, "key_prefix": "prod"},
        policy={"balance_abs_threshold": 8},
        worker={"heartbeat_ttl_s": 2.0},
    )
    assert config.redis.db == 2 and config.policy == PolicyConfig(balance_abs_threshold=8)
    assert config.worker == WorkerConfig(heartbeat_ttl_s=2.0)
