"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from baton.kernels import ops
from baton.kernels.ops import KernelImpl
from torch import nn

from .weights import LoadedWeight, copy_into, read_all


class RMSNorm(nn.Module):
    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device, impl: KernelImpl = "auto"
    ) -> None:
        super().__init__()
        self.eps = eps
        self.impl = impl
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        copy_into(param, read_all(loaded), "norm weight")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: the normed x. With it: (norm(x + residual), x + residual)."""
        out, new_residual = ops.rms_norm(x, self.weight, self.eps, residual, impl=self.impl)
        return out if residual is None else (out, new_residual)
