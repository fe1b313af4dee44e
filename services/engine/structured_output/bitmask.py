"""Token bitmasks as xgrammar lays them out: int32 words, bit j of word w allows token
32 * w + j. Applied with torch alone, so the sampler needs no grammar library."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size]: which tokens each row's bitmask allows."""
    bits = (bitmask.to(torch.int32).unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1
    return bits.flatten(-2)[..., :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Sets to -inf, in place, the logits of `rows` whose tokens their bitmask rows forbid."""
    index = torch.tensor(rows, device=logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
