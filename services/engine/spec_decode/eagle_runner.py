"""The EAGLE drafter's forward pass over its own paged KV cache (one layer).

One call runs a batch of sequences, each a run of (token, feature) pairs at consecutive
positions, and returns the logits and the drafter's output g at each sequence's last one.
A request's drafter K/V starts at `base`, the first position the target handed back a
hidden state for (a prefix-cache hit skips the ones before), so cache index and position
differ by base:

    position:     base  base+1  ...  p           rotary embeddings see p
    cache index:  0     1       ...  p - base    slot: block_ids[c // B] * B + c % B

draft_rows.py lays the batch out (one-token rows first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...model.cpu_tuning import release_freed_memory
from .draft_rows import lay_out, to_device
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
        release_freed_memory(self.device)

    def restore_kv_cache(self) -> None:
        """The KV cache back (zeroed) at its size from start; a no-op when it is there."""
        if self.kv_cache.numel() == 0:
            self.kv_cache = torch.zeros(self._shape, dtype=self.kv_cache.dtype, device=self.device)

    @torch.inference_mode()
    def run(self, sequences: list[EagleSequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """([n, V] logits, [n, H] g) at each sequence's last pair, in the given order."""
        if self.kv_cache.numel() == 0:
            raise RuntimeError("the EAGLE drafter's KV cache is released (the engine sleeps): wake_up() first")
        rows = lay_out(sequences, self.block_size, self.device)
        ordered = rows.in_rows(sequences)
        bases = np.array([s.base for s in ordered], dtype=np.int64)
        out = self.drafter(
            torch.tensor([t for s in ordered for t in s.token_ids], dtype=torch.long, device=self.device),
            torch.cat([s.features.to(self.device) for s in ordered]),
            to_device(rows.cache_index + bases[rows.row_index], self.device),
            self.kv_cache,
            rows.metadata,
        )
        last = out[rows.last_tokens][rows.inverse]
        return self.drafter.compute_logits(last), last
