"""The local Redis of a real `baton serve`, faults injected from outside by PID: a start that
fails after Redis is up (its HTTP port taken meanwhile) stops it; a Redis killed under the
running server is restarted, logged, and serving goes on; SIGTERM leaves no redis-server."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from openai import OpenAI
from testlib.baton_process import BatonServe, session_pids
from testlib.models import tiny_model
from testlib.redis_server import process_state, redis_server_pids
from testlib.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

TEARDOWN_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_pid_of(serve: BatonServe) -> int | None:
    """The redis-server that `baton serve` started (a process of its session)."""
    pids = [pid for pid, cmdline in session_pids(serve.session_id).items() if "redis-server" in cmdline]
    return pids[0] if len(pids) == 1 else None


def stored_blocks(port: int) -> dict[str, int]:
    """Worker id -> how many blocks the index credits it with (keys.py's ns:stored), read from Redis."""
    with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1) as client:
        return {
            worker.decode(): int(num) for key in client.keys("*:stored") for worker, num in client.hgetall(key).items()
        }


def is_gone(pid: int) -> bool:
    return process_state(pid) is None


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # short: Ray's socket paths live in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_start_that_fails_after_redis_is_up_leaves_no_redis_server(workdir):
    (workdir / "failed").mkdir()
    http_port = free_port()
    serve = BatonServe(workdir / "failed", tiny_model("llama"), 5, extra_args=["--http-port", str(http_port)])
    holder = socket.socket()
    try:
        # The port check passed; Redis starts next, then Ray (seconds), then Serve's proxies.
        redis_pid = wait_until(lambda: redis_pid_of(serve), timeout_s=60, interval_s=0.05, what="redis-server")
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", http_port))
        holder.listen(1)
        assert serve.process.wait(timeout=120) == 1, serve.text()
        wait_until(lambda: is_gone(redis_pid), timeout_s=10, what=f"redis-server {redis_pid} to be gone")
        assert f"port {http_port} (server.http_port) is already in use" in serve.text(), serve.text()
        wait_until(lambda: not session_pids(serve.session_id), timeout_s=10, what="the session to be empty")
    finally:
        holder.close()
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


@pytest.fixture(scope="module")
def server(workdir) -> Iterator[BatonServe]:
    (workdir / "running").mkdir()
    serve = BatonServe(workdir / "running", tiny_model("llama"), 5)
    try:
        serve.wait_ready()
        yield serve
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


PROMPT = "def main():\n    parser = argparse.ArgumentParser(description=__doc__)\n    args = parser.parse_args()\n"


def completion(serve: BatonServe) -> str:
    port = re.search(r"^HTTP\s+http://127\.0\.0\.1:(\d+)/v1", serve.text(), re.MULTILINE).group(1)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0)
    done = client.completions.create(model="baton-tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
    return done.choices[0].text


def test_a_killed_redis_is_restarted_and_serving_goes_on(server):
    before = completion(server)
    line = re.search(r"^Redis redis://127\.0\.0\.1:(\d+)\s+\(local, pid (\d+);", server.text(), re.MULTILINE)
    port, pid = int(line.group(1)), int(line.group(2))
    assert redis_pid_of(server) == pid
    (num_before,) = wait_until(lambda: list(stored_blocks(port).values()), what="the worker's blocks in Redis")
    assert num_before > 0
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    back = server.wait_for("WARNING baton.services.launcher.local_redis: the local redis-server is back", 30)
    back_s = time.monotonic() - killed_at
    assert f"(pid {pid}, port {port}) was killed by SIGKILL" in server.text(), server.text()
    assert is_gone(pid)  # reaped by `baton serve`, not left a zombie
    new_pid = int(re.search(r"\(pid (\d+), restart 1\)", back).group(1))
    assert redis_pid_of(server) == new_pid and back_s < 10, (back_s, server.text())
    # No request since: the worker's agent registers again and republishes its blocks by itself.
    rebuilt = wait_until(lambda: list(stored_blocks(port).values()) == [num_before], timeout_s=10, what="the index")
    rebuilt_s = time.monotonic() - killed_at
    print(f"local Redis back {back_s * 1000:.0f} ms after the kill, its index rebuilt after {rebuilt_s:.2f} s")
    assert rebuilt
    assert completion(server) == before  # greedy: the same text through the restarted Redis


def test_sigterm_leaves_no_redis_server(server):
    pid = redis_pid_of(server)
    assert pid is not None
    server.signal(signal.SIGTERM)
    assert server.process.wait(timeout=TEARDOWN_S) == 0, server.text()
    assert is_gone(pid)
    wait_until(lambda: not session_pids(server.session_id), timeout_s=10, what="the session to be empty")


def test_ctrl_c_stops_in_order_and_redis_outlives_the_drain(workdir):
    """Ctrl-C signals the terminal's whole foreground process group: Redis, in a group of its
    own, must not die with it and be restarted, but be stopped by `baton serve` at the end."""
    (workdir / "ctrl-c").mkdir()
    serve = BatonServe(workdir / "ctrl-c", tiny_model("llama"), 5)
    try:
        serve.wait_ready()
        pid = redis_pid_of(serve)
        assert pid is not None
        os.killpg(serve.process.pid, signal.SIGINT)  # what the terminal does (it leads its group)
        # Ray's processes share the group and get the SIGINT too: its stop may take longer.
        assert serve.process.wait(timeout=2 * TEARDOWN_S) == 0, serve.text()
        text = serve.text()
        assert "SIGINT: stopping" in text and "local_redis" not in text, text  # no death, no restart logged
        assert is_gone(pid)
        wait_until(lambda: not session_pids(serve.session_id), timeout_s=10, what="the session to be empty")
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


LOCAL_DEPLOYMENT_ON_A_TAKEN_PORT = """
import socket, sys
from pathlib import Path
from baton.services.launcher.launcher import LocalDeployment, resolve_config

holder = socket.socket()
holder.bind(("127.0.0.1", 0))
holder.listen(1)
overrides = {"server": {"http_port": holder.getsockname()[1], "grpc_port": 0}}
deployment = LocalDeployment(resolve_config(None, sys.argv[1], overrides), Path(sys.argv[2]), num_cpus=2)
try:
    with deployment:
        print("started", flush=True)
except RuntimeError as e:
    print("failed", deployment.redis.pid if deployment.redis else None, deployment.redis.url, flush=True)
"""


def test_a_local_deployment_whose_serve_start_fails_stops_its_redis_and_ray(workdir):
    """What a `with LocalDeployment(...)` caller (the tests, a script) gets when Serve cannot
    start: the exception, and neither Redis nor Ray left running (__exit__ never runs then)."""
    run_dir = workdir / "with"
    command = [sys.executable, "-c", LOCAL_DEPLOYMENT_ON_A_TAKEN_PORT, str(tiny_model("llama")), str(run_dir)]
    script = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = script.communicate(timeout=180)
    finally:
        if script.poll() is None:
            for pid in session_pids(script.pid):
                os.kill(pid, signal.SIGKILL)
    last = output.strip().splitlines()[-1]
    assert last.startswith("failed None redis://"), output  # stopped before the exception came out
    port = int(last.rsplit(":", 1)[1])
    assert not redis_server_pids(port)
    wait_until(lambda: not session_pids(script.pid), timeout_s=10, what="Ray's processes to be gone")
