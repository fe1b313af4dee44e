"""A cold start longer than its bound, on a real local Ray cluster: a colocated role at zero
replicas with a cold-start timeout far shorter than a replica's start. The request waiting
for it gets 503 with Retry-After when the bound passes (not a hang, not a late answer), and
a client that retries as told is served once the replica Serve started for it is up."""

from __future__ import annotations

import time

import httpx
import pytest
from testlib.local_baton import local_baton

from .test_scale_to_zero_cluster import autoscaling, running

pytestmark = pytest.mark.ray

COLD_START_TIMEOUT_S = 0.5  # a replica takes seconds to start here
SERVED_WITHIN_S = 300.0
TO_ZERO_WITHIN_S = 120.0


@pytest.fixture(scope="module")
def deployment():
    overrides = {
        "mode": "colocated",
        "engine": {"model": {"max_model_len": 256}, "cache": {"num_kv_blocks": 64}},
        "colocated": {
            "ray_actor_options": {"num_cpus": 0.25},
            "autoscaling": autoscaling(cold_start_timeout_s=COLD_START_TIMEOUT_S),
        },
    }
    with local_baton(overrides, grace_period_s=2.0) as deployment:
        yield deployment


def complete(deployment) -> httpx.Response:
    body = {"model": deployment.config.served_model_name, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{deployment.http_address}/v1/completions", json=body, timeout=120)


def serve_once(deployment) -> int:
    """Retries (sooner than Retry-After: the queued calls are what keep Serve's replica coming)
    until a request is served; the 503s it got on the way."""
    refusals = 0
    deadline = time.monotonic() + SERVED_WITHIN_S
    while (response := complete(deployment)).status_code == 503:
        assert response.headers.get("retry-after"), response.headers
        refusals += 1
        assert time.monotonic() < deadline, f"still 503 after {SERVED_WITHIN_S} s: {response.text}"
        time.sleep(0.2)
    assert response.status_code == 200, response.text
    return refusals


def test_a_cold_start_past_its_bound_is_a_503_with_retry_after(deployment):
    serve_once(deployment)  # up once, so the gateway has seen the role's replicas come and go
    start = time.monotonic()
    while running("colocated"):
        assert time.monotonic() - start < TO_ZERO_WITHIN_S, "not at zero"
        time.sleep(0.25)
    time.sleep(1.0)  # the gateway's handle sees the replica gone

    response = complete(deployment)
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) > 0
    assert "cold-start timeout" in response.text and "colocated" in response.text, response.text
    refusals = serve_once(deployment)
    print(f"503 with Retry-After {response.headers['retry-after']} s, then served after {refusals} more refusals")
