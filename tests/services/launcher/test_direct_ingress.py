"""`server.direct_ingress` on a real `baton serve`: the gateway replica itself listens on the
configured HTTP and gRPC ports (on loopback, as configured), streams chat completions and
Generate with the greedy output the proxy path gives, answers the health route, and drains an
in-flight stream on SIGTERM. What it cannot serve is refused naming the setting: more than one
gateway replica, a Ray already running, a cluster whose processes lack Serve's switch. TLS with
it: test_direct_ingress_tls.py."""

from __future__ import annotations

import logging
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from baton.services.client import BatonClient
from baton.services.launcher.direct_ingress import (
    check_ingress_ports,
    direct_ingress_environment,
    resolve_direct_ingress,
)
from baton.services.launcher.ports import PortInUse
from baton.services.serve_app.serve_entry import ServeArgs, app
from openai import OpenAI
from testlib.baton_client import collect, greedy_request
from testlib.baton_process import BatonServe, session_pids
from testlib.local_baton import tiny_config
from testlib.models import tiny_model
from testlib.sockets import addresses_listening_on, listening_addresses

from .test_serve_command import free_ports
from .test_stop_signals import TEARDOWN_S, assert_signal_drains_a_stream

PROMPT = "def handle(request):\n    user = authenticate(request.headers)\n"
GRACE_PERIOD_S = 20


def test_more_than_one_gateway_replica_is_refused_naming_the_setting():
    config = tiny_config(
        {"server": {"direct_ingress": True, "http_port": 0, "grpc_port": 0}, "gateway": {"num_replicas": 2}}
    )
    with pytest.raises(ValueError, match=r"server\.direct_ingress.*gateway num_replicas is 2"):
        resolve_direct_ingress(config, ray_running=False)
    scaled = {"autoscaling": {"min_replicas": 1, "max_replicas": 3}}
    config = tiny_config({"server": {"direct_ingress": True, "http_port": 0, "grpc_port": 0}, "gateway": scaled})
    with pytest.raises(ValueError, match=r"gateway autoscaling\.max_replicas is 3"):
        resolve_direct_ingress(config, ray_running=False)


def test_a_running_ray_is_refused_and_the_option_off_checks_nothing():
    on = tiny_config({"server": {"direct_ingress": True, "http_port": 0, "grpc_port": 0}})
    with pytest.raises(ValueError, match=r"server\.direct_ingress: needs a Ray that baton serve starts"):
        resolve_direct_ingress(on, ray_running=True)
    assert resolve_direct_ingress(on, ray_running=False) is True
    off = tiny_config({"server": {"direct_ingress": False}, "gateway": {"num_replicas": 2}})
    assert resolve_direct_ingress(off, ray_running=True) is False
    assert resolve_direct_ingress(off, ray_running=False) is False


def test_auto_is_the_default_and_runs_direct_ingress_only_where_it_can(caplog):
    """`auto` takes the proxy where `true` would be refused, and says why in the log."""
    default = tiny_config({"server": {"http_port": 0, "grpc_port": 0}})
    assert default.server.direct_ingress == "auto"
    assert resolve_direct_ingress(default, ray_running=False) is True
    with caplog.at_level(logging.INFO, logger="baton.services.launcher.direct_ingress"):
        assert resolve_direct_ingress(default, ray_running=True) is False
        two = tiny_config({"server": {"direct_ingress": "auto"}, "gateway": {"num_replicas": 2}})
        assert resolve_direct_ingress(two, ray_running=False) is False
    reasons = [r.getMessage() for r in caplog.records]
    assert any("Ray was already running here" in r for r in reasons), reasons
    assert any("gateway num_replicas is 2" in r for r in reasons), reasons
    with pytest.raises(ValueError, match=r"server\.direct_ingress"):
        tiny_config({"server": {"direct_ingress": "sometimes"}})


