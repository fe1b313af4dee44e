"""Where the model runs: in this process (one rank) or on a tensor-parallel rank group.

The engine core talks to an `Executor` only: it sends each step's `SchedulerOutput` and
gets rank 0's `ModelRunnerOutput` back. `UniProcExecutor` runs one `ModelRank` in-process
(no Ray); `RayTPExecutor` (tp_executor.py) runs one Ray actor per rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

from ...kv_transfer.config import FaultInjection
from ...model.config import ModelArch
from ..config import EngineConfig
from ..core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from .model_rank import ModelRank, RankFailure

T = TypeVar("T")


class Executor(ABC):
    num_kv_blocks: int  # KV-cache blocks per rank (equal on every rank)
    kv_endpoints: tuple[str, ...] = ()  # each rank's KV transfer server (with a connector)
    device_name: str = "cpu"  # what the ranks run on (for utilisation metrics)
    dtype_bytes: int = 4  # bytes per weight element
    kv_cache_dtype: str = "float32"  # what the KV cache holds (handovers must match it)

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def set_kv_faults(self, faults: FaultInjection) -> None:
        """Fault injection on every rank's KV sends, for failure-path tests (refused unless
        kv_transfer.allow_fault_injection is set)."""

    @abstractmethod
    def run_on_ranks(self, fn: Callable[[ModelRank], T]) -> list[T]:
        """fn(rank) on every rank at once, between steps (weight updates, sleep); results in
        rank order. The first rank's error is raised here; the ranks keep running."""

    def shutdown(self) -> None:  # noqa: B027 - optional
        pass


def raise_rank_failures(results: list) -> list:
    """The results, or the first rank's error (with every failing rank named)."""
    failures = [r for r in results if isinstance(r, RankFailure)]
    if failures:
        error = failures[0].error
        if len(results) > 1:
            error.add_note(f"failed on tensor-parallel rank(s) {', '.join(str(f.rank) for f in failures)}")
        raise error
    return results


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, arch: ModelArch) -> None:
        self.rank = ModelRank(config, arch)
        self.num_kv_blocks = self.rank.load_model()
        self.rank.initialize_kv_cache(self.num_kv_blocks)
        endpoint = self.rank.kv_endpoint()
        self.kv_endpoints = (endpoint,) if endpoint else ()
        self.device_name = self.rank.device_name()
        self.dtype_bytes = self.rank.dtype_bytes()
        self.kv_cache_dtype = self.rank.kv_cache_dtype()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.rank.execute_model(scheduler_output)

    def set_kv_faults(self, faults: FaultInjection) -> None:
        self.rank.set_kv_faults(faults)

    def run_on_ranks(self, fn: Callable[[ModelRank], T]) -> list[T]:
        return raise_rank_failures([self.rank.call(fn)])

    def shutdown(self) -> None:
        self.rank.shutdown()
