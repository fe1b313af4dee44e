"""The backend seam: how one benchmark request reaches a server and how its stream is timed.

A backend answers three questions before the load (`probe`: is the server there, which
model does it serve, how long may a request be; `count_tokens`: how long is this text) and
sends requests during it (`send`). `send` never raises for a failed request: the failure is
recorded in the `Response` (`error`), so one bad request does not stop the run.

Timing contract: `Response.sent_at` is `time.perf_counter()` taken just before the request
is handed to the transport; every other time is seconds after it. A chunk is timed when the
backend reads it, and counted only if it carries output (token ids over gRPC, non-empty
text over HTTP).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from ..errors import BenchInputError
from ..records import Response


@dataclass(frozen=True, slots=True)
class ServerInfo:
    model: str  # the served model name
    max_context_length: int | None  # prompt + output limit; None: the server did not say
    vocab_size: int | None  # None: the server did not say
    details: dict[str, Any] = field(default_factory=dict)  # e.g. mode, block size; recorded in the result


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    temperature: float = 0.0
    ignore_eos: bool = True  # exact output lengths; a server extension (vLLM, Baton)


@dataclass(slots=True)
class BenchRequest:
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None


class Backend(ABC):
    kind: str = ""

    def __init__(
        self, address: str, sampling: SamplingOptions, timeout_s: float, connect_timeout_s: float, tokenizer: Any = None
    ) -> None:
        self.address = address
        self.sampling = sampling
        self.timeout_s = timeout_s  # per request
        self.connect_timeout_s = connect_timeout_s
        self.tokenizer = tokenizer  # a local Hugging Face tokenizer, or None

    @abstractmethod
    async def probe(self, model: str | None) -> ServerInfo:
        """Connects, checks the model name (None: take the served one). Raises BenchInputError."""

    @abstractmethod
    async def send(self, request: BenchRequest) -> Response:
        """Sends one streaming request and times its chunks; failures go into Response.error."""

    @property
    def returns_reply_token_ids(self) -> bool:
        """Whether Response.output_token_ids is filled (multi-turn needs it)."""
        return self.tokenizer is not None

    @property
    def can_count_tokens(self) -> bool:
        """Whether count_tokens works (a local tokenizer, or the server's)."""
        return self.tokenizer is not None

    def check_prompts(self, uses_token_ids: bool) -> None:
        """Raises BenchInputError if this backend cannot send the workload's kind of prompt."""
        return None  # token ids and text both go by default

    async def count_tokens(self, texts: list[str], add_special_tokens: bool) -> list[int] | None:
        """Token counts of texts; None when no tokenizer is available."""
        if self.tokenizer is None:
            return None
        return [len(self.tokenizer.encode(t, add_special_tokens=add_special_tokens)) for t in texts]

    def reply_token_ids(self, text: str) -> list[int] | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def close(self) -> None:
        return None


def unreachable(kind: str, address: str, reason: str, hint: str) -> BenchInputError:
    return BenchInputError(f"cannot reach the {kind} server at {address}: {reason}. {hint}")
