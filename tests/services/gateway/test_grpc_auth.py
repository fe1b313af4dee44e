"""API keys on the gRPC API and who may abort a request: UNAUTHENTICATED without a valid
`authorization` metadata, every configured key served, health open or protected by the flag,
Abort only by the request's own key or an admin key (anyone else gets `found: false`, as for
an id that does not exist, and the stream goes on), unguessable ids, and no key in a status
or a log line. No Ray: the gateway on an in-process grpc.aio server over a fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid

import grpc
import pytest
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.api_keys import MALFORMED_HEADER, MISSING_KEY, WRONG_KEY, ApiKeys
from baton.services.gateway.engine_client import EngineClient
from baton.services.gateway.gateway import Gateway
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from testlib.grpc_inprocess import served

KEY_A, KEY_B, ADMIN = "sk-grpc-alpha-1a2b3c4d5e6f", "sk-grpc-bravo-6f5e4d3c2b1a", "sk-grpc-admin-a1b2c3d4e5f6"
SECRETS = (KEY_A, KEY_B, ADMIN)
NUM_TOKENS = 3


class GatedEngine(EngineClient):
    """Streams NUM_TOKENS deltas, each once `step` is released: a request stays in flight for as
    long as a test wants. The rest is the conftest's fake engine client's."""

    def __init__(self, fake: EngineClient) -> None:
        self.fake = fake
        self.step = asyncio.Semaphore(0)
        self.started = asyncio.Event()

    async def stream(self, call, trace):
        self.started.set()
        for i in range(NUM_TOKENS):
            await self.step.acquire()
            completion = CompletionOutput(0, "x", [5], None, None, "length" if i == NUM_TOKENS - 1 else None)
            yield RequestOutput(call.request_id, None, call.prompt_token_ids, [completion], i == NUM_TOKENS - 1, 0)

    def resume(self, call, token_ids, trace):
        return self.fake.resume(call, token_ids, trace)

    async def model_info(self):
        return await self.fake.model_info()

    async def is_healthy(self):
        return True

    @property
    def roles(self):
        return ["colocated"]


def metadata(key: str | None = None, authorization: str | None = None) -> tuple:
    value = authorization if authorization is not None else (f"Bearer {key}" if key else None)
    return (("application", "baton"),) + ((("authorization", value),) if value is not None else ())


@pytest.fixture
def make_gateway(fake_gateway, tokenizer_dir):
    def make(api_keys: ApiKeys, gated: bool = False) -> Gateway:
        _, fake = fake_gateway()
        engine = GatedEngine(fake) if gated else fake
        return Gateway(engine, tokenizer_dir, api_keys=api_keys)

    return make


@pytest.fixture
def keys() -> ApiKeys:
    return ApiKeys([KEY_A, KEY_B], [ADMIN])


def generate(stub, key: str | None = None, request_id: str = "", authorization: str | None = None):
    request = pb.GenerateRequest(text="hi", request_id=request_id, sampling=pb.SamplingParameters(max_tokens=2))
    return stub.Generate(request, metadata=metadata(key, authorization), timeout=10)


@pytest.mark.parametrize(
    ("key", "authorization", "message"),
    [
        (None, None, MISSING_KEY),
        ("sk-wrong", None, WRONG_KEY),
        (None, KEY_A, MALFORMED_HEADER),
        (None, f"Basic {KEY_A}", MALFORMED_HEADER),
    ],
    ids=["missing", "wrong", "no-scheme", "basic"],
)
async def test_no_valid_key_is_unauthenticated_on_every_rpc(make_gateway, keys, key, authorization, message):
    gateway = make_gateway(keys)
    async with served(gateway) as channel:
        stub = pb_grpc.InferenceStub(channel)
        calls = [
            lambda md: _drain(generate(stub, key, authorization=authorization)),
            lambda md: stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=md, timeout=10),
            lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10),
            lambda md: stub.Abort(pb.AbortRequest(request_id="r"), metadata=md, timeout=10),
        ]
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(metadata(key, authorization))
            assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    assert gateway.engine_client.calls == []


@pytest.mark.parametrize("key", SECRETS, ids=["first", "second", "admin"])
async def test_each_configured_key_is_served(make_gateway, keys, key):
    async with served(make_gateway(keys)) as channel:
        stub = pb_grpc.InferenceStub(channel)
        responses = await _drain(generate(stub, key))
        assert responses[-1].text == "ok" and responses[-1].finish_reason == "length"
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata(key), timeout=10)
        assert info.model == "tiny"
        tokens = await stub.Tokenize(pb.TokenizeRequest(text="hi"), metadata=metadata(key), timeout=10)
        assert tokens.count > 0


async def test_health_is_open_by_default_and_protected_by_the_flag(make_gateway):
    serving = health_pb2.HealthCheckResponse.SERVING
    async with served(make_gateway(ApiKeys([KEY_A]))) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=10)).status == serving
    async with served(make_gateway(ApiKeys([KEY_A], protect_health=True))) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for md in (metadata(), metadata("sk-wrong")):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(), metadata=md, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _drain(health.Watch(health_pb2.HealthCheckRequest(), metadata=md, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        checked = await health.Check(health_pb2.HealthCheckRequest(), metadata=metadata(KEY_A), timeout=10)
        assert checked.status == serving


async def test_without_keys_every_rpc_is_open_as_before(make_gateway):
    async with served(make_gateway(ApiKeys())) as channel:
        stub = pb_grpc.InferenceStub(channel)
        assert (await _drain(generate(stub)))[-1].finish_reason == "length"
        assert (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).model == "tiny"


@contextlib.asynccontextmanager
async def in_flight(gateway: Gateway, key: str, request_id: str):
    """A stub to the (gated) gateway, and `key`'s Generate running with its first token out;
    yields (stub, the stream's responses to await)."""
    async with served(gateway) as channel:
        stub = pb_grpc.InferenceStub(channel)
        stream = asyncio.ensure_future(_drain(generate(stub, key, request_id=request_id)))
        await asyncio.wait_for(gateway.engine_client.started.wait(), 10)
        gateway.engine_client.step.release()
        yield stub, stream


async def test_another_keys_abort_is_refused_as_an_unknown_id_and_the_stream_goes_on(make_gateway, keys, caplog):
    gateway = make_gateway(keys, gated=True)
    async with in_flight(gateway, KEY_A, "victim-1") as (stub, victim):
        with caplog.at_level(logging.DEBUG):
            other = await _abort(stub, KEY_B, "victim-1")
            unknown = await _abort(stub, KEY_B, "no-such-request")
        assert other == unknown == pb.AbortResponse(found=False)  # nothing tells the two apart
        for _ in range(NUM_TOKENS - 1):
            gateway.engine_client.step.release()
        responses = await asyncio.wait_for(victim, 10)
    assert [r.text for r in responses] == ["x"] * NUM_TOKENS
    assert responses[-1].finish_reason == "length"
    assert not any("aborted" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("aborter", [KEY_A, ADMIN], ids=["owner", "admin"])
async def test_the_owner_or_an_admin_key_aborts(make_gateway, keys, aborter, caplog):
    gateway = make_gateway(keys, gated=True)
    async with in_flight(gateway, KEY_A, "mine-1") as (stub, victim):
        with caplog.at_level(logging.INFO):
            assert await _abort(stub, aborter, "mine-1") == pb.AbortResponse(found=True)
        responses = await asyncio.wait_for(victim, 10)
    assert responses[-1].finish_reason == "abort"
    who = gateway.api_keys.authenticate(f"Bearer {aborter}")
    (line,) = [r.getMessage() for r in caplog.records if "aborted by" in r.getMessage()]
    assert line == f"request mine-1 aborted by {'admin ' if who.is_admin else ''}{who.owner}"
    assert not any(secret in line for secret in SECRETS)


async def test_generated_request_ids_are_random_uuid4s(make_gateway, keys):
    async with served(make_gateway(keys)) as channel:
        stub = pb_grpc.InferenceStub(channel)
        ids = {(await _drain(generate(stub, KEY_A)))[0].request_id for _ in range(3)}
    assert len(ids) == 3
    for request_id in ids:
        assert re.fullmatch(r"req-[0-9a-f]{32}", request_id)
        assert uuid.UUID(hex=request_id[4:]).version == 4


async def test_no_key_reaches_a_status_or_a_log_line(make_gateway, keys, caplog):
    async with served(make_gateway(keys)) as channel:
        stub = pb_grpc.InferenceStub(channel)
        details = []
        with caplog.at_level(logging.DEBUG):
            for authorization in ("Bearer sk-guessed-9876", f"Token {KEY_A}", f"{ADMIN}"):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _drain(generate(stub, authorization=authorization))
                details.append(info.value.details())
            await _drain(generate(stub, KEY_B))
    assert details == [WRONG_KEY, MALFORMED_HEADER, MALFORMED_HEADER]
    logged = "\n".join(f"{r.getMessage()} {r.args} {r.exc_text or ''}" for r in caplog.records)
    assert "UNAUTHENTICATED" in logged
    assert not any(secret in logged for secret in (*SECRETS, "sk-guessed-9876"))


async def _drain(call) -> list:
    return [response async for response in call]


async def _abort(stub, key: str, request_id: str) -> pb.AbortResponse:
    return await stub.Abort(pb.AbortRequest(request_id=request_id), metadata=metadata(key), timeout=10)
