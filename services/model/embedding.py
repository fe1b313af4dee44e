"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary (padded so all slices are equal)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .blocked_linear import BlockedWeight, uses_blocked_kernel
from .int8_linear import Int8Weight
from .linear import CpuPackable, _param, linear, pack_weight_for_cpu
from .parallel import TPGroup
from .weights import LoadedWeight, copy_into, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, embed_dim: int, tp: TPGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, vocab_size)
        self.weight = _param(self.shard_size, embed_dim, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight) -> None:
        rows = shape_of(loaded)[0]
        if rows != self.vocab_size:
            raise ValueError(f"vocabulary weight has {rows} rows, config says {self.vocab_size}")
        num_rows = self.vocab_end - self.vocab_start
        param.data.zero_()
        copy_into(param.data[:num_rows], narrow(loaded, 0, self.vocab_start, num_rows), "vocab shard")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_shard, input_ids - self.vocab_start, 0)
        embeds = F.embedding(local_ids, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(embeds)


class ParallelLMHead(VocabParallelEmbedding, CpuPackable):
    """logits = h W^T, each rank computing its vocabulary slice, gathered along vocab."""

    packed_weight: torch.Tensor | None = None  # the weight repacked for oneDNN (linear.py)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def pack_for_cpu(self, impl: str) -> bool:
        """A repacked copy (blocks, else oneDNN's layout): the weight itself stays dense for
        the embedding it may be tied to."""
        if uses_blocked_kernel(self.weight, impl):
            self.blocked = BlockedWeight.from_dense(self.weight)
            return True
        self.packed_weight = pack_weight_for_cpu(self.weight)
        return self.packed_weight is not None

    def quantize(self, impl: str) -> bool:
        """An int8 copy, as `pack_for_cpu`'s: the dense weight stays for a tied embedding."""
        scale = self._parameters.pop("weight_scale", None)  # staged by compressed_tensors.py
        self.int8 = Int8Weight.from_float(self.weight, impl, None if scale is None else scale.view(-1))
        if scale is not None:
            self.weight.data = self.int8.dequantize()  # it held the file's integers
        return True

    def unpack_for_loading(self, keep_values: bool = True) -> None:
        self.packed_weight = None  # stale once the dense weight changes; repacked after loading
        self.blocked = None
        self.int8 = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            logits = self.int8(hidden)
        elif self.blocked is not None:
            logits = self.blocked(hidden)
        else:
            logits = linear(hidden, self.weight if self.packed_weight is None else self.packed_weight)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - use compute_logits
        return self.compute_logits(hidden)
