"""The draft model's forward pass: the target's model code, loaded the same way (a
`ModelRunner` at tensor-parallel size 1 builds it and its paged KV cache), fed by the
draft proposer rather than by the scheduler.

One call runs a batch of sequences, each a run of new tokens at known positions with the
blocks that hold its context (draft_rows.py lays them out), and returns the logits at each
sequence's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...model.config import ModelArch
from ...model.parallel import TPGroup
from ..execution.model_runner import ModelRunner
from .draft_rows import lay_out, to_device


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
        rows = lay_out(sequences, self.block_size, self.device)
        input_ids = [t for s in rows.in_rows(sequences) for t in s.token_ids]
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            to_device(rows.cache_index, self.device),  # the draft's cache index is the position
            self._runner.kv_caches,
            rows.metadata,
        )
        return self.model.compute_logits(hidden[rows.last_tokens])[rows.inverse]
