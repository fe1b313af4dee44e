"""Triton building blocks shared by the attention kernels: where a tile of context lives in
the paged KV cache, and the online-softmax update that folds one tile into the output.

    positions:   tile_start .. tile_start + BLOCK_N - 1      (a tile of one request's context)
    block:       block_table_row[pos // BLOCK_SIZE]
    row offset:  block * stride_block + (pos % BLOCK_SIZE) * stride_slot

Tile starts are multiples of BLOCK_N and both sizes are powers of two, so when BLOCK_N <=
BLOCK_SIZE a tile never crosses a block and one table load serves it. Otherwise each
position looks its block up; positions at or past `seq_len` get block 0 and must be masked
by the caller (the table may end before the tile does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .interpreter import cast_to, dot_operand

LOG2_E = 1.4426950408889634  # scores are kept in log2 units so the kernels can use exp2


def dot_precision(dtype: torch.dtype) -> str:
    """IEEE products for float32 (not TF32), so float32 matches the reference on a GPU too."""
    return "ieee" if dtype == torch.float32 else "tf32"


def compute_capability(device: torch.device) -> int:
    """The CUDA device's compute capability as major * 10 + minor (90 for Hopper), which some
    default launch shapes depend on; 0 off CUDA (the interpreter)."""
    if device.type != "cuda":
        return 0
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_capability(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return major * 10 + minor


@triton.jit
def paged_row_offsets(
    block_table_row_ptr,
    tile_start,
    seq_len,
    stride_block,
    stride_slot,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """int64 offsets [BLOCK_N] of each position's (block, slot) row; tile_start < seq_len."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    if BLOCK_N <= BLOCK_SIZE:
        block = tl.load(block_table_row_ptr + tile_start // BLOCK_SIZE).to(tl.int64)
        return block * stride_block + (positions % BLOCK_SIZE).to(tl.int64) * stride_slot
    else:
        blocks = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=positions < seq_len, other=0)
        return blocks.to(tl.int64) * stride_block + (positions % BLOCK_SIZE).to(tl.int64) * stride_slot


@triton.jit
def online_softmax_update(
    scores,
    v,
    acc,
    m_i,
    l_i,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Folds one tile into the running (acc, max, sum), all float32.

    scores [M, N] are in log2 units with masked entries at -inf; each row must have seen a
    finite score by now (in this tile or an earlier one), or its max stays -inf and 2^(-inf
    - -inf) is NaN. P is rounded to V's dtype for the second product, as FlashAttention does.
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = dot_operand(cast_to(p, v.dtype, INTERPRETED), INTERPRETED)
    acc = acc * alpha[:, None] + tl.dot(p, dot_operand(v, INTERPRETED), input_precision=DOT_PRECISION)
    return acc, m_new, l_i
