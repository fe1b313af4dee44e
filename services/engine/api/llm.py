"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Weight updates, pause and sleep (for RL rollouts) are the engine's (engine/weight_updates.py
documents them); here they run in the caller's thread, between `generate` calls.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from typing import Any

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..weight_updates import PauseMode, WeightUpdates
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
        if self.core.weights.is_paused:
            raise RuntimeError("generation is paused (pause_generation): call continue_generation() first")
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

    # -- weight updates, pause, sleep (engine/weight_updates.py) ----------------------

    @property
    def weight_version(self) -> str:
        return self.core.weights.weight_version

    # Signatures and docs are WeightUpdates' own (functools.wraps), written once there.

    @functools.wraps(WeightUpdates.update_weights_from_disk)
    def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> str:
        return self.core.weights.update_weights_from_disk(*args, **kwargs)

    @functools.wraps(WeightUpdates.update_weights_from_tensors)
    def update_weights_from_tensors(self, *args: Any, **kwargs: Any) -> str:
        return self.core.weights.update_weights_from_tensors(*args, **kwargs)

    @functools.wraps(WeightUpdates.prepare_weights_from_disk)
    def prepare_weights_from_disk(self, *args: Any, **kwargs: Any) -> None:
        self.core.weights.prepare_weights_from_disk(*args, **kwargs)

    @functools.wraps(WeightUpdates.prepare_weights_from_tensors)
    def prepare_weights_from_tensors(self, *args: Any, **kwargs: Any) -> None:
        self.core.weights.prepare_weights_from_tensors(*args, **kwargs)

    @functools.wraps(WeightUpdates.commit_prepared_weights)
    def commit_prepared_weights(self, *args: Any, **kwargs: Any) -> str:
        return self.core.weights.commit_prepared_weights(*args, **kwargs)

    @functools.wraps(WeightUpdates.discard_prepared_weights)
    def discard_prepared_weights(self) -> None:
        self.core.weights.discard_prepared_weights()

    @functools.wraps(WeightUpdates.init_weights_update_group)
    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        self.core.weights.init_weights_update_group(*args, **kwargs)

    @functools.wraps(WeightUpdates.update_weights_from_distributed)
    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> str:
        return self.core.weights.update_weights_from_distributed(*args, **kwargs)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.core.weights.destroy_weights_update_group(group_name)

    def reset_prefix_cache(self) -> bool:
        return self.core.weights.reset_prefix_cache()

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Offline, nothing is in flight between `generate` calls; `generate` refuses to run
        until `continue_generation`."""
        self.core.weights.pause_generation(mode)

    def continue_generation(self) -> None:
        self.core.weights.continue_generation()

    def sleep(self, level: int = 1) -> None:
        self.core.weights.sleep(level)

    def wake_up(self) -> None:
        self.core.weights.wake_up()

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