def test_a_port_taken_before_the_gateway_replica_binds_it_is_named():
    """A direct-ingress replica retries a taken port for minutes; the launcher checks first."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = holder.getsockname()[1]
    (free,) = free_ports(1)
    try:
        with pytest.raises(PortInUse) as raised:
            check_ingress_ports("127.0.0.1", free, "127.0.0.1", taken)
        assert (raised.value.port, raised.value.key) == (taken, "server.grpc_port")
        assert f"port {taken} (server.grpc_port) is already in use" in str(raised.value)
        with pytest.raises(PortInUse, match=r"\(server\.http_port\)"):
            check_ingress_ports("127.0.0.1", taken, "127.0.0.1", free)
    finally:
        holder.close()
    check_ingress_ports("127.0.0.1", free, "127.0.0.1", taken)


def test_the_environment_pins_both_ports_and_no_draining_minimum():
    env = direct_ingress_environment(8123, 9123)
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # Serve's pool is range(MIN, MAX): one port each.
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "8123",
        "8124",
    )
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) == (
        "9123",
        "9124",
    )
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_a_cluster_whose_processes_lack_the_switch_refuses_the_application(monkeypatch):
    """On a Ray cluster (the chart, `serve deploy`) Baton cannot set Serve's environment."""
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    config = {"engine": {"model": {"model": str(tiny_model("llama"))}}, "server": {"direct_ingress": True}}
    with pytest.raises(ValueError, match=r"server\.direct_ingress: this Ray cluster's processes run without"):
        app(ServeArgs(config=config))


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bt-di-", dir="/tmp"))  # short: Ray's socket paths live in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(workdir: Path, direct_ingress: bool) -> tuple[BatonServe, int, int]:
    http_port, grpc_port, metrics_port = free_ports(3)
    flags = ["--http-port", str(http_port), "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
    flags += ["--set", f"server.direct_ingress={str(direct_ingress).lower()}"]
    run_dir = workdir / ("on" if direct_ingress else "off")
    run_dir.mkdir()
    serve = BatonServe(
        run_dir, tiny_model("llama"), GRACE_PERIOD_S, extra_args=flags, env={"RAY_TMPDIR": str(run_dir / "rt")}
    )
    serve.wait_ready()
    return serve, http_port, grpc_port


def outputs(http_port: int, grpc_port: int) -> tuple[str, str]:
    """A streamed greedy chat completion and a greedy Generate's text."""
    client = OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
    chunks = client.chat.completions.create(
        model="baton-tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0,
        stream=True,
    )
    chat = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    grpc_client = BatonClient(f"127.0.0.1:{grpc_port}")
    try:
        generated = "".join(r.text for r in collect(grpc_client, greedy_request(PROMPT, 24)))
    finally:
        grpc_client.close()
    return chat, generated


@pytest.fixture(scope="module")
def proxied(workdir) -> tuple[str, str]:
    """What the proxy path answers (direct ingress off), from a server stopped before the test."""
    serve, http_port, grpc_port = start(workdir, direct_ingress=False)
    try:
        return outputs(http_port, grpc_port)
    finally:
        serve.signal(signal.SIGTERM)
        serve.process.wait(timeout=GRACE_PERIOD_S + TEARDOWN_S)
        if session_pids(serve.session_id):
            serve.kill_session()


@pytest.mark.ray
@pytest.mark.redis
@pytest.mark.slow
def test_the_gateway_replica_serves_both_ports_as_the_proxy_did_and_drains_on_sigterm(workdir, proxied):
    serve, http_port, grpc_port = start(workdir, direct_ingress=True)
    try:
        assert "Ingress direct" in serve.text()
        # The configured ports are the gateway replica's own, on the configured loopback host.
        gateway_pids = {
            pid for pid, cmd in session_pids(serve.session_id).items() if "ServeReplica" in cmd and "gateway" in cmd
        }
        assert gateway_pids, session_pids(serve.session_id)
        held = listening_addresses(gateway_pids)
        assert ("127.0.0.1", http_port) in held and ("127.0.0.1", grpc_port) in held, held
        assert addresses_listening_on(http_port) == {"127.0.0.1"}
        assert addresses_listening_on(grpc_port) == {"127.0.0.1"}
        assert httpx.get(f"http://127.0.0.1:{http_port}/-/healthz", timeout=10).status_code == 200
        models = httpx.get(f"http://127.0.0.1:{http_port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["baton-tiny"]

        chat, generated = outputs(http_port, grpc_port)
        assert chat and generated
        assert (chat, generated) == proxied

        assert_signal_drains_a_stream(serve, f"127.0.0.1:{grpc_port}", signal.SIGTERM, GRACE_PERIOD_S)
    finally:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()
