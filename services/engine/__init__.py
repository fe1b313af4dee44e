"""Baton's serving engine: a plain library, usable without Ray or Redis.

from baton.services.engine import LLM, SamplingParams
llm = LLM(model="path/to/hf-folder")
outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from .async_llm import AsyncLLM
from .config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, RunnerConfig, SchedulerConfig
from .engine_core import EngineCore, EngineStats
from .errors import EngineDeadError, InvalidRequestError, ModelLoadError
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

__all__ = [
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
