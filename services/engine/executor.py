"""Where the model runs: in this process (one rank) or on a tensor-parallel worker group.

The engine core talks to an `Executor` only: it sends each step's `SchedulerOutput` and
gets rank 0's `ModelRunnerOutput` back. `UniProcExecutor` runs the model runner in-process
(no Ray); the Ray TP executor lives in `services/engine/tp_executor.py`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from ..model.config import ModelArch
from ..model.parallel import SINGLE_RANK
from .config import EngineConfig
from .model_runner import ModelRunner
from .scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 512 * 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Executor(ABC):
    num_kv_blocks: int  # KV-cache blocks per rank (equal on every rank)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ModelArch) -> None:
        device = resolve_device(config.runner.device)
        if config.runner.num_threads:
            torch.set_num_threads(config.runner.num_threads)
        self.runner = ModelRunner(
            model_dir=config.model.model,
            arch=arch,
            dtype=resolve_dtype(config.model.dtype, arch, device),
            device=device,
            block_size=config.cache.block_size,
            kernel_impl=config.runner.kernel_backend,
            tp=SINGLE_RANK,
        )
        self.num_kv_blocks = num_kv_blocks_for(config, self.runner.kv_block_bytes, device)
        self.runner.initialize_kv_cache(self.num_kv_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(device)


def resolve_dtype(dtype: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype on CUDA; float32 on CPU (bf16 matmuls are slow there)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(arch.torch_dtype).removeprefix("torch."), torch.bfloat16)


def num_kv_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """KV-cache blocks that fit the configured budget (explicit count, bytes, or share of
    the device's free memory on CUDA)."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
        # Leave room for activations of the largest step (a rough, conservative bound).
        budget -= 64 * 2**20
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise RuntimeError(f"the KV-cache budget ({budget} bytes) holds no block of {block_bytes} bytes")
    return num_blocks
