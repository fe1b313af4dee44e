"""How a transfer's K/V travels: the sequence of tensors both sides agree on.

The prefill side's blocks of one request are often consecutive in memory (a fresh
allocation takes neighbouring blocks), and then each layer's K and V for a run of blocks is
one contiguous slice of the cache, sent as is. The sender picks the layout and announces
it in the header:

    segmented (few runs)   for each layer, for each run of consecutive source blocks:
                           K[run], V[run]                 zero-copy on the sender; zero-copy on
                                                          the receiver too where its blocks for
                                                          that run are consecutive
    packed (many runs)     for each layer: K/V of all the blocks gathered into one [2, n, ...]

The receiver derives the same runs from the source block ids it asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

SEGMENTED, PACKED = 0, 1
MAX_SEGMENTS = 8  # past this many runs, one gathered message per layer is cheaper


def runs(block_ids: Sequence[int], *aligned: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of consecutive ids in `block_ids`, and in every
    `aligned` list of the same length too (a run breaks where any of them jumps)."""
    lists = (block_ids, *aligned)
    out: list[tuple[int, int]] = []
    for i in range(len(block_ids)):
        if out and all(ids[i] == ids[i - 1] + 1 for ids in lists):
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def choose_layout(block_ids: Sequence[int]) -> int:
    return SEGMENTED if len(runs(block_ids)) <= MAX_SEGMENTS else PACKED


def outgoing(kv_caches: list[torch.Tensor], block_ids: Sequence[int], layout: int) -> Iterator[torch.Tensor]:
    """The tensors to send, in order (views into the cache where possible)."""
    if layout == PACKED:
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
        for kv in kv_caches:
            yield kv[:, index]
        return
    segments = runs(block_ids)
    for kv in kv_caches:
        for offset, length in segments:
            first = block_ids[offset]
            yield kv[0, first : first + length]
            yield kv[1, first : first + length]


def incoming(
    kv_caches: list[torch.Tensor], src_block_ids: Sequence[int], dst_block_ids: Sequence[int], layout: int
) -> list[tuple[torch.Tensor, Callable[[], None] | None]]:
    """(buffer to receive into, what to do once it arrived) for each message, in order.
    Buffers are views into the cache where the destination is contiguous."""
    plan: list[tuple[torch.Tensor, Callable[[], None] | None]] = []
    device = kv_caches[0].device
    if layout == PACKED:
        index = torch.tensor(dst_block_ids, dtype=torch.long, device=device)
        for kv in kv_caches:
            buffer = kv.new_empty((2, len(dst_block_ids), *kv.shape[2:]))
            plan.append((buffer, _scatter(kv, 1, index, buffer)))
        return plan
    segments = runs(src_block_ids)
    # Per segment, once for all layers: where its blocks go (first block if consecutive, else an index).
    targets = []
    for offset, length in segments:
        dst = dst_block_ids[offset : offset + length]
        consecutive = all(b == a + 1 for a, b in zip(dst, dst[1:]))
        targets.append((dst[0], None) if consecutive else (None, torch.tensor(dst, dtype=torch.long, device=device)))
    for kv in kv_caches:
        for (_, length), (first, index) in zip(segments, targets):
            for part in (kv[0], kv[1]):
                if index is None:
                    plan.append((part[first : first + length], None))
                else:
                    buffer = part.new_empty((length, *part.shape[1:]))
                    plan.append((buffer, _scatter(part, 0, index, buffer)))
    return plan


def _scatter(target: torch.Tensor, dim: int, index: torch.Tensor, buffer: torch.Tensor) -> Callable[[], None]:
    return lambda: target.index_copy_(dim, index, buffer)
