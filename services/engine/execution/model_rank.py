"""One rank of the model: its device, its shard of the weights, its share of the KV cache.

In-process for tensor_parallel_size 1 (`UniProcExecutor`), or one Ray actor per rank
(`RayTPExecutor`). Start-up has phases, so a TP group can form before loading weights:

    ModelRank(config, arch, rank, world_size)   cheap; no torch.distributed yet
    .init_distributed(init_method)           TP > 1 only: joins the group (gloo / NCCL)
    .load_model()                            loads this rank's shard; returns KV blocks that fit
    .initialize_kv_cache(num_blocks)         the same count on every rank
    .execute_model(scheduler_output)         every step
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from ...kv_transfer.config import FaultInjection
from ...kv_transfer.connector import KVConnector
from ...kv_transfer.factory import create_connector
from ...model.config import ModelArch
from ...model.cpu_tuning import tune_malloc_for_cpu_inference
from ...model.linear import dense_parameters
from ...model.parallel import TPGroup, backend_for_device
from ...roles import Role
from ..config import EngineConfig
from ..core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from .hidden_rows import HIDDEN_STATES_FOR
from .model_runner import ModelRunner
from .rank_weights import RankWeights

T = TypeVar("T")

_CPU_DEFAULT_KV_BYTES = 512 * 2**20
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRank:
    def __init__(
        self, config: EngineConfig, arch: ModelArch, rank: int = 0, world_size: int = 1, num_threads: int | None = None
    ) -> None:
        self.config = config
        self.arch = arch
        self.rank = rank
        self.world_size = world_size
        self.device = resolve_device(config.runner.device)
        if self.device.type == "cpu":
            tune_malloc_for_cpu_inference()
        threads = config.runner.num_threads or num_threads
        if threads:
            torch.set_num_threads(threads)  # Ray sets OMP_NUM_THREADS=1 in actors
        self.tp = TPGroup()
        self.runner: ModelRunner | None = None
        self.weights: RankWeights | None = None
        self.connector: KVConnector | None = None
        self.num_kv_blocks = 0

    def node_address(self) -> tuple[str, int]:
        """This worker's host and a free TCP port on it (rank 0 hosts the group's store)."""
        host = "127.0.0.1" if self.device.type == "cpu" else socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def init_distributed(self, init_method: str) -> None:
        backend = backend_for_device(self.device)
        timeout = datetime.timedelta(seconds=self.config.parallel.rank_timeout_s)
        dist.init_process_group(
            backend, init_method=init_method, rank=self.rank, world_size=self.world_size, timeout=timeout
        )
        self.tp = TPGroup(self.rank, self.world_size, dist.group.WORLD)

    def load_model(self) -> int:
        """Loads this rank's shard; returns how many KV blocks this rank's budget holds."""
        if self.config.kv_transfer.role is not Role.COLOCATED:
            self.connector = create_connector(self.config.kv_transfer, self.rank, self.device)
        dtype = resolve_dtype(self.config.model.dtype, self.arch, self.device)
        self.runner = ModelRunner(
            model_dir=self.config.model.model,
            arch=self.arch,
            dtype=dtype,
            kv_cache_dtype=resolve_kv_cache_dtype(self.config.cache.kv_cache_dtype, dtype),
            device=self.device,
            block_size=self.config.cache.block_size,
            kernel_impl=self.config.runner.kernel_backend,
            tp=self.tp,
            connector=self.connector,
            hidden_states=HIDDEN_STATES_FOR.get(self.config.speculative.method),
            quantization=self.config.model.quantization,
        )
        self.weights = RankWeights(
            self.runner.model, self.arch, self.runner.checkpoint_layout, self.config.runner.kernel_backend, self.rank
        )
        return num_kv_blocks_for(self.config, self.runner.kv_block_bytes, self.device)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_kv_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        self.runner.release_kv_cache()

    def restore_kv_cache(self) -> None:
        self.runner.initialize_kv_cache(self.num_kv_blocks)

    def memory_bytes(self) -> tuple[int, int]:
        """(KV cache, weights) bytes this rank holds."""
        return self.runner.kv_cache_bytes, self.weights.num_bytes

    def call(self, fn: Callable[[ModelRank], T]) -> T | RankFailure:
        """fn(self), between steps (weight updates, sleep). An error comes back as a value so
        that a refused update does not end the rank group (Executor.run_on_ranks raises it)."""
        try:
            return fn(self)
        except Exception as e:  # handed to the driver
            return RankFailure(self.rank, e)
        finally:
            if self.runner is not None:
                self.runner.refresh_decode_graphs()  # fn may have moved weights or the KV cache

    def capture_decode_graphs(self, max_model_len: int) -> None:
        """engine.runner.cuda_graphs: decode steps of up to cuda_graph_max_batch_size rows
        replay graphs captured now (the engine calls this once it knows max_model_len)."""
        runner = self.config.runner
        max_batch_size = runner.cuda_graph_max_batch_size or self.config.scheduler.max_num_seqs
        self.runner.enable_decode_graphs(max_batch_size, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def dtype_bytes(self) -> int:
        """Bytes per weight element, as the runner resolved the configured dtype."""
        return self.runner.dtype.itemsize

    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype ("float32", "bfloat16", ...), as the runner resolved it."""
        return str(self.runner.kv_cache_dtype).removeprefix("torch.")

    def collective_stats(self) -> tuple[float, int]:
        """Seconds and calls spent in collectives since the last call (benchmarks)."""
        return self.tp.stats.take()

    def kv_endpoint(self) -> str | None:
        """Where decode workers reach this rank's KV transfer server (None: no connector)."""
        return self.connector.endpoint if self.connector is not None else None

    def set_kv_faults(self, faults: FaultInjection) -> None:
        """Fault injection on this rank's sends (see Executor.set_kv_faults)."""
        if self.connector is None:
            raise RuntimeError("this engine has no KV connector (kv_transfer.role is colocated): no sends to fault")
        self.connector.set_faults(faults)

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, on the CPU (for inspection and tests)."""
        return {name: p.cpu() for name, p in dense_parameters(self.runner.model).items()}

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(slots=True)
class RankFailure:
    rank: int
    error: Exception


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


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model running in `dtype` (auto: the same)."""
    if kv_cache_dtype == "auto" or _DTYPES[kv_cache_dtype] == dtype:
        return dtype
    if dtype != torch.float32:
        raise ValueError(
            f"cache.kv_cache_dtype {kv_cache_dtype} needs a float32 or {kv_cache_dtype} model; the model runs in "
            f"{str(dtype).removeprefix('torch.')}"
        )
    return _DTYPES[kv_cache_dtype]


def num_kv_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device) -> int:
    """KV-cache blocks that fit the configured budget (explicit count, bytes, or share of
    the device's free memory on CUDA), for one rank."""
    cache = config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = int(total * cache.gpu_memory_utilization) - used
        # Leave room for the activations of the largest step (a rough, conservative bound).
        budget -= 64 * 2**20
    else:
        budget = _CPU_DEFAULT_KV_BYTES
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise RuntimeError(f"the KV-cache budget ({budget} bytes) holds no block of {block_bytes} bytes")
    return num_blocks
