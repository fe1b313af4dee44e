"""Turns engine progress into `RequestOutput`s: detokenizes, applies stop strings, and
builds cumulative, delta or final outputs per the request's `output_kind`.

Prompt logprobs arrive with a request's first token and go out with its next output (every
output when cumulative). best_of > n: the best_of samples are held back until all finish,
then the n with the highest cumulative logprob go out, best first, renumbered 0 .. n - 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ...kv_transfer.types import KVTransferParams
from ..core.request import Request
from ..core.scheduler_output import SampledToken
from .detokenizer import IncrementalDetokenizer
from .handover import KVPath
from .outputs import CompletionOutput, Logprob, PromptLogprobs, RequestMetrics, RequestOutput, SampleLogprobs
from .sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class _SampleState:
    """One of a request's n samples."""

    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0  # for DELTA outputs
    finish_sent: bool = False


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[_SampleState]
    num_cached_tokens: int = 0
    touched: bool = False  # has news since the last output
    num_streamed_tokens: int | None = None  # tokens of all samples at the last output (None: none yet)
    kv_transfer_params: KVTransferParams | None = None
    kv_path: KVPath | None = None
    prompt_logprobs: PromptLogprobs | None = None  # once computed: None for the first token, then one dict each
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    @property
    def picks_best(self) -> bool:
        return self.params.num_samples > self.params.n


