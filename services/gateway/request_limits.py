"""What one request may weigh, checked before the gateway spends work on it, and how many
the gateway holds at once (`server.limits`, `RequestLimits`):

    in flight     generation requests a gateway replica holds over max_inflight_requests: 429 /
                  RESOURCE_EXHAUSTED with Retry-After, before the body is read (inflight_limit.py)

    HTTP body     a Content-Length over max_request_bytes: 413 before a byte is read; a body
                  without one (chunked) is counted as it arrives and refused at the chunk that
                  crosses the limit (`openai_body_limit.BodySizeLimit`, in front of every route)
    gRPC message  its encoded size over max_request_bytes: RESOURCE_EXHAUSTED (`check_message_size`)
    prompt text   over max_model_len x max_chars_per_token characters: 400 naming the field, before
                  any of it is tokenized (`check_text_length`). A token of a byte-level BPE covers a
                  few characters on average (about 4 in English, fewer in most other scripts), so
                  a text over the bound cannot fit the context; one under it is tokenized (off the
                  event loop) and then checked exactly, in tokens.

Tokenization and chat templates run on a pool of `tokenizer_threads` threads: Hugging Face's
Rust tokenizers release the GIL while they work, so the event loop keeps serving.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.errors import InvalidRequestError
from ..serving_errors import RequestTooLargeError

MiB = 1024 * 1024


class RequestLimits(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_request_bytes: int = Field(
        4 * MiB,
        ge=1024,
        description="Largest HTTP request body and gRPC request message, in bytes (413 / RESOURCE_EXHAUSTED)",
    )
    max_chars_per_token: int = Field(
        16,
        ge=1,
        description="A prompt over max_model_len x this many characters is refused before it is tokenized",
    )
    max_inflight_requests: int = Field(
        1000,
        ge=1,
        description="Generation requests one gateway replica holds at once; beyond, a new one gets 429 / "
        "RESOURCE_EXHAUSTED with Retry-After (keep it under gateway.max_ongoing_requests, so Serve's proxy never "
        "holds one back unseen)",
    )
    tokenizer_threads: int = Field(
        4, ge=1, le=64, description="Threads that tokenize and apply chat templates, off the gateway's event loop"
    )

    def max_prompt_chars(self, max_model_len: int) -> int:
        return max_model_len * self.max_chars_per_token


def check_message_size(num_bytes: int, max_bytes: int, what: str) -> None:
    if num_bytes > max_bytes:
        raise RequestTooLargeError(
            f"the {what} is {num_bytes} bytes, over the limit of {max_bytes} bytes (server.limits.max_request_bytes)"
        )


def check_text_length(num_chars: int, field: str, limits: RequestLimits, max_model_len: int) -> None:
    """Refuses text that cannot fit the context whatever its tokens, before tokenizing it."""
    bound = limits.max_prompt_chars(max_model_len)
    if num_chars > bound:
        raise InvalidRequestError(
            field,
            f"has {num_chars} characters, over the limit of {bound}: the context limit of {max_model_len} tokens x "
            f"{limits.max_chars_per_token} characters per token (server.limits.max_chars_per_token)",
        )


def num_chars(value: Any) -> int:
    """Characters in every string of a parsed body (messages, tools), keys included."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(key)) + num_chars(item) for key, item in value.items())
    if isinstance(value, list | tuple):
        return sum(num_chars(item) for item in value)
    return 0
