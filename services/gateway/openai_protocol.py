"""OpenAI-compatible request shapes (/v1/completions, /v1/chat/completions) and the helpers
that build response bodies; `openai_api` maps them onto the generation service.

Requests accept OpenAI's fields plus vLLM's common extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, allowed_token_ids,
prompt_logprobs on completions, ...), the output constraints of `openai_constraints` and
chat's forced tool calls (`tool_calls`). `logit_bias` maps token ids (JSON object keys, so
strings) to values in [-100, 100] added to the logits; `echo` and `best_of` are completions'
(`completion_choices`); chat messages' roles are OpenAI's five.
Fields Baton does not implement that would change the output are refused
(`openai_refused`); other unknown fields are ignored, as vLLM does.

Numbers: JSON has no Infinity or NaN (RFC 8259), yet Python's json module reads both, so a
body may carry them. Rather than refuse such a body as invalid JSON, every float field
refuses a non-finite value with a 400 naming it (`allow_inf_nan=False`), the same answer
SamplingParams gives gRPC and offline callers.

max_tokens: unset on completions means 16 (OpenAI's and vLLM's default); unset on chat
means up to the end of the context. A prompt plus max_tokens over the context is a 400
with both numbers (engine/api/prompt_checks.py), never a silently shorter completion.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.api.outputs import CompletionOutput
from ..engine.api.sampling_params import SamplingParams
from ..engine.errors import InvalidRequestError
from .generation import GenerationEvent, Usage
from .openai_constraints import ConstraintFields
from .openai_refused import CHAT_REFUSALS, COMPLETION_REFUSALS, refuse_unsupported
from .structured_output import Constraint
from .tool_calls import ChatTool, ForcedToolCall, forced_tool_call


class StreamOptions(BaseModel):
    include_usage: bool = True
    continuous_usage_stats: bool = False  # vLLM's usage on every chunk: refused


class _SamplingFields(ConstraintFields):
    # Extra fields are kept, so that those refused by name (openai_refused) can be seen.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

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
    user: str | None = None  # an end-user id for the caller's own tracking: changes nothing
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    request_id: str | None = None
    # vLLM's extension: each choice (each streamed chunk's choice) also carries its token ids,
    # so a client counts tokens exactly when a chunk holds several.
    return_token_ids: bool | None = None

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, constraint: Constraint | None, **extra: Any
    ) -> SamplingParams:
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
            "allowed_token_ids": self.allowed_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
            "structured_output": constraint.params if constraint else None,
            "logit_bias": _token_id_keys(self.logit_bias) if self.logit_bias else None,
            **extra,
        }
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        given = {k: v for k, v in fields.items() if v is not None}
        return SamplingParams(stop=stop, **{**given, "max_tokens": max_tokens})  # None: to the end of the context

    def _refuse_unsupported(self, refusals) -> None:
        refuse_unsupported(self.model_extra or {}, refusals)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequestError(
                "stream_options.continuous_usage_stats", "is not supported: usage comes in the last chunk"
            )


def _token_id_keys(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError("logit_bias", f"keys must be token ids (integers), got {key!r}") from None
    return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default; null: to the end of the context
    logprobs: int | None = None
    best_of: int | None = None  # >= n samples generated, the n best (cumulative logprob) returned
    echo: bool = False  # the prompt's text (and with logprobs its tokens') before the completion
    prompt_logprobs: int | None = None  # vLLM's: top-N logprobs of every prompt token
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. on a text prompt

    def check_supported(self) -> None:
        """400 for every field that asks for what Baton does not do (openai_refused)."""
        self._refuse_unsupported(COMPLETION_REFUSALS)
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError(
                "best_of", "cannot be combined with stream: the best samples are known only when all have finished"
            )

    def completion_params(self, constraint: Constraint | None) -> SamplingParams:
        # As vLLM: echo with logprobs scores the prompt's tokens with as many alternatives.
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs
        extra = {"best_of": self.best_of, "prompt_logprobs": prompt_logprobs}
        return self.sampling_params(self.max_tokens, self.logprobs, constraint, **extra)

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
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        """400 for every field that asks for what Baton does not do (openai_refused)."""
        self._refuse_unsupported(CHAT_REFUSALS)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")

    def forced_tool_call(self) -> ForcedToolCall | None:
        return forced_tool_call(self.tools, self.tool_choice, self.parallel_tool_calls)

    def tool_dicts(self, forced_call: ForcedToolCall | None) -> list[dict[str, Any]] | None:
        """The tools the chat template may describe to the model: those that can be called."""
        if forced_call is None:
            return None
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in forced_call.functions]

    def message_dicts(self) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}"
                )
            content = message.content
            if isinstance(content, list):  # content parts: only text is supported
                if any(part.get("type") != "text" for part in content):
                    raise InvalidRequestError("messages", "only text content parts are supported")
                content = "".join(part.get("text", "") for part in content)
            entry = {"role": message.role, "content": content or ""}
            # Earlier tool calls and their results, for templates that render them.
            entry.update({k: v for k, v in (message.model_extra or {}).items() if k in _TOOL_MESSAGE_FIELDS})
            out.append(entry)
        return out


_TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")
# OpenAI's roles ("function" is deprecated with functions, which are refused); a template
# that does not know "developer" gets it as "system" (generation.apply_chat_template).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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


def chat_logprobs(
    completion: CompletionOutput, num_top: int, token_bytes: Callable[[int], list[int]]
) -> dict[str, Any] | None:
    """`bytes` are each token's own (token_bytes), never those of its lone decoding."""
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
                "bytes": token_bytes(token_id),
                "top_logprobs": [
                    {"token": e.decoded_token or "", "logprob": e.logprob, "bytes": token_bytes(top_id)}
                    for top_id, e in ranked
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


def openai_finish_reason(reason: str | None, is_tool_call: bool = False) -> str | None:
    """OpenAI knows stop, length and tool_calls (a forced call whose grammar completed); an
    aborted request reports as stop."""
    if reason is None:
        return None
    if reason == "length":
        return "length"
    return "tool_calls" if is_tool_call and reason == "stop" else "stop"


def now() -> int:
    return int(time.time())
