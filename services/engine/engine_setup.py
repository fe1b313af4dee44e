"""Engine start-up: cross-field checks against the model, the context limit, the executor."""

from __future__ import annotations

import logging

from ..model.config import ModelArch
from .config import EngineConfig
from .execution.executor import Executor, UniProcExecutor

logger = logging.getLogger(__name__)


def create_executor(config: EngineConfig, arch: ModelArch) -> Executor:
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config, arch)
    from .execution.tp_executor import RayTPExecutor  # imports Ray only when TP > 1

    return RayTPExecutor(config, arch)


def check_engine_config(config: EngineConfig, arch: ModelArch) -> None:
    """Cross-field checks that need the model's own config."""
    tp = config.parallel.tensor_parallel_size
    if arch.num_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {arch.num_heads} attention heads")
    if arch.num_kv_heads % tp and tp % arch.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's {arch.num_kv_heads} KV heads: one must divide the other"
        )
    if config.model.max_model_len and config.model.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} exceeds the model's "
            f"max_position_embeddings ({arch.max_position_embeddings})"
        )


def resolve_max_model_len(config: EngineConfig, arch: ModelArch, num_kv_blocks: int) -> int:
    """The context limit: asked for, else the model's own (capped by a sliding window and by
    what the KV cache can hold, with a warning)."""
    capacity = num_kv_blocks * config.cache.block_size
    if config.model.max_model_len is not None:
        if config.model.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.model.max_model_len} needs {config.model.max_model_len} KV slots "
                f"but the cache holds {capacity} ({num_kv_blocks} blocks of {config.cache.block_size}); "
                "raise the KV budget or lower max_model_len"
            )
        return config.model.max_model_len
    limit = arch.max_position_embeddings
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    if limit > capacity:
        logger.warning("context limit lowered from %d to %d tokens: that is all the KV cache holds", limit, capacity)
        limit = capacity
    return limit
