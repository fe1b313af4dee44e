"""Paged decode attention: one query token per request against its context, through the
block table, with a split-K (flash-decoding) variant for long contexts.

One program serves one (request, KV head) and all the query heads that share that KV head,
so each K/V tile is read from memory once per GQA group, not once per query head:

    query heads  [ h0 h1 h2 h3 | h4 h5 h6 h7 ]   GROUP = 4, rows padded to BLOCK_G >= 16
    KV heads     [     kv0     |     kv1     ]   program (r, kv1) loads kv1's tiles once

Split-K gives a request's context to several programs when (requests x KV heads) alone
cannot fill the GPU:

    context  [ split 0 | split 1 | split 2 | ... ]   each split: online softmax over its tokens,
                                                     writes acc / l and lse = m + log2(l)
    reduce   out = sum_s 2^(lse_s - max lse) * partial_s / sum_s 2^(lse_s - max lse)

The split count is one for the launch; each request cuts its own context into that many
pieces (whole tiles of BLOCK_N), so a short context beside a long one still spreads over the
programs, and a launch whose count was chosen for the longest possible context (a CUDA graph
captured for max_model_len) serves every shorter one the same way.

Scores live in the log2 domain (scale * log2(e) folded in) so the kernel uses exp2.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_tiles import LOG2_E, dot_precision, online_softmax_update, paged_row_offsets
from .checks import check_paged_attention, check_power_of_two
from .interpreter import cast_to, dot_operand, is_interpreter

# A split should stream at least this many tokens, or its partial write and the reduce
# pass cost more than the parallelism they buy.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64
# A GQA group is padded to at least this many query rows: tl.dot needs 16 along each dim.
MIN_GROUP_ROWS = 16


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split the context only when requests x KV heads leave SMs idle, and each split still
    streams MIN_TOKENS_PER_SPLIT or more tokens. Two programs per SM hide load latency."""
    num_programs = num_seqs * num_kv_heads
    target_programs = 2 * num_sms
    if num_programs >= target_programs:
        return 1
    by_occupancy = math.ceil(target_programs / num_programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@dataclass(frozen=True, slots=True)
class DecodeTiles:
    """Launch shape: BLOCK_N context tokens per step (a power of two >= 16, for tl.dot),
    and the compiler's warps and software-pipeline stages."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        check_power_of_two("block_n", self.block_n, 16, why=" (tl.dot)")

    @staticmethod
    def default(head_dim: int) -> DecodeTiles:
        """Long enough tiles to keep loads in flight; shorter at D=256 to fit registers."""
        return DecodeTiles(64) if head_dim <= 128 else DecodeTiles(32, num_stages=2)


@triton.jit
def split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per split of one request's context: its num_splits-th part, in whole tiles."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    num_splits,
    stride_qr,
    stride_qh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_or,
    stride_oh,
    stride_os,
    stride_lr,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (requests, KV heads, splits). Unsplit: writes out [R, H, D] in the query dtype.
    Split: writes the normalised partial [R, H, S, D] and its lse [R, H, S] in float32."""
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    tokens_per_split = split_tokens(seq_len, num_splits, BLOCK_N)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if start >= seq_len:
        return  # a split past the end of this request's context: the reduce skips it

    group_rows = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + group_rows
    dims = tl.arange(0, HEAD_DIM)
    is_head = group_rows[:, None] < GROUP
    q = tl.load(query_ptr + req * stride_qr + heads[:, None] * stride_qh + dims[None, :], mask=is_head, other=0.0)
    q = dot_operand(q, INTERPRETED)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    block_table_row_ptr = block_tables_ptr + req * stride_table
    # start is a multiple of BLOCK_N, so every tile holds at least one position < end.
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        is_valid = positions < end
        cache_rows = paged_row_offsets(
            block_table_row_ptr, tile_start, seq_len, stride_cache_block, stride_cache_slot, BLOCK_N, BLOCK_SIZE
        )
        offsets = cache_rows[:, None] + kv_head * stride_cache_head + dims[None, :]
        # A bfloat16 cache under a float32 query widens here, so both products run in
        # float32; .to is a no-op when the dtypes match.
        k = tl.load(key_cache_ptr + offsets, mask=is_valid[:, None], other=0.0).to(query_ptr.dtype.element_ty)
        v = tl.load(value_cache_ptr + offsets, mask=is_valid[:, None], other=0.0).to(query_ptr.dtype.element_ty)
        k = dot_operand(k, INTERPRETED)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(is_valid[None, :], scores, float("-inf"))
        acc, m_i, l_i = online_softmax_update(scores, v, acc, m_i, l_i, DOT_PRECISION, INTERPRETED)
    out = acc / l_i[:, None]
    out_offsets = req * stride_or + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(out_ptr + out_offsets, cast_to(out, out_ptr.dtype.element_ty, INTERPRETED), mask=is_head)
    if IS_SPLIT:
        lse = m_i + tl.log2(l_i)
        tl.store(lse_ptr + req * stride_lr + heads * stride_lh + split, lse, mask=group_rows < GROUP)


@triton.jit
def _reduce_splits_kernel(
    partial_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    num_splits,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_lr,
    stride_lh,
    stride_or,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Grid (requests, query heads): merges the splits that saw any context."""
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    num_used = tl.cdiv(seq_len, split_tokens(seq_len, num_splits, BLOCK_N))
    splits = tl.arange(0, BLOCK_S)
    is_used = splits < num_used
    dims = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + req * stride_lr + head * stride_lh + splits, mask=is_used, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    partial_offsets = req * stride_pr + head * stride_ph + splits[:, None] * stride_ps + dims[None, :]
    partial = tl.load(partial_ptr + partial_offsets, mask=is_used[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + req * stride_or + head * stride_oh + dims, cast_to(out, out_ptr.dtype.element_ty, INTERPRETED))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """query [R, H, D] (rows may be strided) -> out [R, H, D], contiguous; every seq_len >= 1.
    The caches hold the query's dtype or, under a float32 query, bfloat16.

    `max_seq_len` bounds seq_lens (pass it to avoid a device sync); `num_splits` (1: no
    split) and `tiles` override the split-K heuristic and the launch shape, for tests and tuning.
    """
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} queries (one per request)")
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    group = num_heads // num_kv_heads
    tiles = tiles or DecodeTiles.default(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device))
    # No split holds fewer than block_n tokens, so the longest context uses at most this many.
    num_splits = max(1, min(num_splits, triton.cdiv(max(max_seq_len, 1), tiles.block_n)))
    is_split = num_splits > 1

    if is_split:
        partial = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        target, target_split_stride = partial, partial.stride(2)
    else:
        lse = out  # unused when not split
        target, target_split_stride = out, 0
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        target,
        lse,
        scale * LOG2_E,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        target.stride(0),
        target.stride(1),
        target_split_stride,
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=tiles.block_n,
        BLOCK_SIZE=key_cache.shape[1],
        IS_SPLIT=is_split,
        DOT_PRECISION=dot_precision(query.dtype),
        INTERPRETED=is_interpreter(),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if is_split:
        _reduce_splits_kernel[(num_seqs, num_heads)](
            partial,
            lse,
            seq_lens,
            out,
            num_splits,
            partial.stride(0),
            partial.stride(1),
            partial.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_N=tiles.block_n,
            BLOCK_S=triton.next_power_of_2(num_splits),
            INTERPRETED=is_interpreter(),
        )
    return out


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 1  # the interpreter runs one program at a time: no SMs to fill


@functools.cache
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
