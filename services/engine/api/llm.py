"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from ..config import EngineConfig
from ..engine_core import EngineCore
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Runs the engine in this process until every given prompt is finished.

    Keyword arguments are engine settings (see `EngineConfig`): dtype, block_size,
    num_kv_blocks or kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, enable_chunked_prefill, max_model_len, seed, ...
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.core = EngineCore(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt (text, token ids, or {"prompt" | "prompt_token_ids": ...});
        returns one finished output per prompt, in order."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompts))
        prepared = []
        for prompt, sp in zip(prompts, params):
            final = dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY)
            prepared.append(self.core.prepare(f"offline-{next(self._ids)}", _prompt_value(prompt), final))
        for request in prepared:  # every prompt (and grammar) validated before any is queued
            request.wait_for_grammar()
        for request in prepared:
            self.core.submit(request)
        finished: dict[str, RequestOutput] = {}
        while self.core.has_unfinished_requests():
            for output in self.core.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request.request_id] for request in prepared]

    def shutdown(self) -> None:
        self.core.shutdown()


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    return prompts


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise TypeError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
