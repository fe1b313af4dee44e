"""The router and its workers on a real redis-server secured as in production: a TLS port only
(a throwaway CA) and an ACL user limited to the `baton:*` keys, the default user off. With the
right settings prefix placement works; a wrong password, a user whose ACL misses the prefix,
a CA that did not sign the server, and plaintext each fail at start with a clear message."""

from __future__ import annotations

import pytest
import redis
from baton.services.router import PlacementReason, PrefixRouter, RedisConfig, RouterConfig, WorkerConfig
from baton.services.router.redis_client import RedisAccessError, create_redis_client
from redis.backoff import NoBackoff
from redis.retry import Retry
from testlib.pki import make_pki
from testlib.redis_server import RedisServer, ServerTLS
from testlib.router_setup import BLOCK_SIZE, MODEL, make_index
from testlib.waiting import wait_until

NO_RETRIES = Retry(NoBackoff(), 0)  # redis-py's default retries a refused connection for seconds
PASSWORD = "router-secret-0123456789"
PREFIX = list(range(1000, 1032))  # 8 blocks of 4 tokens


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured_redis(tmp_path_factory, pki):
    tls = ServerTLS(pki.server_cert_file, pki.server_key_file, pki.ca_file)
    with RedisServer(tmp_path_factory.mktemp("redis"), acl_user="baton-router", password=PASSWORD, tls=tls) as server:
        yield server


def router_config(server: RedisServer, pki, **redis_fields) -> RouterConfig:
    fields = {
        "url": server.url,
        "username": "baton-router",
        "password": PASSWORD,
        "tls_ca_file": str(pki.ca_file),
        "retry_interval_s": 0.1,
    }
    return RouterConfig(
        model=MODEL,
        block_size=BLOCK_SIZE,
        redis=RedisConfig(**(fields | redis_fields)),
        worker=WorkerConfig(heartbeat_ttl_s=1.0, load_report_interval_s=0.05, reconnect_interval_s=0.05),
    )


def test_the_router_places_by_prefix_over_tls_with_an_acl_user(secured_redis, pki, workers):
    config = router_config(secured_redis, pki)
    agent, engine = workers.start(config, "a")
    workers.start(config, "b")
    engine.prefill(PREFIX)
    index = make_index(config)
    wait_until(lambda: index.cached_blocks(agent.info.worker_id) == engine.cached_block_hashes(), what="sync")
    router = PrefixRouter.from_config(config)
    placement = router.route_prefill("r1", PREFIX + [7, 8, 9])
    assert placement.reason is PlacementReason.PREFIX
    assert placement.worker_ids[0] == agent.info.worker_id and placement.best.num_cached_blocks == 8
    assert router.metrics()["redis_available"] == 1
    # Everything it wrote is under the prefix the ACL allows.
    with secured_redis.client() as client:
        keys = client.scan_iter("*")
        assert all(key.startswith(b"baton:") for key in keys)


def test_a_wrong_password_fails_at_start_naming_the_fix(secured_redis, pki):
    config = router_config(secured_redis, pki, password="wrong")
    with pytest.raises(RedisAccessError) as refused:
        PrefixRouter.from_config(config)
    message = str(refused.value)
    assert "refused the credentials" in message and "router.redis.username" in message
    assert "user baton-router" in message and "wrong" not in message.replace("wrong user", "")


def test_a_user_outside_its_acl_prefix_fails_at_start(secured_redis, pki):
    config = router_config(secured_redis, pki, key_prefix="other")
    with pytest.raises(RedisAccessError, match=r"does not let this user read 'other:access-check'.*~other:\*"):
        create_redis_client(config.redis)


def test_a_server_certificate_from_another_ca_fails_at_start(secured_redis, pki):
    config = router_config(secured_redis, pki, tls_ca_file=str(pki.other_ca_file))
    with pytest.raises(RedisAccessError, match="TLS failed.*router.redis.tls_ca_file"):
        create_redis_client(config.redis)


def test_a_missing_ca_file_fails_at_start(secured_redis, pki, tmp_path):
    config = router_config(secured_redis, pki, tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(RedisAccessError, match="TLS failed.*No such file.*router.redis.tls_ca_file"):
        create_redis_client(config.redis)


def test_plaintext_to_the_tls_port_gets_nothing(secured_redis):
    plain = redis.Redis(host="127.0.0.1", port=secured_redis.port, socket_timeout=1, retry=NO_RETRIES)
    with pytest.raises(redis.ConnectionError):
        plain.ping()


def test_without_a_user_the_default_user_is_off(secured_redis, pki):
    client = secured_redis.client(username=None, password=None, retry=NO_RETRIES)
    with pytest.raises(redis.AuthenticationError):
        client.get("baton:x")
