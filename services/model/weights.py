"""Reading one tensor, or one slice of it, from a checkpoint.

A weight loader receives either a tensor or a safetensors slice handle; `narrow` reads
only the rows or columns a rank owns, so no rank ever holds another rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch

LoadedWeight = Any  # torch.Tensor or safetensors' lazy slice (supports [] and get_shape())


def shape_of(loaded: LoadedWeight) -> tuple[int, ...]:
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def narrow(loaded: LoadedWeight, dim: int, start: int, size: int) -> torch.Tensor:
    """loaded[start:start + size] along dim 0 or 1, reading only that part from disk."""
    if dim == 0:
        return loaded[start : start + size]
    if dim == 1:
        return loaded[:, start : start + size]
    raise ValueError(f"narrow supports dims 0 and 1, got {dim}")


def read_all(loaded: LoadedWeight) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_into(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(value.to(param.dtype))
