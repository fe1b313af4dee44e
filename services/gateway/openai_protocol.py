"""OpenAI-compatible request shapes (/v1/completions, /v1/chat/completions) and the helpers
that build response bodies; `openai_api` maps them onto the generation service.

Requests accept OpenAI's fields plus vLLM's common extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...). Unknown fields are
ignored, as OpenAI's own API does with fields it does not know.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.api.outputs import CompletionOutput
from ..engine.api.sampling_params import SamplingParams
from ..engine.errors import InvalidRequestError
from .generation import GenerationEvent, Usage


class StreamOptions(BaseModel):
    include_usage: bool = True


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    request_id: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        fields = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "n": self.n,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
        }
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(stop=stop, **{k: v for k, v in fields.items() if v is not None})


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        if not p:
            raise InvalidRequestError("prompt", "must not be empty")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for message in self.messages:
            content = message.content
            if isinstance(content, list):  # content parts: only text is supported
                if any(part.get("type") != "text" for part in content):
                    raise InvalidRequestError("messages", "only text content parts are supported")
                content = "".join(part.get("text", "") for part in content)
            out.append({"role": message.role, "content": content or ""})
        return out


def error_body(message: str, error_type: str, param: str | None, code: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def completion_logprobs(completion: CompletionOutput, text_offset: int) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entries in zip(completion.token_ids, completion.logprobs):
        chosen = entries[token_id]
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(chosen.logprob)
        top.append({e.decoded_token or "": e.logprob for _, e in sorted(entries.items(), key=lambda x: x[1].rank)})
        offsets.append(text_offset)
        text_offset += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(completion: CompletionOutput, num_top: int) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    content = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs):
        chosen = entries[token_id]
        ranked = sorted(entries.items(), key=lambda x: x[1].rank)[:num_top]
        content.append(
            {
                "token": chosen.decoded_token or "",
                "logprob": chosen.logprob,
                "bytes": list((chosen.decoded_token or "").encode()),
                "top_logprobs": [
                    {
                        "token": e.decoded_token or "",
                        "logprob": e.logprob,
                        "bytes": list((e.decoded_token or "").encode()),
                    }
                    for _, e in ranked
                ],
            }
        )
    return {"content": content}


class CompletionAccumulator:
    """Collects streamed events into one non-streaming response per choice."""

    def __init__(self, num_choices: int) -> None:
        self.texts = [""] * num_choices
        self.finish_reasons: list[str | None] = [None] * num_choices
        self.logprobs: list[list] = [[] for _ in range(num_choices)]
        self.token_ids: list[list[int]] = [[] for _ in range(num_choices)]

    def add(self, choice: int, event: GenerationEvent) -> None:
        completion = event.completion
        self.texts[choice] += completion.text
        self.token_ids[choice].extend(completion.token_ids)
        if completion.logprobs is not None:
            self.logprobs[choice].extend(completion.logprobs)
        if completion.finish_reason is not None:
            self.finish_reasons[choice] = completion.finish_reason

    def completion(self, choice: int, has_logprobs: bool) -> CompletionOutput:
        return CompletionOutput(
            choice,
            self.texts[choice],
            self.token_ids[choice],
            None,
            self.logprobs[choice] if has_logprobs else None,
            self.finish_reasons[choice],
        )


def openai_finish_reason(reason: str | None) -> str | None:
    """OpenAI knows stop and length; an aborted request reports as stop."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def now() -> int:
    return int(time.time())
