"""The tensor-parallel group a model's layers communicate through.

Passed to every layer explicitly (no module-level state). With one rank every collective
is the identity; with several it goes through torch.distributed, whose backend (NCCL on
CUDA, gloo on CPU) was chosen by device when the group was created.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(slots=True)
class CollectiveStats:
    """Time spent in this rank's collectives (gloo calls block, so wall time is their cost;
    NCCL calls are asynchronous and are not timed)."""

    seconds: float = 0.0
    calls: int = 0

    def take(self) -> tuple[float, int]:
        taken = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed ProcessGroup; None with one rank
    stats: CollectiveStats = field(default_factory=CollectiveStats)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.process_group)
            self._timed(start)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        self._timed(start)
        return torch.cat(parts, dim=dim)

    def _timed(self, start: float) -> None:
        if (
            not torch.cuda.is_available()
            or self.process_group is None
            or dist.get_backend(self.process_group) != "nccl"
        ):
            self.stats.seconds += time.perf_counter() - start
            self.stats.calls += 1


SINGLE_RANK = TPGroup()


def backend_for_device(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise: chosen by device, never by a user flag."""
    return "nccl" if device.type == "cuda" else "gloo"
