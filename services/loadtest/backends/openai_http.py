"""Any OpenAI-compatible HTTP server as a benchmark backend (Baton's, vLLM's, SGLang's ...).

Requests stream (`"stream": true`) over server-sent events, asking for usage on the last
event (`stream_options.include_usage`). Two endpoints:

    completions  POST /v1/completions; the prompt is a list of token ids when the workload
                 has them (exact lengths), else text
    chat         POST /v1/chat/completions; the prompt is one user message, so it must be
                 text (token-id workloads need --tokenizer to be decoded)

Client-side token counting over HTTP: requests ask for `return_token_ids` (vLLM's
extension, which Baton serves too), and a chunk whose choice carries `token_ids` counts
that many tokens, so chunks holding several tokens (speculative decoding, a stream
interval, a backlog merged) count exactly. From a server that ignores the field each chunk
with a choice counts as one token, even when its text is empty (a token that ends
mid-character has no text yet); chat's opening chunk with the role and empty content counts
only if the usage shows it was a token. Then a server that sends several tokens per chunk
makes the count differ from its usage: the token check in the result reports how many
requests differ, and TPOT uses the server's count. Reply token ids (multi-turn) come from
re-tokenizing the reply with --tokenizer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ...client_tls import ClientTLS
from ..errors import BenchInputError
from ..records import Response, Usage
from .base import Backend, BenchRequest, SamplingOptions, ServerInfo, unreachable

Endpoint = Literal["completions", "chat"]


def normalize_base_url(address: str) -> str:
    """`host:port`, `http://host:port` or `http://host:port/v1` -> `http://host:port/v1`."""
    url = address.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url if url.endswith("/v1") else f"{url}/v1"


class OpenAIHttpBackend(Backend):
    kind = "openai"

    def __init__(
        self,
        address: str,
        sampling: SamplingOptions | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        tokenizer: Any = None,
        endpoint: Endpoint = "completions",
        api_key: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: an httpx.MockTransport
        tls: ClientTLS | None = None,
    ) -> None:
        super().__init__(address, sampling or SamplingOptions(), timeout_s, connect_timeout_s, tokenizer)
        if endpoint not in ("completions", "chat"):
            raise BenchInputError(f"unknown endpoint {endpoint!r}: expected completions or chat")
        self.endpoint = endpoint
        self.base_url = normalize_base_url(address)
        self.model = ""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024),
            transport=transport,
            verify=tls.ssl_context() if tls is not None else True,
        )

    async def probe(self, model: str | None) -> ServerInfo:
        url = f"{self.base_url}/models"
        try:
            reply = await self._client.get(url, timeout=self.connect_timeout_s)
        except httpx.HTTPError as e:
            raise unreachable(
                "OpenAI-compatible", self.base_url, f"{type(e).__name__}: {e}", "Is the server running on this address?"
            ) from e
        if reply.status_code != 200:
            raise BenchInputError(f"GET {url} answered HTTP {reply.status_code}: {reply.text[:300]}")
        try:
            cards = [card for card in reply.json()["data"] if isinstance(card.get("id"), str)]
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BenchInputError(f"GET {url} did not return an OpenAI model list: {reply.text[:300]}") from e
        ids = [card["id"] for card in cards]
        if not ids:
            raise BenchInputError(f"the server at {self.base_url} lists no models")
        if model is not None and model not in ids:
            raise BenchInputError(f"the server at {self.base_url} serves {ids}, not {model!r}")
        chosen = model or ids[0]
        card = cards[ids.index(chosen)]
        self.model = chosen
        max_len = card.get("max_model_len")
        vocab = len(self.tokenizer) if self.tokenizer is not None else None
        return ServerInfo(chosen, max_len if isinstance(max_len, int) else None, vocab, {"models": ids})

    def check_prompts(self, uses_token_ids: bool) -> None:
        if self.endpoint == "chat" and uses_token_ids and self.tokenizer is None:
            raise BenchInputError(
                "the chat endpoint takes text, and this workload makes token-id prompts: use --endpoint completions, "
                "a ShareGPT dataset, or give --tokenizer DIR to decode the prompts"
            )

    def _body(self, request: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": self.sampling.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.sampling.ignore_eos:
            body["ignore_eos"] = True
        if self.endpoint == "completions":
            body["prompt"] = request.prompt_token_ids if request.prompt_token_ids is not None else request.prompt_text
        else:
            text = request.prompt_text
            if text is None:
                text = self.tokenizer.decode(request.prompt_token_ids)
            body["messages"] = [{"role": "user", "content": text}]
        return body

    async def send(self, request: BenchRequest) -> Response:
        url = f"{self.base_url}/{'completions' if self.endpoint == 'completions' else 'chat/completions'}"
        body = self._body(request)
        stream = _Stream()
        response = Response(sent_at=time.perf_counter())
        try:
            async with self._client.stream("POST", url, json=body) as reply:
                if reply.status_code != 200:
                    response.error = f"HTTP {reply.status_code}: {_error_message((await reply.aread()).decode())}"
                else:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        self._read_chunk(json.loads(data), response, stream)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            response.error = f"{type(e).__name__}: {e}"
        response.end_s = time.perf_counter() - response.sent_at
        _count_role_chunk_if_token(response, stream)
        if response.error is None and not response.chunk_times_s:
            response.error = "the stream ended without output"
        response.output_text = "".join(stream.texts)
        response.output_token_ids = self.reply_token_ids(response.output_text)
        return response

    def _read_chunk(self, chunk: dict[str, Any], response: Response, stream: _Stream) -> None:
        if "error" in chunk:
            response.error = _error_message(json.dumps(chunk))
            return
        now = time.perf_counter() - response.sent_at
        for choice in chunk.get("choices") or []:
            text = self._new_text(choice)
            token_ids = choice.get("token_ids")
            num_tokens = len(token_ids) if isinstance(token_ids, list) else (1 if text is not None else 0)
            if text is not None:
                stream.texts.append(text)
            if num_tokens:
                response.chunk_times_s.append(now)
                response.chunk_num_tokens.append(num_tokens)
            elif isinstance(token_ids, list):
                pass  # the server says this chunk holds no token (chat's role chunk)
            elif self.endpoint == "chat" and "role" in (choice.get("delta") or {}) and not response.chunk_times_s:
                stream.role_chunk_s = now
            if choice.get("finish_reason"):
                response.finish_reason = choice["finish_reason"]
        usage = chunk.get("usage")
        if usage:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            response.usage = Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), cached)

    def _new_text(self, choice: dict[str, Any]) -> str | None:
        """The choice's new text, or None when the chunk carries no output token.

        A streaming server sends one chunk per decoding step, whose text may be empty (a
        token that ends mid-character); those count. Chat's opening chunk with the role and
        empty content does not, unless the usage shows it was a token (see below).
        """
        if self.endpoint == "completions":
            text = choice.get("text")
            return text if isinstance(text, str) else None
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if not isinstance(text, str) or (text == "" and "role" in delta):
            return None
        return text

    async def close(self) -> None:
        await self._client.aclose()


@dataclass(slots=True)
class _Stream:
    texts: list[str] = field(default_factory=list)
    role_chunk_s: float | None = None  # arrival of chat's opening role chunk with empty content


def _count_role_chunk_if_token(response: Response, stream: _Stream) -> None:
    """Chat's first chunk carries the role; with empty content it is either a role-only
    chunk (vLLM sends one before any token) or a first token that ends mid-character
    (Baton puts the role on its first token). The usage tells them apart: if the server
    counted one token more than the client, the role chunk was that token."""
    usage = response.usage
    if stream.role_chunk_s is None or usage is None:
        return
    if usage.completion_tokens == response.num_output_tokens + 1:
        response.chunk_times_s.insert(0, stream.role_chunk_s)
        response.chunk_num_tokens.insert(0, 1)
        stream.texts.insert(0, "")


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]
