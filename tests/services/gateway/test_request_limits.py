"""Request size and prompt length bounds (request_limits, openai_body_limit), and tokenizing
off the event loop: a body or message over the limit gets a clear error naming it, text that
cannot fit the context is refused untokenized, and a slow (allowed) tokenization leaves
concurrent small requests on time. No Ray: the real gateway and tokenizer over a fake engine
client, gRPC through an in-process server registered as Serve's proxy registers it."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import threading
import time

import grpc
import httpx
import pytest
from baton.services.engine.errors import InvalidRequestError
from baton.services.gateway.openai_api import build_http_app
from baton.services.gateway.request_limits import RequestLimits, check_text_length, num_chars
from baton.services.worker_calls import WorkerModelInfo
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc
from fastapi.testclient import TestClient
from ray.serve._private.constants import DEFAULT_GRPC_SERVER_OPTIONS
from testlib import grpc_inprocess

from .conftest import FAKE_MODEL_INFO

TEN_MB = 10 * 1024 * 1024
LIMIT = 1024 * 1024  # a small limit keeps the unit tests quick; the e2e tests use the default
LONG_CONTEXT = WorkerModelInfo("tiny", 100_000, 16, 1, 1024, "colocated", "w@0")


def test_defaults_are_sensible():
    limits = RequestLimits()
    assert 4 * 2**20 <= limits.max_request_bytes <= 16 * 2**20
    assert limits.max_prompt_chars(32768) == 32768 * limits.max_chars_per_token


def test_text_over_the_bound_names_the_field_and_the_limit():
    limits = RequestLimits(max_chars_per_token=4)
    check_text_length(400, "prompt", limits, 100)
    with pytest.raises(InvalidRequestError) as info:
        check_text_length(401, "prompt", limits, 100)
    assert info.value.field == "prompt"
    assert "401 characters, over the limit of 400" in str(info.value)
    assert "server.limits.max_chars_per_token" in str(info.value)


def test_num_chars_counts_every_string_of_messages():
    messages = [{"role": "user", "content": [{"type": "text", "text": "abc"}]}, {"role": "user", "content": "hi"}]
    assert num_chars(messages) == sum(len(s) for s in ("role", "user", "content", "type", "text", "text", "abc")) + (
        len("role") + len("user") + len("content") + len("hi")
    )


# -- HTTP ---------------------------------------------------------------------------------


@pytest.fixture
def http(fake_gateway):
    gateway, _ = fake_gateway(limits=RequestLimits(max_request_bytes=LIMIT))
    return TestClient(build_http_app(gateway.openai), raise_server_exceptions=False)


def _error_413(reply) -> str:
    assert reply.status_code == 413, reply.text
    error = reply.json()["error"]
    assert error["code"] == 413 and error["type"] == "invalid_request_error"
    assert f"limit of {LIMIT} bytes" in error["message"] and "server.limits.max_request_bytes" in error["message"]
    return error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_over_the_limit_is_413_from_its_content_length(http, path):
    body = b'{"prompt": "' + b"x" * TEN_MB + b'"}'
    message = _error_413(http.post(path, content=body, headers={"content-type": "application/json"}))
    assert f"is {len(body)} bytes" in message


def test_a_streamed_body_without_length_is_counted(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (LIMIT // 4)
        yield b'"}'

    reply = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in reply.request.headers  # chunked
    assert "over the limit" in _error_413(reply)


def test_a_body_under_the_limit_is_served(http):
    reply = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert reply.status_code == 200, reply.text


def test_a_prompt_over_the_character_bound_is_400_before_tokenizing(http):
    bound = RequestLimits().max_prompt_chars(FAKE_MODEL_INFO.max_model_len)
    reply = http.post("/v1/completions", json={"prompt": "y" * (bound + 1)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "prompt" and f"over the limit of {bound}" in error["message"]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "y" * (bound + 1)}]})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text


# -- gRPC ---------------------------------------------------------------------------------


async def test_a_grpc_message_over_the_limit_is_resource_exhausted_naming_it(fake_gateway):
    gateway, engine_client = fake_gateway(limits=RequestLimits(max_request_bytes=LIMIT))
    huge = "z" * TEN_MB
    async with serving(gateway) as address, grpc.aio.insecure_channel(address, options=_LARGE) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for rpc in (stub.Tokenize(pb.TokenizeRequest(text=huge)), _drain(stub.Generate(pb.GenerateRequest(text=huge)))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await rpc
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"over the limit of {LIMIT} bytes (server.limits.max_request_bytes)" in info.value.details()
        assert (await stub.Tokenize(pb.TokenizeRequest(text="hello"))).count > 0
    assert engine_client.calls == []


async def test_grpc_text_over_the_character_bound_is_invalid_argument(fake_gateway):
    gateway, _ = fake_gateway()
    bound = RequestLimits().max_prompt_chars(FAKE_MODEL_INFO.max_model_len)
    async with serving(gateway) as address, grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Tokenize(pb.TokenizeRequest(text="q" * (bound + 1)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("text: has") and f"over the limit of {bound}" in info.value.details()


async def test_a_slow_tokenization_does_not_block_small_requests(fake_gateway):
    """A long prompt the bound allows (about a second of tokenizing) runs on the tokenizer
    pool: small Tokenize calls sent meanwhile take about as long as without it."""
    gateway, _ = fake_gateway(model_info=LONG_CONTEXT)
    long_text = "the quick brown fox jumps over the lazy dog. " * 20_000  # 900k characters
    assert len(long_text) <= gateway.limits.max_prompt_chars(LONG_CONTEXT.max_model_len)
    async with serving(gateway) as address:
        baseline = await asyncio.to_thread(_small_latencies, address, 30)
        big = asyncio.create_task(asyncio.to_thread(_tokenize_once, address, long_text))
        await asyncio.sleep(0.05)  # the long one is in the pool
        during = await asyncio.to_thread(_small_latencies, address, 0, big)
        big_s, count = await big
    assert count > 100_000 and len(during) >= 5, (count, len(during))
    _report("slow tokenization (gRPC Tokenize, in-process)", baseline, during, big_s)
    assert statistics.median(during) - statistics.median(baseline) < 0.03
    # Tokenized on the event loop, a small request sent meanwhile would wait for most of it.
    assert max(during) < max(max(baseline) + 0.1, big_s / 4)


async def test_a_slow_chat_template_over_http_does_not_block_small_requests(fake_gateway):
    """The same through HTTP chat on a real socket (uvicorn, as Serve's proxy runs the app):
    a long conversation, templated and tokenized on the pool, leaves small chat requests
    sent meanwhile about as fast as alone."""
    gateway, _ = fake_gateway(model_info=VERY_LONG_CONTEXT)
    long_text = "the quick brown fox jumps over the lazy dog. " * 20_000  # 900k characters
    long_chat = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2}
    with http_serving(build_http_app(gateway.openai)) as address:
        baseline = await asyncio.to_thread(_small_chat_latencies, address, 30)
        big = asyncio.create_task(asyncio.to_thread(_post_once, address, long_chat))
        await asyncio.sleep(0.05)  # the long one is in the pool
        during = await asyncio.to_thread(_small_chat_latencies, address, 0, big)
        big_s, status = await big
    assert status == 200 and len(during) >= 5, (status, len(during))
    _report("slow tokenization (HTTP chat: template + tokenizer, 900k characters)", baseline, during, big_s)
    assert big_s > 0.2  # the long one is slow enough to hold the loop if it ran there
    assert statistics.median(during) - statistics.median(baseline) < 0.03
    assert max(during) < max(max(baseline) + 0.1, big_s / 4)


# -- helpers --------------------------------------------------------------------------------

VERY_LONG_CONTEXT = WorkerModelInfo("tiny", 1_000_000, 16, 1, 1024, "colocated", "w@0")


@contextlib.contextmanager
def http_serving(app):
    """`app` on uvicorn on a free loopback port, in a thread of its own; yields its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _post_once(address: str, body: dict) -> tuple[float, int]:
    start = time.monotonic()
    status = httpx.post(f"{address}/v1/chat/completions", json=body, timeout=60).status_code
    return time.monotonic() - start, status


def _small_chat_latencies(address: str, count: int, until: asyncio.Future | None = None) -> list[float]:
    """Latencies of small chat requests: `count` of them, or as many as fit before `until` is done."""
    latencies = []
    small = {"messages": [{"role": "user", "content": "a small request"}], "max_tokens": 2}
    with httpx.Client(base_url=address, timeout=10) as http:
        assert http.post("/v1/chat/completions", json=small).status_code == 200  # warm up
        while (len(latencies) < count) if until is None else not until.done():
            start = time.monotonic()
            assert http.post("/v1/chat/completions", json=small).status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.005)
    return latencies


