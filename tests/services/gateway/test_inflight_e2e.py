"""The gateway's in-flight bound end to end (real local Ray cluster, Serve's proxies, tiny
model): with server.limits.max_inflight_requests generation requests held open, the next one
gets 429 with Retry-After through Serve's HTTP proxy (RESOURCE_EXHAUSTED with retry-after on
gRPC) naming the bound, at once; it is counted in baton_requests_shed_total{reason=
"gateway_inflight"}, the backlog shows in baton_gateway_requests_in_flight, and once the held
requests go, requests are served again.

The held requests are clients that send their headers and half their body: the gateway's
slot is taken before the body is read (inflight_limit.py), so they hold it as long as they
like, with no timing to race."""

from __future__ import annotations

import contextlib
import json
import socket
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import grpc
import httpx
import pytest
from baton.services.client import BatonClient
from baton.services.launcher.launcher import LocalDeployment, resolve_config
from testlib.baton_client import greedy_request
from testlib.models import tiny_model

from .beside import counter_value, wait_for_counter

pytestmark = pytest.mark.ray

BOUND = 4
BODY = {"model": "baton-tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def deployment():
    config = resolve_config(
        None,
        str(tiny_model("llama")),
        {
            "mode": "colocated",
            "server": {"http_port": 0, "grpc_port": 0, "limits": {"max_inflight_requests": BOUND}},
            "engine": {"model": {"max_model_len": 256}, "cache": {"num_kv_blocks": 64}},
            "colocated": {"ray_actor_options": {"num_cpus": 1}},
        },
    )
    run_dir = Path(tempfile.mkdtemp(prefix="baton-", dir="/tmp"))
    with LocalDeployment(config, run_dir, num_cpus=4) as deployment:
        yield deployment


@contextlib.contextmanager
def half_sent_bodies(http_address: str, count: int):
    """`count` POST /v1/completions whose body is half sent: each holds a gateway slot."""
    url = urlparse(http_address)
    body = json.dumps(BODY).encode()
    sockets = []
    try:
        for _ in range(count):
            held = socket.create_connection((url.hostname, url.port), timeout=10)
            head = (
                f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            held.sendall(head.encode() + body[: len(body) // 2])
            sockets.append(held)
        yield
    finally:
        for held in sockets:
            held.close()


def test_over_the_inflight_bound_is_429_with_retry_after_then_served_again(deployment):
    address, metrics = deployment.http_address, deployment.metrics_address
    assert httpx.post(f"{address}/v1/completions", json=BODY, timeout=60).status_code == 200  # warm
    shed_before = counter_value(metrics, "baton_requests_shed_total", reason="gateway_inflight")
    with half_sent_bodies(address, BOUND):
        deadline, reply = time.monotonic() + 30, None
        while time.monotonic() < deadline:  # until the held requests have reached the gateway
            start = time.monotonic()
            reply = httpx.post(f"{address}/v1/completions", json=BODY, timeout=60)
            if reply.status_code == 429:
                break
            time.sleep(0.1)
        refused_s = time.monotonic() - start
        assert reply is not None and reply.status_code == 429, reply.text
        assert reply.headers["retry-after"] == "1"
        error = reply.json()["error"]
        assert error["retry_after"] == 1
        assert f"requests in flight (limit {BOUND}, server.limits.max_inflight_requests)" in error["message"]
        assert refused_s < 1.0, refused_s  # shed at the door, not after a wait

        chat = httpx.post(
            f"{address}/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "hi"}]}, timeout=60
        )
        assert chat.status_code == 429 and chat.headers["retry-after"] == "1", chat.text
        client = BatonClient(deployment.grpc_address)
        try:
            with pytest.raises(grpc.RpcError) as info:
                list(client.generate(greedy_request("hi", 4), timeout=30))
        finally:
            client.close()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata() or ())["retry-after"] == "1"
        assert "server.limits.max_inflight_requests" in info.value.details()
        assert httpx.get(f"{address}/v1/models", timeout=30).status_code == 200  # not a generation request

        shed = wait_for_counter(metrics, "baton_requests_shed_total", shed_before + 3, reason="gateway_inflight")
        assert shed >= shed_before + 3
        in_flight = _wait_for_gauge(metrics, "baton_gateway_requests_in_flight", BOUND)
        assert in_flight >= BOUND
        print(
            f"gateway in-flight bound {BOUND}: HTTP 429 in {refused_s * 1e3:.0f} ms (Retry-After 1), gRPC "
            f"RESOURCE_EXHAUSTED; shed counted {shed - shed_before:g}; in-flight gauge {in_flight:g}"
        )
    # The held clients left: their slots are free again.
    deadline = time.monotonic() + 30
    while (status := httpx.post(f"{address}/v1/completions", json=BODY, timeout=60).status_code) == 429:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status == 200
    assert _wait_for_gauge(metrics, "baton_gateway_requests_in_flight", 0, below=True) == 0
    # The engine's side of the backlog is exported beside it (idle now: nothing waits for prefill).
    assert _wait_for_gauge(metrics, "baton_num_waiting_prompt_tokens", 0, below=True) == 0


def _wait_for_gauge(metrics_address: str, name: str, value: float, below: bool = False, timeout_s: float = 30) -> float:
    """The gauge once it reaches `value` (at most it, with `below`); its last reading otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        readings = [
            float(line.rsplit(" ", 1)[1])
            for line in httpx.get(metrics_address, timeout=10).text.splitlines()
            if line.startswith(f"ray_{name}{{") or line.startswith(f"ray_{name} ")
        ]
        reading = max(readings, default=float("nan"))
        if (reading <= value if below else reading >= value) or time.monotonic() > deadline:
            return reading
        time.sleep(0.5)
