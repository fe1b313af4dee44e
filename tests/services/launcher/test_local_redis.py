"""The local redis-server `baton serve` supervises: a real server, killed from outside by PID,
is reaped at once and started again on the same port (a bounded number of times); a stop, a
failed start, or the death of the process that started it leaves no redis-server behind."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import redis
from baton.services.launcher.local_redis import LocalRedis, describe_exit
from testlib.redis_server import find_redis_server, process_state, redis_server_pids
from testlib.waiting import wait_until

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(find_redis_server() is None, reason="no redis-server binary on this machine"),
]


def ping(server: LocalRedis) -> bool:
    with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1) as client:
        return client.ping()


@pytest.fixture
def local_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis", max_restarts=3, restart_window_s=60)
    yield server
    server.stop()


def test_a_killed_server_is_reaped_at_once_and_restarted_on_the_same_port(local_redis, caplog):
    first = local_redis.pid
    with redis.Redis(host="127.0.0.1", port=local_redis.port) as client:
        client.set("k", "v")
    with caplog.at_level(logging.WARNING, logger="baton.services.launcher.local_redis"):
        killed_at = time.monotonic()
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: process_state(first) is None, timeout_s=2, interval_s=0.005, what="the kill to be reaped")
        reaped_s = time.monotonic() - killed_at
        wait_until(lambda: local_redis.num_restarts, timeout_s=10, what="a new server, answering")
        assert ping(local_redis)
        back_s = time.monotonic() - killed_at
    assert reaped_s < 1 and back_s < 5, (reaped_s, back_s)  # milliseconds here; bounds for a loaded machine
    print(f"reaped {reaped_s * 1000:.0f} ms after the kill, answering again after {back_s * 1000:.0f} ms")
    assert local_redis.num_restarts == 1 and local_redis.exit_statuses == [-signal.SIGKILL]
    assert redis_server_pids(local_redis.port) == [local_redis.pid]
    with redis.Redis(host="127.0.0.1", port=local_redis.port) as client:
        assert client.get("k") is None  # no persistence: it comes back empty
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"(pid {first}, port {local_redis.port}) was killed by SIGKILL" in m for m in messages), messages
    assert any(f"back on port {local_redis.port}" in m for m in messages), messages


def test_restarts_are_bounded_per_interval(local_redis, caplog):
    with caplog.at_level(logging.ERROR, logger="baton.services.launcher.local_redis"):
        for num_killed in range(1, 5):
            wait_until(lambda n=num_killed: local_redis.num_restarts == n - 1, timeout_s=10, what="a server, answering")
            pid = local_redis.pid
            os.kill(pid, signal.SIGTERM if num_killed % 2 else signal.SIGKILL)
            wait_until(lambda p=pid: process_state(p) is None, timeout_s=5, what="the kill to be reaped")
        wait_until(lambda: any("not starting it again" in r.getMessage() for r in caplog.records), timeout_s=5)
    assert local_redis.num_restarts == 3 and local_redis.pid is None
    assert not redis_server_pids(local_redis.port)


def test_a_restart_that_fails_is_retried_until_the_server_comes_up(tmp_path, caplog):
    server = LocalRedis(tmp_path / "redis", max_restarts=50)
    try:
        (tmp_path / "redis").rename(tmp_path / "away")  # the running server does not mind; a new one cannot start
        with caplog.at_level(logging.ERROR, logger="baton.services.launcher.local_redis"):
            os.kill(server.pid, signal.SIGKILL)
            wait_until(lambda: sum("did not come back" in r.getMessage() for r in caplog.records) >= 2, timeout_s=5)
        (tmp_path / "away").rename(tmp_path / "redis")
        wait_until(lambda: server.num_restarts == 1, timeout_s=5, what="the retried restart")
        assert ping(server) and redis_server_pids(server.port) == [server.pid]
    finally:
        server.stop()
    assert not redis_server_pids(server.port)


def test_stop_leaves_nothing_and_nothing_restarts_after_it(tmp_path):
    server = LocalRedis(tmp_path / "redis")
    pid, port = server.pid, server.port
    server.stop()
    assert process_state(pid) is None  # stopped and reaped
    server.stop()  # idempotent
    time.sleep(0.3)
    assert not redis_server_pids(port) and server.num_restarts == 0


def test_a_start_on_a_taken_port_raises_and_leaves_nothing(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match="exited at start-up"):
            LocalRedis(tmp_path / "redis", port=port)
        assert not redis_server_pids(port)
    assert "Address already in use" in (tmp_path / "redis" / "redis.log").read_text()


def test_the_server_dies_with_the_process_that_started_it(tmp_path):
    """A `kill -9` of `baton serve` skips every stop: the parent-death signal still ends Redis."""
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from baton.services.launcher.local_redis import LocalRedis
        server = LocalRedis(Path({str(tmp_path / "redis")!r}))
        print(server.pid, flush=True)
        time.sleep(60)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        assert process_state(pid) not in (None, "Z")
        owner.kill()
        owner.wait(timeout=10)
        wait_until(lambda: process_state(pid) in (None, "Z"), timeout_s=10, what="redis-server to die with its owner")
    finally:
        if owner.poll() is None:
            owner.kill()


def test_exit_statuses_read_as_words():
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(1) == "exited with status 1"
