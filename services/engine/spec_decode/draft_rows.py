"""The attention inputs of a drafter's batch over its own paged KV cache (a draft model's,
an EAGLE drafter's): sequences of new tokens, each at a known cache index with the blocks
that hold its context. Rows with one token go first (the attention backend's decode rows),
then the longer ones, stable within each group:

    tokens:   [ d_a | d_b | t_c t_c t_c ]     a, b: a draft fed back; c: catching up
    slot:     block_ids[c // B] * B + c % B   c: the token's cache index in its sequence
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from ...model.attention import AttentionMetadata


@dataclass(slots=True)
class DraftRows:
    order: list[int]  # the sequence in each row
    metadata: AttentionMetadata
    row_index: np.ndarray  # [num_tokens] the row of each token
    cache_index: np.ndarray  # [num_tokens] each token's cache index in its sequence
    last_tokens: torch.Tensor  # [num_rows] each row's last token in the flat batch
    inverse: torch.Tensor  # rows back to the sequences' order

    def in_rows(self, per_sequence: list) -> list:
        return [per_sequence[i] for i in self.order]


class DraftSequenceLike(Protocol):
    block_ids: list[int]  # the request's drafter blocks
    start: int  # cache index of the first new token
    token_ids: list[int]  # the new tokens


def lay_out(sequences: Sequence[DraftSequenceLike], block_size: int, device: torch.device) -> DraftRows:
    """The rows of `sequences`: each its new tokens from cache index `start`, in `block_ids`."""
    block_ids = [s.block_ids for s in sequences]
    starts = [s.start for s in sequences]
    num_tokens = [len(s.token_ids) for s in sequences]
    order = sorted(range(len(num_tokens)), key=lambda i: num_tokens[i] > 1)  # stable
    counts = np.array([num_tokens[i] for i in order], dtype=np.int64)
    first = np.array([starts[i] for i in order], dtype=np.int64)
    seq_lens = first + counts
    query_start_loc = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start_loc[1:])
    row_index = np.repeat(np.arange(len(order)), counts)
    cache_index = first[row_index] + (np.arange(int(query_start_loc[-1])) - query_start_loc[row_index])
    block_tables = np.zeros((len(order), max(len(block_ids[i]) for i in order)), dtype=np.int64)
    for row, i in enumerate(order):
        block_tables[row, : len(block_ids[i])] = block_ids[i]
    slots = block_tables[row_index, cache_index // block_size] * block_size + cache_index % block_size
    metadata = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        query_start_loc=to_device(query_start_loc, device, torch.int32),
        seq_lens=to_device(seq_lens, device, torch.int32),
        block_tables=to_device(block_tables, device, torch.int32),
        num_decodes=int((counts == 1).sum()),
        max_query_len=int(counts.max()),
        max_seq_len=int(seq_lens.max()),
    )
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(len(order))
    return DraftRows(
        order, metadata, row_index, cache_index, to_device(query_start_loc[1:] - 1, device), inverse.to(device)
    )


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
