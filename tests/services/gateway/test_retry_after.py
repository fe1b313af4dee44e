"""A refusal that may succeed later says when: 429 and 503 carry `Retry-After` on HTTP (and
`retry_after` in a streamed error event), `retry-after` trailing metadata on gRPC, also
through the proxy's side as Serve's proxy reports a replica's error (grpc_servicers). And a
cancel is CANCELLED, not a server error. No Ray: the real gateway over a fake engine client."""

from __future__ import annotations

import asyncio
import json
import pickle

import grpc
import pytest
from baton.services.gateway.grpc_servicers import add_inference_servicer_to_server
from baton.services.gateway.openai_api import build_http_app
from baton.services.serving_errors import (
    NoHealthyWorkersError,
    ServerOverloadedError,
    is_rejection,
    retry_after_of,
    status_of,
)
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc
from fastapi.testclient import TestClient
from ray.exceptions import TaskCancelledError
from ray.serve.exceptions import BackPressureError, RequestCancelledError
from testlib.grpc_inprocess import served

OVERLOADED = ServerOverloadedError("worker w has 40 queued requests (limit 40); retry later", retry_after_s=2.5)
UNAVAILABLE = NoHealthyWorkersError("no decode replica is alive", retry_after_s=5)
COMPLETION = {"prompt": "hi", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def http_of(fake_gateway, **kwargs) -> TestClient:
    gateway, _ = fake_gateway(**kwargs)
    return TestClient(build_http_app(gateway.openai), raise_server_exceptions=False)


@pytest.mark.parametrize("error,status,seconds", [(OVERLOADED, 429, "3"), (UNAVAILABLE, 503, "5")])
@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_http_refusals_set_retry_after(fake_gateway, error, status, seconds, path, body, stream):
    reply = http_of(fake_gateway, error=error).post(path, json={**body, "stream": stream})
    assert reply.status_code == status, reply.text
    assert reply.headers["retry-after"] == seconds
    assert reply.json()["error"]["retry_after"] == int(seconds)


def test_serves_own_back_pressure_is_429_with_retry_after(fake_gateway):
    reply = http_of(fake_gateway, error=BackPressureError(num_queued_requests=9, max_queued_requests=8)).post(
        "/v1/completions", json=COMPLETION
    )
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1", reply.text


def test_an_error_after_the_stream_started_says_retry_after_in_its_event(fake_gateway):
    http = http_of(fake_gateway, error=OVERLOADED, deltas=[(0, "a", None)], error_after_deltas=True)
    reply = http.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert reply.status_code == 200
    events = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    error = json.loads(events[-2])["error"]
    assert events[-1] == "[DONE]" and error["code"] == 429 and error["retry_after"] == 3


def test_other_errors_have_no_retry_after(fake_gateway):
    reply = http_of(fake_gateway).post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert reply.status_code == 400 and "retry-after" not in reply.headers
    assert "retry_after" not in reply.json()["error"]


async def test_grpc_refusals_carry_retry_after_trailing_metadata(fake_gateway):
    gateway, _ = fake_gateway(error=OVERLOADED)
    async with served(gateway) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(text="hi"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in call]
    error = info.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(error.trailing_metadata())["retry-after"] == "3"
    assert error.details().endswith("(retry after 3 s)")


class ProxyLike:
    """Ends each rpc as Serve's gRPC proxy does when a replica's rpc failed: the status set on
    the context, no exception, and none of the replica's trailing metadata."""

    def __init__(self, details: str) -> None:
        self.details = details

    async def Generate(self, request, context):  # noqa: N802
        context.set_code(grpc.StatusCode.UNAVAILABLE)
        context.set_details(self.details)
        return
        yield

    async def Tokenize(self, request, context):  # noqa: N802
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details(self.details)
        return b""


@pytest.mark.parametrize("details,expected", [("busy (retry after 7 s)", "7"), ("bad prompt", None)])
async def test_the_proxy_side_turns_the_details_delay_into_trailing_metadata(details, expected):
    errors = await _both_rpcs_fail(grpc.aio.server(), ProxyLike(details))
    assert [error.details() for error in errors] == [details, details]
    assert [dict(error.trailing_metadata()).get("retry-after") for error in errors] == [expected, expected]


def test_retry_after_is_whole_seconds_and_survives_pickling():
    assert status_of(OVERLOADED).retry_after_s == 3
    assert status_of(ServerOverloadedError("busy")).retry_after_s == 1
    copy = pickle.loads(pickle.dumps(ServerOverloadedError("busy", 2.5, reason="waiting_tokens")))
    assert (copy.retry_after_s, copy.reason, str(copy)) == (2.5, "waiting_tokens", "busy")
    assert status_of(copy).shed_reason == "waiting_tokens" and status_of(UNAVAILABLE).shed_reason == "no_replica"
    assert status_of(BackPressureError(num_queued_requests=9, max_queued_requests=8)).shed_reason == "queue"
    assert status_of(ValueError("x")).shed_reason is None
    assert retry_after_of(status_of(UNAVAILABLE).grpc_details) == 5
    assert retry_after_of(b"x (retry after 2 s)") == 2 and retry_after_of(None) is None


@pytest.mark.parametrize(
    "error", [asyncio.CancelledError(), GeneratorExit(), TaskCancelledError(), RequestCancelledError("req-1")]
)
def test_a_cancel_is_cancelled_and_no_server_error(error):
    status = status_of(error)
    assert status.grpc_code == grpc.StatusCode.CANCELLED and status.is_cancelled
    assert status.is_rejection and is_rejection(error)
    assert status.retry_after_s is None


async def _drain(stream):
    return [response async for response in stream]


async def test_serves_grpc_proxy_server_gets_the_delay_around_its_own_handlers():
    """Serve's proxy server swaps the registered handlers for its factory's (grpc_util's
    gRPCGenericServer): the delay is added around those."""
    from ray.serve._private.grpc_util import gRPCGenericServer

    def factory(service_method: str, streaming_type):
        proxy = ProxyLike("no replica (retry after 4 s)")
        return proxy.Generate if "STREAM" in streaming_type.name.split("_", 1)[1] else proxy.Tokenize

    errors = await _both_rpcs_fail(gRPCGenericServer(factory), ProxyLike("unused"))
    assert [dict(error.trailing_metadata()).get("retry-after") for error in errors] == ["4", "4"]


async def _both_rpcs_fail(server, servicer) -> list[grpc.aio.AioRpcError]:
    """Tokenize and Generate on `server` with `servicer` registered as Baton registers it."""
    add_inference_servicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    errors = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            for rpc in (stub.Tokenize(pb.TokenizeRequest(text="x")), _drain(stub.Generate(pb.GenerateRequest()))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await rpc
                errors.append(info.value)
    finally:
        await server.stop(None)
    return errors
