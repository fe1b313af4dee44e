"""The draft model's forward pass: the target's model code, loaded the same way (a
`ModelRunner` at tensor-parallel size 1 builds it and its paged KV cache), fed by the
draft proposer rather than by the scheduler.

One call runs a batch of sequences, each a run of new tokens at known positions with the
blocks that hold its context, and returns the logits at each sequence's last token. Rows
with one token go first (the attention backend's decode rows), then the longer ones:

    tokens:   [ d_a | d_b | t_c t_c t_c ]     a, b: a draft fed back; c: catching up
    slot:     block_ids[pos // B] * B + pos % B
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...model.attention import AttentionMetadata
from ...model.config import ModelArch
from ...model.parallel import TPGroup
from ..execution.model_runner import ModelRunner


@dataclass(slots=True)
class DraftSequence:
    block_ids: list[int]  # the request's draft blocks, covering start + len(token_ids) positions
    start: int  # position of the first new token (the draft's K/V before it is valid)
    token_ids: list[int]  # the tokens to run; the logits come from the last one


class DraftRunner:
    def __init__(
        self,
        model_dir: str,
        arch: ModelArch,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        kernel_impl: str,
        num_blocks: int,
    ) -> None:
        self.arch = arch
        self.device = device
        self.block_size = block_size
        self._runner = ModelRunner(model_dir, arch, dtype, device, block_size, kernel_impl, TPGroup())
        self.num_blocks = num_blocks
        self._runner.initialize_kv_cache(num_blocks)
        self.model = self._runner.model

    @property
    def kv_cache_bytes(self) -> int:
        return self._runner.kv_cache_bytes

    def release_kv_cache(self) -> None:
        """Frees the draft's KV-cache tensors, as the target's go on sleep."""
        self._runner.release_kv_cache()

    def restore_kv_cache(self) -> None:
        """The draft's KV cache back (zeroed) at its size from start; a no-op when it is there."""
        if not self._runner.kv_caches:
            self._runner.initialize_kv_cache(self.num_blocks)

    @torch.inference_mode()
    def last_logits(self, sequences: list[DraftSequence]) -> torch.Tensor:
        """[len(sequences), V] float logits at each sequence's last token, in the given order."""
        if not self._runner.kv_caches:
            raise RuntimeError("the draft's KV cache is released (the engine sleeps): wake_up() first")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].token_ids) > 1)  # stable
        rows = [sequences[i] for i in order]
        num_tokens = np.array([len(s.token_ids) for s in rows], dtype=np.int64)
        starts = np.array([s.start for s in rows], dtype=np.int64)
        seq_lens = starts + num_tokens
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_tokens, out=query_start_loc[1:])
        row_index = np.repeat(np.arange(len(rows)), num_tokens)
        positions = starts[row_index] + (np.arange(int(query_start_loc[-1])) - query_start_loc[row_index])
        max_blocks = max(len(s.block_ids) for s in rows)
        block_tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
        for i, s in enumerate(rows):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slots = block_tables[row_index, positions // self.block_size] * self.block_size + positions % self.block_size
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
        hidden = self.model(input_ids, self._to_device(positions), self._runner.kv_caches, metadata)
        logits = self.model.compute_logits(hidden[self._to_device(query_start_loc[1:] - 1)])
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return logits[inverse.to(self.device)]

    def _to_device(self, array: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device=self.device, dtype=dtype)
