"""The gateway without Ray: error mapping for both APIs, driven through fake engine clients."""

from __future__ import annotations

import grpc
import pytest
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.engine_client import EngineClient
from baton.services.gateway.gateway import Gateway
from baton.services.gateway.openai_api import build_http_app
from baton.services.serving_errors import NoHealthyWorkersError, ServerOverloadedError
from baton.services.worker_calls import WorkerModelInfo
from baton.v1 import inference_pb2 as pb
from fastapi.testclient import TestClient
from testlib.models import tiny_model

INFO = WorkerModelInfo("tiny", 64, 16, 1, 1024, "colocated", "w@0")


class FakeEngineClient(EngineClient):
    def __init__(self, error: Exception | None = None, healthy: bool = True) -> None:
        self.error = error
        self.healthy = healthy
        self.calls = []

    async def stream(self, call, trace):
        self.calls.append(call)
        if self.error is not None:
            raise self.error
        yield RequestOutput(
            call.request_id,
            None,
            call.prompt_token_ids,
            [CompletionOutput(0, "ok", [5], None, None, "length")],
            True,
            0,
        )

    async def model_info(self):
        return INFO

    async def is_healthy(self):
        return self.healthy

    @property
    def roles(self):
        return ["colocated"]


class FakeContext:
    def __init__(self):
        self.code, self.details = None, None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.fixture(scope="module")
def tokenizer_dir():
    return str(tiny_model("llama"))


async def grpc_generate(gateway, request):
    context = FakeContext()
    responses = []
    with pytest.raises(Exception):  # noqa: B017 - the status is what matters; Serve wraps the exception
        async for response in gateway.Generate(request, context):
            responses.append(response)
    return context


@pytest.mark.parametrize(
    "error,code,status",
    [
        (NoHealthyWorkersError("no prefill worker is alive"), grpc.StatusCode.UNAVAILABLE, 503),
        (ServerOverloadedError("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (RuntimeError("boom"), grpc.StatusCode.INTERNAL, 500),
    ],
)
async def test_placement_errors_map_to_codes(tokenizer_dir, error, code, status):
    gateway = Gateway(FakeEngineClient(error), tokenizer_dir)
    context = await grpc_generate(gateway, pb.GenerateRequest(text="hi"))
    assert context.code == code and str(error) in context.details
    http = TestClient(build_http_app(gateway.openai))
    reply = http.post("/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == status
    assert reply.json()["error"]["message"].endswith(str(error)) or str(error) in reply.json()["error"]["message"]
    streamed = http.post("/v1/completions", json={"prompt": "hi", "stream": True})
    assert streamed.status_code == status  # an error at once still gets its status, not 200 + an error event


async def test_validation_happens_before_placement(tokenizer_dir):
    engine_client = FakeEngineClient()
    gateway = Gateway(engine_client, tokenizer_dir)
    context = await grpc_generate(gateway, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3] * 80)))
    assert (
        context.code == grpc.StatusCode.INVALID_ARGUMENT and "80 tokens" in context.details and "64" in context.details
    )
    assert engine_client.calls == []


def test_health_reports_503_when_workers_are_down(tokenizer_dir):
    http = TestClient(build_http_app(Gateway(FakeEngineClient(healthy=False), tokenizer_dir).openai))
    assert http.get("/health").status_code == 503
    http = TestClient(build_http_app(Gateway(FakeEngineClient(), tokenizer_dir).openai))
    assert http.get("/health").json() == {"status": "ok"}
