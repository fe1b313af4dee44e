"""The gateway without Ray: error mapping for both APIs, driven through fake engine clients."""

from __future__ import annotations

import grpc
import pytest
from baton.services.gateway.openai_api import build_http_app
from baton.services.serving_errors import NoHealthyWorkersError, ServerOverloadedError
from baton.v1 import inference_pb2 as pb
from fastapi.testclient import TestClient


@pytest.mark.parametrize(
    "error,code,status",
    [
        (NoHealthyWorkersError("no prefill worker is alive"), grpc.StatusCode.UNAVAILABLE, 503),
        (ServerOverloadedError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL, 500),
    ],
)
async def test_placement_errors_map_to_codes(fake_gateway, grpc_failure, error, code, status):
    gateway, _ = fake_gateway(error=error)
    context = await grpc_failure(gateway, pb.GenerateRequest(text="hi"))
    assert context.code == code and str(error) in context.details
    http = TestClient(build_http_app(gateway.openai))
    reply = http.post("/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == status
    assert reply.json()["error"]["message"].endswith(str(error)) or str(error) in reply.json()["error"]["message"]
    streamed = http.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert streamed.status_code == status  # an error at once still gets its status, not 200 + an error event


async def test_validation_happens_before_placement(fake_gateway, grpc_failure):
    gateway, engine_client = fake_gateway()
    context = await grpc_failure(gateway, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3] * 80)))
    assert (
        context.code == grpc.StatusCode.INVALID_ARGUMENT and "80 tokens" in context.details and "64" in context.details
    )
    assert engine_client.calls == []


def test_health_reports_503_when_workers_are_down(fake_gateway):
    http = TestClient(build_http_app(fake_gateway(healthy=False)[0].openai))
    assert http.get("/health").status_code == 503
    http = TestClient(build_http_app(fake_gateway()[0].openai))
    assert http.get("/health").json() == {"status": "ok"}
