"""Megatron-style linear layers. Column-parallel layers split the output features across
ranks and never communicate; row-parallel layers split the input features and all-reduce
their partial sums. Each parameter carries a `weight_loader` that reads its rank's shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import TPGroup
from .weights import LoadedWeight, copy_into, narrow, read_all, shape_of


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks: each rank holds [out/tp, in]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.tp = tp
        # Each logical output (e.g. gate and up) is split separately, then concatenated.
        self.shard_sizes = [_divide(size, tp.world_size, "linear output size") for size in output_sizes]
        self.weight = _param(sum(self.shard_sizes), input_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(sum(self.shard_sizes), dtype=dtype, device=device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: int = 0) -> None:
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        value = narrow(loaded, 0, self.tp.rank * size, size)
        copy_into(param.data.narrow(0, offset, size), value, f"shard {shard_id}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The merged q/k/v projection. Query heads split across ranks; KV heads split too, or,
    when there are fewer KV heads than ranks, each rank holds a replica of one KV head."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.world_size, "num_attention_heads")
        if num_kv_heads >= tp.world_size:
            self.num_kv_heads = _divide(num_kv_heads, tp.world_size, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            _divide(tp.world_size, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.world_size
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        single = TPGroup()  # sizes below are already per rank
        super().__init__(hidden_size, [q_size, kv_size, kv_size], bias, single, dtype, device)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: str = "q") -> None:
        index = "qkv".index(shard_id)
        size = self.shard_sizes[index]
        offset = sum(self.shard_sizes[:index])
        if shard_id == "q":
            start = self.tp.rank * self.num_heads * self.head_dim
        else:
            start = self.kv_head_start * self.head_dim
        copy_into(param.data.narrow(0, offset, size), narrow(loaded, 0, start, size), f"{shard_id}_proj")


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b, with W's input columns split across ranks."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool, tp: TPGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size_per_rank = _divide(input_size, tp.world_size, "linear input size")
        self.weight = _param(output_size, self.input_size_per_rank, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = _param(output_size, dtype=dtype, device=device)
            self.bias.weight_loader = self._bias_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        start = self.tp.rank * self.input_size_per_rank
        copy_into(param, narrow(loaded, 1, start, self.input_size_per_rank), "row-parallel weight")

    def _bias_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        assert len(shape_of(loaded)) == 1
        copy_into(param, read_all(loaded), "row-parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias
