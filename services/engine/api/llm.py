"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Weight updates, pause and sleep (for RL rollouts) are the engine's (engine/weight_updates.py
documents them); here they run in the caller's thread, between `generate` calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ..config import EngineConfig
from ..engine_core import EngineCore
from ..execution.weight_sync import DEFAULT_BUCKET_BYTES
from ..weight_updates import PauseMode
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

    def update_weights_from_disk(self, path: str, weight_version: str | None = None, **kwargs: Any) -> str:
        return self.core.weights.update_weights_from_disk(path, weight_version, **kwargs)

    def update_weights_from_tensors(
        self, named_tensors: Sequence[tuple[str, torch.Tensor]], weight_version: str | None = None, **kwargs: Any
    ) -> str:
        return self.core.weights.update_weights_from_tensors(named_tensors, weight_version, **kwargs)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        self.core.weights.init_weights_update_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[torch.dtype | str],
        shapes: Sequence[Sequence[int]],
        weight_version: str | None = None,
        group_name: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        **kwargs: Any,
    ) -> str:
        return self.core.weights.update_weights_from_distributed(
            names, dtypes, shapes, weight_version, group_name, bucket_bytes, **kwargs
        )

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
