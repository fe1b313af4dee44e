"""`baton serve` as a newcomer runs it, one real server for the module: started with
`--http-port A --grpc-port B --metrics-port C` (and RAY_TMPDIR), reached by `baton generate
--address`, the openai client on A, and `baton generate` / `baton status` finding it through a
config or BATON_ADDRESS; its start and stop print no warning or traceback at the default log
level. A busy port ends `baton serve` in one line, in seconds, with nothing left running."""

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
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from openai import OpenAI
from testlib.baton_process import BatonServe, session_pids
from testlib.models import tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

# What a normal start or stop must not print (Ray's and Serve's INFO lines, its warnings, the
# misleading "will not be applied" and the graceful_shutdown retry error).
ALARMING = re.compile(r"(?i:warn|error|traceback|failed|will not be applied)|\(raylet\)|\bINFO\b")
TEARDOWN_S = 30


@dataclass
class Running:
    serve: BatonServe
    http_port: int
    grpc_port: int
    metrics_port: int
    ray_tmpdir: Path
    workdir: Path

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def baton(*argv: str, env: dict[str, str] | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "baton.services.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})})


def output_after_exit(serve: BatonServe) -> str:
    while serve._lines.get(timeout=10) is not None:  # the reader thread has read to the end
        pass
    return serve.text()


def alarming_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ALARMING.search(line)]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # short: Ray's socket paths live in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def server(workdir) -> Iterator[Running]:
    http_port, grpc_port, metrics_port = free_ports(3)
    ray_tmpdir = workdir / "rt"
    flags = ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    serve = BatonServe(workdir, tiny_model("llama"), 10, extra_args=flags, env={"RAY_TMPDIR": str(ray_tmpdir)})
    try:
        serve.wait_ready()
        yield Running(serve, http_port, grpc_port, metrics_port, ray_tmpdir, workdir)
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


def test_start_prints_the_flags_addresses_and_the_logs_and_nothing_alarming(server):
    text = server.serve.text()
    assert f"gRPC  127.0.0.1:{server.grpc_port} " in text
    assert f"HTTP  http://127.0.0.1:{server.http_port}/v1 " in text
    assert f"Metrics http://127.0.0.1:{server.metrics_port}/metrics " in text
    logs = re.search(r"^Logs  (\S+)   \(Ray and Serve: (\S+)\)$", text, re.MULTILINE)
    assert logs, text
    baton_log, ray_logs = Path(logs.group(1)), Path(logs.group(2))
    assert baton_log.is_file() and "Started a local Ray instance" in baton_log.read_text()
    # RAY_TMPDIR is honoured: Ray's session is under it, not in the run folder.
    assert ray_logs.is_relative_to(server.ray_tmpdir / "ray") and ray_logs.is_dir()
    assert not (baton_log.parent / "ray").exists()
    assert not alarming_lines(text), text


def test_baton_generate_reaches_the_grpc_port_given_by_address(server):
    done = baton("generate", "--address", server.grpc_address, "def main():", "--max-tokens", "8", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() and "[length] prompt" in done.stderr and "8 generated" in done.stderr


def test_the_openai_client_reaches_the_http_port(server):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused", timeout=60)
    assert [m.id for m in client.models.list().data] == ["baton-tiny"]
    completion = client.completions.create(model="baton-tiny", prompt="def main():", max_tokens=8, temperature=0)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 8


def test_clients_find_the_server_through_its_config_or_baton_address(server):
    config = server.workdir / "client.yaml"
    ports = {"http_port": server.http_port, "grpc_port": server.grpc_port, "metrics_port": server.metrics_port}
    config.write_text(yaml.safe_dump({"name": "baton", "server": ports}))
    done = baton("generate", "--config", str(config), "x = ", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    done = baton("generate", "x = ", "--max-tokens", "4", env={"BATON_ADDRESS": server.grpc_address})
    assert done.returncode == 0, done.stderr

    deadline = time.monotonic() + 30  # workers push their gauges every 2 s: the last may predate the requests' end
    while "1024 blocks free" not in (status := baton("status", "--config", str(config))).stdout:
        assert status.returncode == 0 and time.monotonic() < deadline, status.stdout + status.stderr
        time.sleep(1)
    lines = status.stdout.splitlines()
    assert lines[0] == f"Baton at {server.grpc_address} (application baton): SERVING"
    assert lines[1].startswith("model     baton-tiny: context 2048 tokens, block size 16, tensor parallel 1")
    assert lines[2] == "mode      colocated (roles colocated)"
    assert lines[3] == "router    prefix_aware"  # as the running server reports it
    rest = [line for line in lines[4:] if "prefix-aware placements so far" not in line]
    assert rest[0].startswith("replicas  colocated 1/1 healthy, gateway 1/1 healthy")
    assert re.match(r"KV cache  colocated worker \w{8}: \d+\.\d% used, 1024 blocks free", rest[1]), rest[1]


def test_stop_is_quiet_and_leaves_nothing(server):
    server.serve.signal(signal.SIGTERM)
    assert server.serve.process.wait(timeout=TEARDOWN_S) == 0, server.serve.text()
    text = server.serve.text()
    assert text.splitlines()[-2:] == ["SIGTERM: stopping (draining) ...", "stopped"], text
    assert not alarming_lines(text), text
    deadline = time.monotonic() + 10
    while (left := session_pids(server.serve.session_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def test_a_busy_port_is_one_line_in_seconds_and_leaves_nothing(workdir):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        started = time.monotonic()
        (workdir / "busy").mkdir()
        serve = BatonServe(workdir / "busy", tiny_model("llama"), 5, extra_args=["--grpc-port", str(port)])
        try:
            assert serve.process.wait(timeout=15) == 1, serve.text()
            assert time.monotonic() - started < 15
        finally:
            if serve.process.poll() is None:
                serve.kill_session()
    assert output_after_exit(serve).splitlines() == [
        f"baton serve: port {port} (server.grpc_port) is already in use: stop what listens there or choose "
        f"another with --grpc-port N or --set server.grpc_port=N"
    ]
    assert not session_pids(serve.session_id)  # no Ray, no redis-server
