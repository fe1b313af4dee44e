"""The gateway without Ray: error mapping for both APIs, driven through fake engine clients."""

from __future__ import annotations

import json

import grpc
import pytest
from baton.services.engine.errors import EngineDeadError
from baton.services.gateway.openai_api import build_http_app
from baton.services.serving_errors import (
    ENGINE_STOPPED,
    INTERNAL_ERROR,
    WORKER_LOST,
    NoHealthyWorkersError,
    ServerOverloadedError,
)
from baton.v1 import inference_pb2 as pb
from fastapi.testclient import TestClient
from ray.exceptions import RayActorError


@pytest.mark.parametrize(
    "error,code,status,message",
    [
        (NoHealthyWorkersError("no prefill worker is alive"), grpc.StatusCode.UNAVAILABLE, 503, None),
        (ServerOverloadedError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429, None),
        # A server error's own text stays in the log: it can hold internals.
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL, 500, INTERNAL_ERROR),
    ],
)
async def test_placement_errors_map_to_codes(fake_gateway, grpc_failure, error, code, status, message):
    message = message or str(error)
    gateway, _ = fake_gateway(error=error)
    context = await grpc_failure(gateway, pb.GenerateRequest(text="hi"))
    assert context.code == code and message in context.details
    http = TestClient(build_http_app(gateway.openai))
    reply = http.post("/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == status
    assert message in reply.json()["error"]["message"]
    streamed = http.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert streamed.status_code == status  # an error at once still gets its status, not 200 + an error event


class DecodeWorkerDied(RayActorError):
    """What Ray raises when a decode replica dies mid-stream, with the details Ray puts in it."""

    def __str__(self) -> str:
        return "The actor died. actor_id=27f282200b6a4d03f2930fb801000000, pid=4230, ip=10.0.0.7"


@pytest.mark.parametrize(
    "error,message",
    [
        (DecodeWorkerDied(), WORKER_LOST),
        (EngineDeadError("the engine stopped after an error: RuntimeError('CUDA error at 0x7f3b')"), ENGINE_STOPPED),
    ],
)
async def test_worker_death_reaches_clients_without_ids_or_pids(fake_gateway, grpc_failure, error, message):
    gateway, _ = fake_gateway(error=error)
    context = await grpc_failure(gateway, pb.GenerateRequest(text="hi"))
    assert context.code == grpc.StatusCode.UNAVAILABLE and context.details == message
    http = TestClient(build_http_app(gateway.openai))
    for body in ({"prompt": "hi"}, {"prompt": "hi", "stream": True}):
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 503 and reply.json()["error"]["message"] == message
    for leak in ("actor_id", "pid", "10.0.0.7", "RuntimeError", "0x7f3b"):
        assert leak not in message


async def test_validation_happens_before_placement(fake_gateway, grpc_failure):
    gateway, engine_client = fake_gateway()
    context = await grpc_failure(gateway, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3] * 80)))
    assert (
        context.code == grpc.StatusCode.INVALID_ARGUMENT and "80 tokens" in context.details and "64" in context.details
    )
    assert engine_client.calls == []


async def test_prompt_plus_max_tokens_over_the_context_is_refused_before_placement(fake_gateway, grpc_failure):
    gateway, engine_client = fake_gateway()  # max_model_len 64
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3] * 60), sampling=pb.SamplingParameters(max_tokens=10))
    context = await grpc_failure(gateway, request)
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert all(n in context.details for n in ("60 tokens", "max_tokens is 10", "64", "at most 4"))
    http = TestClient(build_http_app(gateway.openai))
    for path, body in [
        ("/v1/completions", {"prompt": [3] * 60, "max_tokens": 10}),
        ("/v1/completions", {"prompt": [3] * 60}),  # the default 16 does not fit either
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}),
    ]:
        reply = http.post(path, json=body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert engine_client.calls == []
    assert http.post("/v1/completions", json={"prompt": [3] * 60, "max_tokens": 4}).status_code == 200
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 200


def test_health_reports_503_when_workers_are_down(fake_gateway):
    http = TestClient(build_http_app(fake_gateway(healthy=False)[0].openai))
    assert http.get("/health").status_code == 503
    http = TestClient(build_http_app(fake_gateway()[0].openai))
    assert http.get("/health").json() == {"status": "ok"}


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_return_token_ids_gives_each_chunk_its_tokens(fake_gateway, chat):
    """vLLM's extension: a client counts tokens exactly when a chunk holds several."""
    from baton.services.gateway.openai_api import build_http_app
    from fastapi.testclient import TestClient

    gateway, _ = fake_gateway(deltas=[(0, "a", None), (0, "b", "length")])
    client = TestClient(build_http_app(gateway.openai))
    path, body = (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        if chat
        else (
            "/v1/completions",
            {"prompt": "hi"},
        )
    )
    whole = client.post(path, json={**body, "return_token_ids": True}).json()
    assert whole["choices"][0]["token_ids"] == [5, 5]
    with client.stream("POST", path, json={**body, "return_token_ids": True, "stream": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    assert [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]] == [5, 5]
    plain = client.post(path, json=body).json()
    assert "token_ids" not in plain["choices"][0]
