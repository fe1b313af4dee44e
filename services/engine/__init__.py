"""Baton's serving engine: a plain library, usable without Ray or Redis.

    from baton.services.engine import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Names are imported on first use, so light modules (block_hash, kv_events, tokenizer,
sampling_params) can be imported without pulling in torch and the model code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": ".api.llm",
    "AsyncLLM": ".api.async_llm",
    "EngineCore": ".engine_core",
    "EngineStats": ".stats",
    "EngineConfig": ".config",
    "ModelConfig": ".config",
    "CacheConfig": ".config",
    "SchedulerConfig": ".config",
    "ParallelConfig": ".config",
    "RunnerConfig": ".config",
    "SamplingParams": ".api.sampling_params",
    "RequestOutputKind": ".api.sampling_params",
    "RequestOutput": ".api.outputs",
    "CompletionOutput": ".api.outputs",
    "Logprob": ".api.outputs",
    "InvalidRequestError": ".errors",
    "EngineDeadError": ".errors",
    "ModelLoadError": ".errors",
}
__all__ = [  # noqa: F822 - resolved lazily by __getattr__
    "LLM",
    "AsyncLLM",
    "EngineCore",
    "EngineStats",
    "EngineConfig",
    "ModelConfig",
    "CacheConfig",
    "SchedulerConfig",
    "ParallelConfig",
    "RunnerConfig",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "InvalidRequestError",
    "EngineDeadError",
    "ModelLoadError",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .api.async_llm import AsyncLLM
    from .api.llm import LLM
    from .api.outputs import CompletionOutput, Logprob, RequestOutput
    from .api.sampling_params import RequestOutputKind, SamplingParams
    from .config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
    from .engine_core import EngineCore
    from .errors import EngineDeadError, InvalidRequestError, ModelLoadError
    from .stats import EngineStats
