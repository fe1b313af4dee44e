"""Both backends against stand-in servers: an in-process gRPC servicer and an httpx mock
transport. Stream timing and counting, usage, errors, and the pre-load probe."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import httpx
import pytest
from baton.services.loadtest.backends import make_backend
from baton.services.loadtest.backends.base import BenchRequest
from baton.services.loadtest.backends.grpc import GrpcBackend
from baton.services.loadtest.backends.openai_http import OpenAIHttpBackend, normalize_base_url
from baton.services.loadtest.errors import BenchInputError
from loadtest_helpers import with_grpc_server

# -- gRPC ------------------------------------------------------------------------------------


def test_grpc_probe_send_and_count():
    async def test(address):
        backend = GrpcBackend(address, connect_timeout_s=5)
        info = await backend.probe(None)
        assert (info.model, info.max_context_length, info.vocab_size) == ("tiny", 256, 1000)
        assert info.details["block_size"] == 16
        response = await backend.send(BenchRequest(4, prompt_token_ids=[1, 2, 3]))
        assert response.error is None
        assert response.chunk_num_tokens == [1, 2, 1] and response.num_output_tokens == 4
        times = response.chunk_times_s
        assert times == sorted(times) and times[1] - times[0] >= 0.009 and response.end_s >= times[-1]
        assert response.output_token_ids == [5, 6, 7, 8] and response.output_text == "abcd"
        assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.cached_tokens) == (
            3,
            4,
            16,
        )
        assert (response.server_ttft_s, response.kv_path, response.finish_reason) == (0.005, "colocated", "length")
        assert await backend.count_tokens(["one two", "three"], True) == [3, 2]
        assert await backend.count_tokens(["one two"], False) == [2]
        failed = await backend.send(BenchRequest(99, prompt_text="x"))
        assert failed.error == "RESOURCE_EXHAUSTED: too many requests" and not failed.chunk_times_s
        with pytest.raises(BenchInputError, match="serves model 'tiny', not 'big'"):
            await backend.probe("big")
        await backend.close()

    with_grpc_server(test)


def test_grpc_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a free port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def test():
        backend = GrpcBackend(f"127.0.0.1:{port}", connect_timeout_s=0.5)
        with pytest.raises(BenchInputError, match=f"cannot reach the Baton gRPC server at 127.0.0.1:{port}"):
            await backend.probe(None)
        await backend.close()

    asyncio.run(test())


def test_grpc_server_without_the_baton_service():
    async def main():
        server = grpc.aio.server()  # serves nothing
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        backend = GrpcBackend(f"127.0.0.1:{port}", connect_timeout_s=2)
        try:
            with pytest.raises(BenchInputError, match="UNIMPLEMENTED.*--application"):
                await backend.probe(None)
        finally:
            await backend.close()
            await server.stop(None)

    asyncio.run(main())


def test_unknown_backend():
    with pytest.raises(BenchInputError, match="unknown backend 'carrier-pigeon'"):
        make_backend("carrier-pigeon", "x")


# -- OpenAI HTTP ------------------------------------------------------------------------------


def sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events)


def models(*ids, max_len=256):
    return {"object": "list", "data": [{"id": i, "object": "model", "max_model_len": max_len} for i in ids]}


def usage(prompt, completion, cached=None):
    body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"choices": [], "usage": body}


def http_backend(stream: bytes | None = None, status: int = 200, endpoint="completions", model_list=None, seen=None):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=model_list or models("tiny"))
        if seen is not None:
            seen.append((request.url.path, json.loads(request.content)))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "prompt: too long", "code": status}})
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    return OpenAIHttpBackend("http://server:8000", endpoint=endpoint, transport=httpx.MockTransport(handler))


def text_chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def chat_chunk(content, role=False, finish=None):
    delta = {"content": content, **({"role": "assistant"} if role else {})}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_completions_stream_counting_and_usage():
    seen = []
    # an empty-text chunk is a token that ended mid-character: it counts
    stream = sse(text_chunk("He"), text_chunk(""), text_chunk("llo", "length"), usage(3, 3, 2), "[DONE]")
    backend = http_backend(stream, seen=seen)

    async def test():
        info = await backend.probe(None)
        assert (info.model, info.max_context_length, info.vocab_size) == ("tiny", 256, None)
        response = await backend.send(BenchRequest(3, prompt_token_ids=[1, 2, 3]))
        await backend.close()
        return response

    response = asyncio.run(test())
    assert response.error is None
    assert response.chunk_num_tokens == [1, 1, 1] and response.output_text == "Hello"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.cached_tokens) == (3, 3, 2)
    assert response.finish_reason == "length" and response.output_token_ids is None  # no tokenizer
    path, body = seen[0]
    assert path == "/v1/completions"
    assert body["prompt"] == [1, 2, 3] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["model"] == "tiny" and body["ignore_eos"] is True and body["max_tokens"] == 3


@pytest.mark.parametrize(
    "first, expected_tokens",
    [
        (chat_chunk("", role=True), 2),  # vLLM: a role-only chunk before any token (usage says 2)
        (chat_chunk("", role=True), 3),  # Baton: the role rides on a first token with no text yet (usage says 3)
    ],
)
def test_chat_role_chunk_counts_only_when_it_was_a_token(first, expected_tokens):
    stream = sse(first, chat_chunk("Hi"), chat_chunk("!", finish="length"), usage(5, expected_tokens), "[DONE]")
    backend = http_backend(stream, endpoint="chat")

    async def test():
        await backend.probe("tiny")
        response = await backend.send(BenchRequest(expected_tokens, prompt_text="hello"))
        await backend.close()
        return response

    response = asyncio.run(test())
    assert response.num_output_tokens == expected_tokens == len(response.chunk_times_s)
    assert response.output_text == "Hi!"


def test_http_errors_are_recorded():
    backend = http_backend(status=400)

    async def test():
        await backend.probe(None)
        response = await backend.send(BenchRequest(3, prompt_text="x"))
        await backend.close()
        return response

    response = asyncio.run(test())
    assert response.error == "HTTP 400: prompt: too long"


def test_stream_without_output_is_a_failure():
    backend = http_backend(sse(usage(3, 0), "[DONE]"))

    async def test():
        await backend.probe(None)
        return await backend.send(BenchRequest(3, prompt_text="x"))

    assert asyncio.run(test()).error == "the stream ended without output"


def test_http_probe_errors():
    async def probe(backend, model=None):
        try:
            return await backend.probe(model)
        finally:
            await backend.close()

    with pytest.raises(BenchInputError, match=r"serves \['a', 'b'\], not 'c'"):
        asyncio.run(probe(http_backend(model_list=models("a", "b")), "c"))
    assert asyncio.run(probe(http_backend(model_list=models("a", "b")), "b")).model == "b"
    with pytest.raises(BenchInputError, match="lists no models"):
        asyncio.run(probe(http_backend(model_list={"data": []})))

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    unreachable = OpenAIHttpBackend("127.0.0.1:1", transport=httpx.MockTransport(refuse))
    with pytest.raises(BenchInputError, match="cannot reach the OpenAI-compatible server at http://127.0.0.1:1/v1"):
        asyncio.run(probe(unreachable))
    not_openai = OpenAIHttpBackend(
        "http://x", transport=httpx.MockTransport(lambda r: httpx.Response(200, text="<html>"))
    )
    with pytest.raises(BenchInputError, match="did not return an OpenAI model list"):
        asyncio.run(probe(not_openai))


def test_chat_needs_text_prompts():
    backend = http_backend(endpoint="chat")
    with pytest.raises(BenchInputError, match="chat endpoint takes text"):
        backend.check_prompts(uses_token_ids=True)
    backend.check_prompts(uses_token_ids=False)
    with pytest.raises(BenchInputError, match="unknown endpoint"):
        OpenAIHttpBackend("x", endpoint="embeddings")


def test_base_urls():
    assert normalize_base_url("127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert normalize_base_url("http://h:1/") == "http://h:1/v1"
    assert normalize_base_url("https://h/v1") == "https://h/v1"
