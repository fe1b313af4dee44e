"""A client that cancels mid-stream (or whose deadline passes) ends its request as cancelled:
the downstream stream is closed, and the gateway records `cancelled`, not a server error (it
once recorded error:INTERNAL: closing a stream whose pending read was cancelled with it raised).
No Ray: the real gateway, gRPC through an in-process server, HTTP through the FastAPI app."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc
from testlib.grpc_inprocess import served

from .conftest import FakeEngineClient

GATEWAY_LOGGER = "baton.services.gateway.gateway"


class Endless(FakeEngineClient):
    """One delta, then nothing until cancelled; says when its stream was closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = asyncio.Event()

    async def stream(self, call, trace):
        try:
            completion = CompletionOutput(0, "a", [5], None, None, None)
            yield RequestOutput(call.request_id, None, call.prompt_token_ids, [completion], False, 0)
            await asyncio.Event().wait()
        finally:
            self.closed.set()


@pytest.fixture
def endless_gateway(tokenizer_dir):
    from baton.services.gateway.gateway import Gateway

    engine_client = Endless()
    return Gateway(engine_client, tokenizer_dir), engine_client


def _outcomes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == GATEWAY_LOGGER]


@pytest.mark.parametrize("how", ["cancel", "deadline"])
async def test_a_grpc_stream_the_client_leaves_is_cancelled(endless_gateway, caplog, how):
    gateway, engine_client = endless_gateway
    caplog.set_level(logging.INFO, logger=GATEWAY_LOGGER)
    async with served(gateway) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(pb.GenerateRequest(text="hi"), timeout=None if how == "cancel" else 0.5)
        assert (await call.read()).text == "a"
        if how == "cancel":
            call.cancel()
        else:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call.read()
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(engine_client.closed.wait(), 5)
    assert _outcomes(caplog) == ["grpc request cancelled"]
    assert gateway.service._inflight == {}


async def test_an_http_stream_whose_task_is_cancelled_is_cancelled(endless_gateway, caplog):
    """As Serve's replica ends a request whose client went away: the route's task is cancelled."""
    gateway, engine_client = endless_gateway
    caplog.set_level(logging.INFO, logger=GATEWAY_LOGGER)
    from baton.services.gateway.openai_protocol import CompletionRequest

    response = await gateway.openai.completions(CompletionRequest(prompt="hi", max_tokens=5, stream=True))
    chunks = response.body_iterator

    async def read_all():
        async for _ in chunks:
            pass

    reader = asyncio.ensure_future(read_all())
    await asyncio.sleep(0.1)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await asyncio.wait_for(engine_client.closed.wait(), 5)
    assert _outcomes(caplog) == ["http request cancelled"]