class OutputProcessor:
    def __init__(self, tokenizer: Any, worker_id: str = "", stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.worker_id = worker_id  # stamped on every output: which engine worker produced it
        self.stream_interval = stream_interval  # SchedulerConfig.stream_interval
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        num_samples: int,
        output_prefix: tuple[int, ...] = (),
    ) -> None:
        """`output_prefix`: tokens generated elsewhere (the prefill worker's first one); they
        are detokenization context and are not emitted again."""
        want_logprobs = params.logprobs is not None
        samples = [
            _SampleState(
                index=i,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer,
                    [*prompt_token_ids, *output_prefix],
                    params.skip_special_tokens,
                    params.stop,
                    params.include_stop_str_in_output,
                ),
                logprobs=[] if want_logprobs else None,
                cumulative_logprob=0.0 if params.needs_logprobs else None,
            )
            for i in range(num_samples)
        ]
        self.states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, RequestMetrics(arrival_time), samples
        )

    def on_token(
        self, request_id: str, index: int, token_id: int, sampled: SampledToken, request: Request
    ) -> str | None:
        """Records a generated token; returns the stop string it completed, if any."""
        state = self.states[request_id]
        sample = state.samples[index]
        sample.token_ids.append(token_id)
        if sampled.logprob is not None and sample.cumulative_logprob is not None:
            if sample.logprobs is not None:
                sample.logprobs.append(self._logprob_dict(sampled))
            sample.cumulative_logprob += sampled.logprob
        if sampled.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [None, *(self._logprob_dict(entry) for entry in sampled.prompt_logprobs)]
        self._note_progress(state, request)
        return sample.detokenizer.append(token_id)

    def on_finished(self, request_id: str, index: int, request: Request) -> None:
        state = self.states[request_id]
        sample = state.samples[index]
        if sample.finish_reason is not None:
            return
        sample.finish_reason = request.status.finish_reason
        sample.stop_reason = request.stop_reason
        sample.detokenizer.flush()
        self._note_progress(state, request)
        if state.finished:
            state.metrics.finished_time = time.monotonic()

    def abort(self, request_id: str) -> None:
        state = self.states.get(request_id)
        if state is None:
            return
        for sample in state.samples:
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        state.touched = True
        state.metrics.finished_time = time.monotonic()

    def set_kv_transfer_params(self, request_id: str, params: KVTransferParams) -> None:
        self.states[request_id].kv_transfer_params = params

    def set_final(
        self, request_id: str, index: int, token_ids: list[int], cumulative_logprob: float, finish_reason: str
    ) -> None:
        """Sets a sample's final tokens at once (beam search decides them only at the end)."""
        state = self.states[request_id]
        sample = state.samples[index]
        sample.token_ids = list(token_ids)
        sample.cumulative_logprob = cumulative_logprob
        sample.finish_reason = finish_reason
        sample.detokenizer.text = self.tokenizer.decode(token_ids, skip_special_tokens=state.params.skip_special_tokens)
        sample.detokenizer.stopped = True
        state.touched = True
        if state.finished:
            state.metrics.finished_time = time.monotonic()

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs for every request with news; finished requests are forgotten."""
        outputs = []
        for request_id, state in list(self.states.items()):
            if not state.touched:
                continue
            finished = state.finished
            if not finished and (state.picks_best or self._holds_back(state)):
                continue  # still touched: it goes out with a later step's tokens
            state.touched = False
            if finished:
                del self.states[request_id]
            if state.params.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
                continue
            state.num_streamed_tokens = sum(len(s.token_ids) for s in state.samples)
            outputs.append(self._make_output(state, finished))
        return outputs

    # -- internals --------------------------------------------------------------------

    def _holds_back(self, state: RequestState) -> bool:
        """Whether an unfinished request waits for more tokens before its next output: with a
        stream interval of k, after the first output, every k new tokens (or the end)."""
        if self.stream_interval == 1 or state.num_streamed_tokens is None:
            return False
        new_tokens = sum(len(s.token_ids) for s in state.samples) - state.num_streamed_tokens
        return new_tokens < self.stream_interval

    def _note_progress(self, state: RequestState, request: Request) -> None:
        state.touched = True
        state.num_cached_tokens = max(state.num_cached_tokens, request.num_cached_tokens)
        state.kv_path = request.kv_path or state.kv_path
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = request.first_scheduled_time
        if metrics.first_token_time is None and request.num_output_tokens:
            metrics.first_token_time = time.monotonic()
        metrics.num_preemptions = max(metrics.num_preemptions, request.num_preemptions)

    def _logprob_dict(self, sampled: SampledToken) -> dict[int, Logprob]:
        entries = {sampled.token_id: Logprob(sampled.logprob, sampled.rank, self._piece(sampled.token_id))}
        for rank, (token_id, logprob) in enumerate(sampled.top_logprobs, start=1):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, rank, self._piece(token_id))
        return entries

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        delta = state.params.output_kind == RequestOutputKind.DELTA
        completions = []
        samples = state.samples
        if state.picks_best:  # all finished (held back until then): the n best, renumbered
            ranked = sorted(samples, key=lambda s: s.cumulative_logprob or 0.0, reverse=True)
            samples = ranked[: state.params.n]
        for new_index, sample in enumerate(samples):
            text = sample.detokenizer.take_delta(sample.finish_reason is not None)
            if delta:
                begin = sample.num_sent_tokens
                sample.num_sent_tokens = len(sample.token_ids)
                if begin == len(sample.token_ids) and not text and (sample.finish_reason is None or sample.finish_sent):
                    continue  # nothing new for this sample
                token_ids = sample.token_ids[begin:]
                logprobs = None if sample.logprobs is None else sample.logprobs[begin:]
            else:
                text = (
                    sample.detokenizer.text
                    if sample.finish_reason is not None
                    else (sample.detokenizer.text[: sample.detokenizer.num_emitted_chars])
                )
                token_ids = list(sample.token_ids)
                logprobs = None if sample.logprobs is None else list(sample.logprobs)
            sample.finish_sent = sample.finish_reason is not None
            completions.append(
                CompletionOutput(
                    new_index if state.picks_best else sample.index,
                    text,
                    token_ids,
                    sample.cumulative_logprob,
                    logprobs,
                    sample.finish_reason,
                    sample.stop_reason,
                )
            )
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not (delta and state.prompt_logprobs_sent):
            prompt_logprobs, state.prompt_logprobs_sent = state.prompt_logprobs, True
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            completions,
            finished,
            state.num_cached_tokens,
            state.metrics,
            state.kv_transfer_params if finished else None,
            state.kv_path,
            self.worker_id,
            prompt_logprobs=prompt_logprobs,
        )
