"""The EAGLE drafter's forward pass over its own paged KV cache (one layer).

One call runs a batch of sequences, each a run of (token, feature) pairs at consecutive
positions, and returns the logits and the drafter's output g at each sequence's last one.
A request's drafter K/V starts at `base`, the first position the target handed back a
hidden state for (a prefix-cache hit skips the ones before), so cache index and position
differ by base:

    position:     base  base+1  ...  p           rotary embeddings see p
    cache index:  0     1       ...  p - base    slot: block_ids[c // B] * B + c % B

Rows with one token go first (the attention backend's decode rows), then the longer ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...model.attention import AttentionMetadata
from .eagle_model import EagleDrafter


@dataclass(slots=True)
class EagleSequence:
    block_ids: list[int]  # the request's drafter blocks, covering cache index start + len(token_ids)
    start: int  # cache index of the first new pair (the drafter K/V before it is valid)
    base: int  # position of cache index 0
    token_ids: list[int]  # t_{i+1} at each position i
    features: torch.Tensor  # [len(token_ids), H] h_i: the target's, or the drafter's own g


class EagleRunner:
    def __init__(self, drafter: EagleDrafter, block_size: int, num_blocks: int, device: torch.device) -> None:
        arch = drafter.arch
        self.drafter = drafter
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self._shape = (2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.kv_cache = torch.zeros(self._shape, dtype=drafter.dtype, device=device)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def release_kv_cache(self) -> None:
        """Frees the drafter's KV cache, as the target's goes on sleep."""
        self.kv_cache = torch.empty(0, dtype=self.kv_cache.dtype, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore_kv_cache(self) -> None:
        """The KV cache back (zeroed) at its size from start; a no-op when it is there."""
        if self.kv_cache.numel() == 0:
            self.kv_cache = torch.zeros(self._shape, dtype=self.kv_cache.dtype, device=self.device)

    @torch.inference_mode()
    def run(self, sequences: list[EagleSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, V] logits, [n, H] g) at each sequence's last pair, in the given order."""
        if self.kv_cache.numel() == 0:
            raise RuntimeError("the EAGLE drafter's KV cache is released (the engine sleeps): wake_up() first")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].token_ids) > 1)  # stable
        rows = [sequences[i] for i in order]
        num_tokens = np.array([len(s.token_ids) for s in rows], dtype=np.int64)
        starts = np.array([s.start for s in rows], dtype=np.int64)
        bases = np.array([s.base for s in rows], dtype=np.int64)
        seq_lens = starts + num_tokens
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=query_start_loc[1:])
        row_index = np.repeat(np.arange(len(rows)), num_tokens)
        cache_index = starts[row_index] + (np.arange(int(query_start_loc[-1])) - query_start_loc[row_index])
        block_tables = np.zeros((len(rows), max(len(s.block_ids) for s in rows)), dtype=np.int64)
        for i, s in enumerate(rows):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slots = block_tables[row_index, cache_index // self.block_size] * self.block_size
        slots += cache_index % self.block_size
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(block_tables, torch.int32),
            num_decodes=int((num_tokens == 1).sum()),
            max_query_len=int(num_tokens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.tensor([t for s in rows for t in s.token_ids], dtype=torch.long, device=self.device)
        features = torch.cat([s.features.to(self.device) for s in rows])
        positions = self._to_device(cache_index + bases[row_index])
        out = self.drafter(input_ids, features, positions, self.kv_cache, metadata)
        last = out[self._to_device(query_start_loc[1:] - 1)]
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        last = last[inverse.to(self.device)]
        return self.drafter.compute_logits(last), last

    def _to_device(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
