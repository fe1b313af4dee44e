"""The gateway's in-flight bound (inflight_limit.py, server.limits.max_inflight_requests): a
generation request over it is shed at once with 429 / RESOURCE_EXHAUSTED and Retry-After
naming the bound, on both APIs, counting HTTP and gRPC requests together; a slot frees when
its request ends (a stream's too, or an error); the config keeps the bound under Serve's.
No Ray: the real gateway and tokenizer over an engine client that holds its streams."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from baton.services.config import BatonConfig
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.gateway import Gateway
from baton.services.gateway.inflight_limit import SHED_REASON, InflightLimit
from baton.services.gateway.openai_api import build_http_app
from baton.services.gateway.request_limits import RequestLimits
from baton.services.serving_errors import ServerOverloadedError, status_of
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc
from pydantic import ValidationError
from testlib.grpc_inprocess import served

from .conftest import FakeEngineClient

BOUND = 3
COMPLETION = {"prompt": "hi", "max_tokens": 2}


class HeldEngineClient(FakeEngineClient):
    """Streams one delta per request once `release` is set: its requests stay in flight until then."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def stream(self, call, trace):
        self.calls.append(call)
        await self.release.wait()
        completion = CompletionOutput(0, "ok", [5], None, None, "length")
        yield RequestOutput(call.request_id, None, call.prompt_token_ids, [completion], True, 0)


def test_the_limit_refuses_over_the_bound_naming_it_and_frees_on_leave():
    limit = InflightLimit(2)
    limit.enter()
    with limit.held(), pytest.raises(ServerOverloadedError) as info:
        limit.enter()
    assert limit.num_inflight == 1
    status = status_of(info.value)
    assert status.http_status == 429 and status.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status.retry_after_s == 1 and status.shed_reason == SHED_REASON
    assert "2 requests in flight (limit 2, server.limits.max_inflight_requests)" in status.message
    limit.enter()  # the slot held() took is back
    assert limit.num_inflight == 2


@pytest.fixture
def held(tokenizer_dir):
    engine_client = HeldEngineClient()
    gateway = Gateway(engine_client, tokenizer_dir, limits=RequestLimits(max_inflight_requests=BOUND))
    return gateway, engine_client


async def _until(predicate, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_http_and_grpc_over_the_bound_are_shed_with_retry_after(held):
    gateway, engine_client = held
    transport = httpx.ASGITransport(app=build_http_app(gateway.openai))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http, served(gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        admitted = [
            asyncio.create_task(http.post("/v1/completions", json={**COMPLETION, "stream": True})),
            asyncio.create_task(
                http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
            ),
            asyncio.create_task(_drain(stub.Generate(pb.GenerateRequest(text="hi")))),
        ]
        await _until(lambda: len(engine_client.calls) == BOUND)
        assert gateway.service.inflight.num_inflight == BOUND

        for path in ("/v1/completions", "/v1/chat/completions"):
            reply = await http.post(path, json=COMPLETION)
            assert reply.status_code == 429, reply.text
            assert reply.headers["retry-after"] == "1"
            error = reply.json()["error"]
            assert error["retry_after"] == 1 and "server.limits.max_inflight_requests" in error["message"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _drain(stub.Generate(pb.GenerateRequest(text="hi")))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata())["retry-after"] == "1"
        assert f"(limit {BOUND}, server.limits.max_inflight_requests)" in info.value.details()
        # Other routes and rpcs are not generation requests: they are not held to the bound.
        assert (await http.get("/v1/models")).status_code == 200
        assert (await stub.Tokenize(pb.TokenizeRequest(text="hello"))).count > 0
        assert len(engine_client.calls) == BOUND  # the shed ones never reached the engine client

        engine_client.release.set()
        replies = await asyncio.gather(*admitted)
        assert [r.status_code for r in replies[:2]] == [200, 200] and replies[2]
        await _until(lambda: gateway.service.inflight.num_inflight == 0)
        assert (await http.post("/v1/completions", json=COMPLETION)).status_code == 200


async def test_a_failed_or_refused_request_gives_its_slot_back(fake_gateway):
    gateway, _ = fake_gateway(limits=RequestLimits(max_inflight_requests=1), error=RuntimeError("engine broke"))
    transport = httpx.ASGITransport(app=build_http_app(gateway.openai))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        for body in (COMPLETION, {"prompt": "hi", "max_tokens": -1}, {**COMPLETION, "stream": True}):
            assert (await http.post("/v1/completions", json=body)).status_code in (400, 500)
            assert gateway.service.inflight.num_inflight == 0


def _config(**sections) -> BatonConfig:
    return BatonConfig(engine={"model": {"model": "m"}}, **sections)


def test_the_gateway_bound_stays_below_serves_and_the_proxy_queue_is_bounded():
    options = _config().gateway.serve_options()
    assert RequestLimits().max_inflight_requests < options["max_ongoing_requests"]
    assert options["max_queued_requests"] == 128
    assert options["backpressure_config"]["status_code"] == 429 and options["backpressure_config"]["retry_after_s"]
    with pytest.raises(ValidationError, match="must be below gateway.max_ongoing_requests"):
        _config(server={"limits": {"max_inflight_requests": 64}}, gateway={"max_ongoing_requests": 64})


async def _drain(stream):
    return [response async for response in stream]
