"""The tensor-parallel group a model's layers communicate through.

Passed to every layer explicitly (no module-level state). With one rank every collective
is the identity; with several it goes through torch.distributed, whose backend (NCCL on
CUDA, gloo on CPU) was chosen by device when the group was created.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    process_group: Any = None  # torch.distributed ProcessGroup; None with one rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.process_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=dim)


SINGLE_RANK = TPGroup()


def backend_for_device(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo otherwise: chosen by device, never by a user flag."""
    return "nccl" if device.type == "cuda" else "gloo"
