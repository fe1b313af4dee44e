"""The local Redis of `baton serve`, secured: an ACL user with a generated password (the default
user off, only its key prefix, the password on no command line and in no file) and a TLS
port; the router's client reaches it with `redis_config()` + `environment()`, also after the
supervisor restarts it."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from baton.services.launcher.local_redis import PASSWORD_ENV, LocalRedis, RedisTLS
from baton.services.router.redis_client import create_redis_client
from testlib.pki import make_pki
from testlib.redis_server import find_redis_server
from testlib.waiting import wait_until

pytestmark = pytest.mark.redis
if find_redis_server() is None:
    pytest.skip("no redis-server binary on this machine", allow_module_level=True)


@pytest.fixture
def secured(tmp_path):
    pki = make_pki(tmp_path / "pki")
    tls = RedisTLS(str(pki.server_cert_file), str(pki.server_key_file), str(pki.ca_file))
    server = LocalRedis(tmp_path / "redis", username="baton", tls=tls)
    yield server
    server.stop()


def test_the_router_client_reaches_it_with_its_config_and_environment(secured, monkeypatch):
    assert secured.url.startswith("rediss://127.0.0.1:")
    config = secured.redis_config()
    assert config.username == "baton" and config.password is None and config.password_env == PASSWORD_ENV
    monkeypatch.setenv(PASSWORD_ENV, secured.environment()[PASSWORD_ENV])
    client = create_redis_client(config)
    client.set("baton:k", "v")
    assert client.get("baton:k") == b"v"
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.set("elsewhere", "v")


def test_without_the_password_or_tls_it_refuses(secured):
    with pytest.raises(redis.AuthenticationError), secured.client(username=None, password=None) as anonymous:
        anonymous.get("baton:k")
    with pytest.raises(redis.AuthenticationError), secured.client(password="wrong") as wrong:
        wrong.get("baton:k")
    plain = redis.Redis(host="127.0.0.1", port=secured.port, socket_timeout=1, retry=None)
    with pytest.raises(redis.ConnectionError):
        plain.ping()


def test_the_password_is_on_no_command_line_and_in_no_file(secured):
    password = secured.password
    assert len(password) >= 32
    command = " ".join(secured._command())  # what it was started with (redis-server retitles itself)
    assert password not in command and "--aclfile" in command
    acl_file = secured.workdir / "users.acl"
    assert oct(acl_file.stat().st_mode & 0o777) == "0o600"
    for path in secured.workdir.iterdir():
        assert password not in path.read_text(errors="replace"), path


def test_a_restarted_server_keeps_the_user(secured):
    first = secured.pid
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: secured.pid not in (None, first) and secured.num_restarts == 1, what="restart")
    with secured.client() as client:
        assert client.ping()
