"""What the NIXL transport reads and says: where a rank's blocks lie in memory (a READ's
descriptors), the checksum both sides take, and block ids as runs in messages."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .wire_layout import runs


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """Where a rank's blocks lie: block b's K (half 0) or V (half 1) in layer l starts at
    bases[l] + (half * num_blocks + b) * block_bytes."""

    bases: tuple[int, ...]
    num_blocks: int
    block_bytes: int  # one block of K (or V) of one layer
    device_id: int
    mem_type: str  # NIXL's "DRAM" or "VRAM"

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> CacheLayout:
        first = kv_caches[0]
        for kv in kv_caches:
            if not kv.is_contiguous() or kv.shape != first.shape or kv.dtype != first.dtype:
                raise ValueError("NIXL needs every layer's cache contiguous and of one shape and dtype")
        return cls(
            bases=tuple(kv.data_ptr() for kv in kv_caches),
            num_blocks=first.shape[1],
            block_bytes=first[0, 0].numel() * first.element_size(),
            device_id=max(first.get_device(), 0),
            mem_type="VRAM" if first.is_cuda else "DRAM",
        )

    @classmethod
    def from_message(cls, fields: dict) -> CacheLayout:
        return cls(**{**fields, "bases": tuple(fields["bases"])})

    def descriptors(self, segments: Sequence[tuple[int, int]]) -> np.ndarray:
        """(address, bytes, device) rows: per layer, per half, per (first block, length) segment."""
        rows = [
            (base + (half * self.num_blocks + first) * self.block_bytes, length * self.block_bytes, self.device_id)
            for base in self.bases
            for half in (0, 1)
            for first, length in segments
        ]
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def checksum(kv_caches: list[torch.Tensor], block_ids: Sequence[int]) -> int:
    """crc32 of the blocks' K and V, layer by layer, in `block_ids` order (both sides agree)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    crc = 0
    for kv in kv_caches:
        crc = zlib.crc32(kv.index_select(1, index).contiguous().view(torch.uint8).cpu().numpy(), crc)
    return crc


def encode_blocks(block_ids: Sequence[int]) -> list[list[int]]:
    """Block ids as [first, length] runs: a claim stays small for long prompts."""
    return [[block_ids[offset], length] for offset, length in runs(block_ids)]


def decode_blocks(block_runs: list[list[int]]) -> tuple[int, ...]:
    return tuple(block for first, length in block_runs for block in range(first, first + length))
