"""The per-request trace every metric is computed from.

A backend fills a `Response` (what it saw on the wire, times in seconds after the send);
the runner wraps it in a `RequestRecord` with the request's identity and schedule (times in
seconds after the run started). Both are plain facts; `metrics.py` derives TTFT, TPOT, ITL,
E2E and goodput from them, so the definitions live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    """Token counts the server reported at the end of the stream."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # prompt tokens served from the prefix cache; None: not reported


@dataclass(slots=True)
class Response:
    """What a backend observed for one streamed request."""

    sent_at: float  # time.perf_counter() just before the request went out
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried output
    chunk_num_tokens: list[int] = field(default_factory=list)  # output tokens in each such chunk (client-counted)
    end_s: float = 0.0  # when the stream ended
    usage: Usage | None = None
    finish_reason: str = ""
    error: str | None = None  # None: the request succeeded
    server_ttft_s: float | None = None  # the server's own TTFT (gRPC timings), from its arrival
    kv_path: str = ""  # gRPC timings: colocated | transferred | recomputed ...
    prefill_worker: str = ""
    decode_worker: str = ""
    output_token_ids: list[int] | None = None  # for a conversation's next turn; not written out
    output_text: str = ""  # idem

    @property
    def num_output_tokens(self) -> int:
        """Output tokens counted by the client."""
        return sum(self.chunk_num_tokens)


@dataclass(slots=True)
class RequestRecord:
    index: int  # dispatch order within the run
    session_id: int  # which conversation (single-turn workloads: one request each)
    turn: int  # 0-based turn within the conversation
    group: str  # workload group: request class, prefix group, turn number ...
    scheduled_s: float  # when it was due, after the run start
    start_s: float  # when it was sent, after the run start
    prompt_tokens: int | None  # client-side prompt length (None: a text prompt nobody counted)
    max_tokens: int
    response: Response
