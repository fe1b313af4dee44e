"""What the engine returns to its callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...kv_transfer.types import KVTransferParams
from .handover import KVPath


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: the sampled token plus the top-N alternatives.
SampleLogprobs = list[dict[int, Logprob]]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples (or beams)
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # Disaggregation. Prefill side: where a decode worker fetches this prompt's K/V.
    kv_transfer_params: KVTransferParams | None = None
    # Decode side: how the prompt's K/V got here (TRANSFERRED | RECOMPUTED).
    kv_path: KVPath | None = None
    worker_id: str = ""  # the engine worker that produced it ("" offline)

    # Shortcuts for the common single-sample case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs
