"""Attention over the paged KV cache, behind one backend interface.

The model runner describes the batch in `AttentionMetadata`; a backend writes the step's
new K/V into the cache and computes attention. The batch is ordered decodes first (one
query token each, attended in one batched call), then prefill chunks.

    tokens:  [ d0 d1 d2 | p0 p0 p0 p0 p1 p1 ]        num_decodes = 3
    query_start_loc: [0, 1, 2, 3, 7, 9]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from baton.kernels import ops
from baton.kernels.ops import KernelImpl
from torch import nn

from .rotary import RotaryEmbedding


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32: context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32 (padding entries are never read)
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache, then attends. kv_cache: [2, N, B, H_kv, D].
    With `rotary`, q and k are first rotated by `positions`, together with the cache write."""

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        rotary: RotaryEmbedding | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PagedAttentionBackend(AttentionBackend):
    """Backed by `baton.kernels.ops`: the torch reference or the Triton kernels."""

    def __init__(self, impl: KernelImpl) -> None:
        self.impl = impl
        self.name = impl

    def forward(self, q, k, v, kv_cache, metadata, scale, rotary=None, positions=None):
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        if rotary is not None:
            rotary.forward_and_cache(positions, q, k, v, key_cache, value_cache, metadata.slot_mapping)
        else:
            ops.reshape_and_cache(k, v, key_cache, value_cache, metadata.slot_mapping, impl=self.impl)
        num_decodes = metadata.num_decodes
        if num_decodes == metadata.num_reqs:
            return ops.paged_decode_attention(
                q,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                max_seq_len=metadata.max_seq_len,
                impl=self.impl,
            )
        out = torch.empty_like(q)
        if num_decodes:
            out[:num_decodes] = ops.paged_decode_attention(
                q[:num_decodes],
                key_cache,
                value_cache,
                metadata.block_tables[:num_decodes],
                metadata.seq_lens[:num_decodes],
                scale,
                max_seq_len=metadata.max_seq_len,
                impl=self.impl,
            )
        out[num_decodes:] = ops.prefill_attention(
            q[num_decodes:],
            key_cache,
            value_cache,
            metadata.block_tables[num_decodes:],
            metadata.query_start_loc[num_decodes:] - num_decodes,
            metadata.seq_lens[num_decodes:],
            scale,
            metadata.max_query_len,
            impl=self.impl,
        )
        return out


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata, rotary=None, positions=None) -> torch.Tensor:
        return self.backend.forward(q, k, v, kv_cache, metadata, self.scale, rotary, positions)