def serving(servicer):
    """With the message limits of Serve's gRPC proxy (2 GiB): the gateway's own limit is the one met."""
    return grpc_inprocess.serving(servicer, DEFAULT_GRPC_SERVER_OPTIONS)


_LARGE = [("grpc.max_send_message_length", 64 * 2**20), ("grpc.max_receive_message_length", 64 * 2**20)]


async def _drain(stream):
    return [response async for response in stream]


def _tokenize_once(address: str, text: str) -> tuple[float, int]:
    with grpc.insecure_channel(address, options=_LARGE) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        start = time.monotonic()
        count = stub.Tokenize(pb.TokenizeRequest(text=text), timeout=60).count
        return time.monotonic() - start, count


def _small_latencies(address: str, count: int, until: asyncio.Future | None = None) -> list[float]:
    """Latencies of small Tokenize calls: `count` of them, or as many as fit before `until` is done."""
    latencies = []
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        stub.Tokenize(pb.TokenizeRequest(text="warm up"), timeout=10)
        while (len(latencies) < count) if until is None else not until.done():
            start = time.monotonic()
            stub.Tokenize(pb.TokenizeRequest(text="a small request"), timeout=10)
            latencies.append(time.monotonic() - start)
            time.sleep(0.005)
    return latencies


def _report(what: str, baseline: list[float], during: list[float], big_s: float) -> None:
    def ms(values):
        return f"p50 {statistics.median(values) * 1e3:.1f} ms, max {max(values) * 1e3:.1f} ms (n={len(values)})"

    print(f"\n{what}: small request alone {ms(baseline)}; beside the big one {ms(during)}; big one {big_s:.2f} s")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
async def test_the_pool_gives_the_ids_the_tokenizer_gives(arch):
    """The off-loop fast path (the Rust backend without offsets) and the chat template
    rendered, then encoded, agree with transformers' own calls."""
    from baton.services.engine.api.tokenizer import load_tokenizer
    from baton.services.gateway.generation import GenerationService
    from testlib.models import tiny_model

    from .conftest import FakeEngineClient

    tokenizer = load_tokenizer(tiny_model(arch))
    service = GenerationService(tokenizer, FakeEngineClient(model_info=LONG_CONTEXT))
    text = "Hello  world,\n\tthe <s> quick brown fox? " * 50
    for add_special in (True, False):
        assert await service.tokenize(text, add_special) == tokenizer.encode(text, add_special_tokens=add_special)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert await service.apply_chat_template(messages) == expected
