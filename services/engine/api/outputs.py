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
# One entry per prompt token: None for the first (nothing precedes it), then the prompt
# token's logprob given the tokens before it, plus the top-N alternatives (vLLM's shape).
PromptLogprobs = list[dict[int, Logprob] | None]


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
    # The weight version in effect when this output was produced (None: not from an engine).
    # A request held across an update (pause mode "keep") reports the new one; its earlier
    # tokens came from the old weights (engine/weight_updates.py).
    weight_version: str | None = None
    # prompt_logprobs asked for: in the first output that has them (every output when cumulative).
    prompt_logprobs: PromptLogprobs | None = None

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


def merge_deltas(outputs: list[RequestOutput]) -> RequestOutput:
    """One delta output equal to `outputs` (consecutive deltas of one request) in order.

    A stream whose reader fell behind sends the backlog as one message: per sample the new
    tokens, text and logprobs concatenate, and everything that describes the request's state
    (finished, finish reasons, cached tokens, metrics, KV handover) comes from the latest."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    samples: dict[int, CompletionOutput] = {}
    for output in outputs:
        for piece in output.outputs:
            merged = samples.get(piece.index)
            if merged is None:
                samples[piece.index] = CompletionOutput(
                    piece.index,
                    piece.text,
                    list(piece.token_ids),
                    piece.cumulative_logprob,
                    None if piece.logprobs is None else list(piece.logprobs),
                    piece.finish_reason,
                    piece.stop_reason,
                )
                continue
            merged.text += piece.text
            merged.token_ids.extend(piece.token_ids)
            if piece.logprobs is not None:
                merged.logprobs = [*(merged.logprobs or []), *piece.logprobs]
            merged.cumulative_logprob = piece.cumulative_logprob
            merged.finish_reason, merged.stop_reason = piece.finish_reason, piece.stop_reason
    transfer = next((o.kv_transfer_params for o in reversed(outputs) if o.kv_transfer_params is not None), None)
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return RequestOutput(
        last.request_id,
        last.prompt,
        last.prompt_token_ids,
        list(samples.values()),
        last.finished,
        last.num_cached_tokens,
        last.metrics,
        transfer,
        last.kv_path,
        last.worker_id,
        last.weight_version,
        prompt_logprobs,
    )
